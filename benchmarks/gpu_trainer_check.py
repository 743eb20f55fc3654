"""GPU check of the policy trainer on one H200: bf16 and FP8 (Transformer Engine) training steps of a ~1B GPT,
MFU against the H200's peak, and the FP8-vs-bf16 loss difference after 20 steps.

    .venv/bin/python benchmarks/gpu_trainer_check.py [--steps 20] [--fp8-recipe tensorwise|delayed]

Model (default, ~0.9B parameters): 16 layers, hidden 2048, 16 heads, ffn 5504 (SwiGLU), vocab 32768, tied
embeddings, sequence 4096, `micro_batch_size` x `num_microbatches` sequences per step. Both runs use the
trainer's own `Policy` (Megatron-Core TE spec, DDP, Megatron optimizer with fp32 main weights) started with
`init_distributed(source="single")`, the trainer's exact log-prob function for the loss (mean -log p of the
next token), the SAME initial weights (the bf16 model's parameters are copied into the FP8 model) and the
SAME batches: a synthetic learnable stream (each sequence an arithmetic progression mod vocab, random start
and stride), so the loss falls over 20 steps and precision differences show.

MFU = model FLOPs / step time / peak. Model FLOPs per token (training = 3 x forward):
    3 * [2 * L * (qkv + proj + fc1 + fc2 params) + 2 * V * h  (logits)  + 2 * L * s * h  (causal QK^T and PV)]
Peaks (H200 SXM datasheet, dense): bf16 989 TFLOP/s, FP8 1979 TFLOP/s; the FP8 run is reported against both.
Timing: steps after `--warmup` are timed with CUDA synchronisation; the median step is used.

Without CUDA or without Transformer Engine it prints one JSON object {"status": "skipped", "reason": ...} and
exits with code 2 (nothing to measure on this machine). Otherwise prints one JSON object with the figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

H200_PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}
"""H200 SXM dense peak (NVIDIA datasheet: 1,979 / 3,958 TFLOP/s bf16 / FP8 are with 2:4 sparsity)."""
EXIT_UNAVAILABLE = 2


def unavailable_reason() -> str | None:
    """Why this script cannot run here (no CUDA device, no Transformer Engine), or None."""
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available (no GPU or a CPU-only torch build): this check needs an NVIDIA GPU (H200)"
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a TE build that does not match the driver/torch
        return (f"Transformer Engine is not importable ({type(e).__name__}: {e}); install it "
                "(pip install transformer_engine[pytorch]) or use an NGC PyTorch container")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"FP8 needs compute capability >= 8.9 (Hopper/Ada); this GPU has {major}.{minor}"
    return None


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

    from megatron_rl.models.gpt import ModelConfig
    from megatron_rl.trainer.logprobs import token_logprobs_and_entropy
    from megatron_rl.trainer.policy import OptimConfig, Policy

    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      num_query_groups=args.groups, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                      max_seq_length=args.seq, params_dtype="bf16", transformer_impl="transformer_engine", fp8=fp8)
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=16, help="query groups (16 = plain multi-head attention)")
    p.add_argument("--ffn", type=int, default=5504)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from the timing")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--logprob-chunk", type=int, default=4096, help="tokens per chunk of the fp32 log-prob pass")
    p.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "delayed"])
    args = p.parse_args()

    reason = unavailable_reason()
    if reason is not None:
        print(json.dumps({"benchmark": "gpu_trainer_check", "status": "skipped", "reason": reason}))
        print(f"gpu_trainer_check: cannot run here: {reason}", file=sys.stderr)
        return EXIT_UNAVAILABLE

    import torch

    from megatron_rl.distributed import init_distributed

    ctx = init_distributed(source="single")
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    batches = make_batches(args, args.steps, torch.device("cuda"))
    bf16, init_params = run(args, ctx, "none", batches, None)
    torch.cuda.empty_cache()  # the bf16 policy is gone with run()'s frame
    fp8, _ = run(args, ctx, args.fp8_recipe, batches, init_params)
    diff = [a - b for a, b in zip(fp8["losses"], bf16["losses"])]
    print(json.dumps({
        "benchmark": "gpu_trainer_check", "status": "ok", "device": torch.cuda.get_device_name(),
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "groups", "ffn", "vocab", "seq")},
        "tokens_per_step": args.seq * args.micro_batch_size * args.num_microbatches,
        "peak_tflops": H200_PEAK_TFLOPS, "bf16": bf16, f"fp8_{args.fp8_recipe}": fp8,
        "fp8_minus_bf16_loss_final": round(diff[-1], 5),
        "fp8_vs_bf16_loss_rel_diff_final": round(abs(diff[-1]) / max(abs(bf16["losses"][-1]), 1e-12), 5),
        "fp8_vs_bf16_loss_max_abs_diff": round(max(abs(d) for d in diff), 5),
        "fp8_speedup_vs_bf16": round(bf16["step_s_median"] / fp8["step_s_median"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
