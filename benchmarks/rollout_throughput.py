"""Rollout engine throughput vs Hugging Face `generate()` on the same tiny model and weights (CPU).

Builds the policy with `build_gpt`, copies its weights into a `LlamaForCausalLM` built from a config (no
download; Megatron's fused QKV [ng, q-per-group + 2, d, H] and GLU fc1 [gate; up] are split), checks that
both generate the same greedy tokens, then times greedy generation of `--new-tokens` tokens for batches of
1, 8 and 32 prompts of mixed lengths: our engine (paged KV cache, continuous batching) vs HF generate
(contiguous cache, left padding). Also reports KV-cache bytes per generated-context token: the paged pool's
peak blocks in use vs a contiguous [batch, max_len] cache. Prints one JSON object.

    .venv/bin/python benchmarks/rollout_throughput.py [--new-tokens 64] [--batches 1 8 32]
    .venv/bin/python benchmarks/rollout_throughput.py --hf-model models/SmolLM2-135M-Instruct --batches 32
    # the main job's rollout shape (configs/post_train_cpu.yaml: group_size 8, max_new_tokens 40, 1 thread/rank)
    .venv/bin/python benchmarks/rollout_throughput.py --hf-model models/SmolLM2-135M-Instruct --batches 32 \
        --repeats 1 --new-tokens 20 --group-size 8 --threads 1 [--dtype bf16]

`--hf-model DIR`: a real model instead of the tiny random one: ours is built from it as the RL loop builds
it (`model.init: hf:DIR`, the weights loaded into the Megatron model), HF's `from_pretrained(DIR)`; prompts are
its chat template around arithmetic questions, so both sides see the same token ids.

Fairness: HF runs in a child process that never imports megatron_rl, so the CPU compat layer's
TorchFunctionMode (a Python hook on every torch call) is not active there; it uses its own KV cache
(`generate` default), the same thread count, dtype (`--dtype`, fp32 by default) and `max_new_tokens` with
`min_new_tokens` equal to it and no EOS (so neither side stops early) -- a setting where continuous batching
cannot help. The `rl_workload` section measures what it is for: 4 x batch requests whose lengths are long-tailed as RL
responses ending at EOS are (lognormal, median 2*new/4, at most 2*new tokens), at most `batch` at once;
ours joins the next request as soon as one finishes, HF runs static batches until their longest member ends;
tokens/s counts the requested tokens on both sides; `max_running` = batch bounds ours to as many sequences at once
as HF's batch holds (a request's n samples count n: before that fix forked samples ran past it, 128 sequences
against HF's 32, which made this ratio ~3x instead of ~2.4x). With `--hf-model`, `rl_sampled` is the RL
workload itself: pure sampling (temperature 1) until the model's own end-of-turn token or 2 x new tokens, the
samples of a group ending at their own lengths (see `_rl_sampled`). Both sides get one untimed warm-up; then the runs
alternate between the two (`--repeats` each) and the best time of each side is compared, which keeps a
loaded machine's noise out of the ratio as far as possible. `*_median_s` are reported too, and
`speedup_cpu_time`: the same ratio of process CPU seconds, which a loaded machine inflates far less than wall
time (with `--threads 1`, what each of the main job's 2 ranks gets on 2 cores; with more threads, spinning
OpenMP workers count as CPU time too).

`--backends native,vllm,hf` (needs `--hf-model`; any subset): instead of the sections above, the three-way
comparison of our engine, vLLM (`engine.backend: vllm`'s VLLMEngine: a vLLM process from `--vllm-python`, made by
scripts/setup_vllm.sh) and HF `generate`, on two workloads at each `--concurrency` c: `rl_sampled` (`--prompts`
chat prompts x `--group-size` samples, pure sampling until the model's end-of-turn token or 2 x new tokens)
and `static_batch` (c prompts, greedy, exactly `--new-tokens` each, no stop). Equal concurrency: vLLM's
max_num_seqs = our max_running = c, HF static batches of c sequences; `best`: each side's fastest c. Per side:
tokens/s and CPU-seconds per useful token (vLLM: the proxy's plus its process's, all threads); `ratios`: ours
over each other side. `parity`: greedy tokens equal pairwise, and log-prob agreement (each engine's log-probs
of its own greedy and T=1 tokens against HF's teacher-forced log-softmax; ours vs vLLM's on the same greedy
tokens). vLLM is bound to the same cores (VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)) and started once per c
(`vllm_start_s`); repeats use fresh prompts on every side (vLLM's prefix cache outlives a run, ours does not).

    .venv/bin/python benchmarks/rollout_throughput.py --backends native,vllm,hf \
        --hf-model models/SmolLM2-135M-Instruct --concurrency 8 32 --prompts 8 --group-size 4 --new-tokens 20

`--dtype bf16`: both sides hold bf16 weights and KV cache (ours: `params_dtype: bf16`, as `rollout.engine.dtype:
bf16` builds the engine; HF: `torch_dtype=bfloat16`); both take log-softmax/argmax of fp32-cast logits. Greedy
parity is then not exact (different bf16 rounding on each side); `greedy_agreement` reports the fraction of
greedy tokens equal before the first difference. `--hf-dtype fp32` keeps HF in fp32 (its fastest setting
here) while ours runs bf16: reported as such, never as a same-dtype ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from megatron_rl.models.gpt import ModelConfig

CFG = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, vocab_size=384,
                  max_seq_length=512)


HF_DIR: str | None = None
"""--hf-model: the real model's folder (None: the tiny random CFG)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_ours():
    from megatron.core import tensor_parallel

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.convert.source import initializer
    from megatron_rl.distributed import init_distributed
    from megatron_rl.models.gpt import build_gpt
    from megatron_rl.parallel import ParallelConfig

    ctx = init_distributed(ParallelConfig(), source="single")
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_gpt(CFG, ParallelConfig(), ctx.pgs)
    initializer(CFG)(model) if CFG.init else init_weights_by_name(model, seed=0)
    return model.eval(), ctx.pgs


def to_hf(model):
    """A LlamaForCausalLM holding `model`'s weights (name mapping + QKV/GLU reshapes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    h, nh, ng = CFG.hidden_size, CFG.num_attention_heads, CFG.num_query_groups
    d, f = h // nh, 4 * h
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=h, intermediate_size=f, num_hidden_layers=CFG.num_layers,
        num_attention_heads=nh, num_key_value_heads=ng, max_position_embeddings=CFG.max_seq_length,
        rms_norm_eps=model.config.layernorm_epsilon, rope_theta=CFG.rotary_base, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, hidden_act="silu")).eval()
    sd = dict(model.named_parameters())
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    for i in range(CFG.num_layers):
        out.update(_layer_to_hf(sd, f"decoder.layers.{i}.", f"model.layers.{i}.", ng, nh // ng, d, f))
    missing, unexpected = hf.load_state_dict(out, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return hf


def _layer_to_hf(sd: dict, src: str, dst: str, ng: int, r: int, d: int, f: int) -> dict:
    qkv = sd[src + "self_attention.linear_qkv.weight"]  # [ng * (r + 2) * d, H]
    qkv = qkv.view(ng, r + 2, d, -1)  # [ng, r + 2, d, H]
    fc1 = sd[src + "mlp.linear_fc1.weight"]  # [2F, H] = [gate; up]
    norm1 = sd.get(src + "input_layernorm.weight", sd.get(src + "self_attention.linear_qkv.layer_norm_weight"))
    norm2 = sd.get(src + "pre_mlp_layernorm.weight", sd.get(src + "mlp.linear_fc1.layer_norm_weight"))
    return {
        dst + "self_attn.q_proj.weight": qkv[:, :r].reshape(ng * r * d, -1),
        dst + "self_attn.k_proj.weight": qkv[:, r].reshape(ng * d, -1),
        dst + "self_attn.v_proj.weight": qkv[:, r + 1].reshape(ng * d, -1),
        dst + "self_attn.o_proj.weight": sd[src + "self_attention.linear_proj.weight"],
        dst + "mlp.gate_proj.weight": fc1[:f], dst + "mlp.up_proj.weight": fc1[f:],
        dst + "mlp.down_proj.weight": sd[src + "mlp.linear_fc2.weight"],
        dst + "input_layernorm.weight": norm1, dst + "post_attention_layernorm.weight": norm2,
    }


def prompts(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if HF_DIR:
        from megatron_rl.tokenizer import HFTokenizer

        tok = HFTokenizer(HF_DIR)
        questions = [f"What is {rng.randrange(2, 50)} + {rng.randrange(2, 10)}?" for _ in range(batch)]
        return [tok.prompt_ids([{"role": "user", "content": q}]) for q in questions]
    return [[257] + [rng.randrange(32, 127) for _ in range(rng.randrange(16, 48))] for _ in range(batch)]


@torch.inference_mode()
def run_hf(hf, batch_prompts: list[list[int]], new: int) -> tuple[list[list[int]], float, float]:
    """Generated tokens, wall seconds and this process's CPU seconds."""
    width = max(map(len, batch_prompts))
    ids = torch.tensor([[256] * (width - len(p)) + p for p in batch_prompts])  # [B, W] left-padded
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in batch_prompts])[:, None]).long()
    t0, c0 = time.perf_counter(), time.process_time()
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, pad_token_id=256, eos_token_id=None)
    return out[:, width:].tolist(), time.perf_counter() - t0, time.process_time() - c0


def _engine(model, pgs, max_running: int):
    """Our engine as both workloads run it: a pool that never preempts, at most `max_running` sequences."""
    from megatron_rl.rollout import EngineConfig, RolloutEngine

    return RolloutEngine(model, EngineConfig(num_blocks=1024, block_size=16, max_tokens_per_step=2048,
                                             max_running=max_running), pgs.tp, pgs.cp)


def run_ours(model, pgs, batch_prompts: list[list[int]], new: int | list[int], max_running: int = 64, n: int = 1
             ) -> tuple[list[list[int]], float, int, float]:
    """Greedy generation of `new` tokens per prompt (or new[i] for prompt i), at most `max_running` at once:
    tokens, wall seconds, peak KV bytes, CPU seconds."""
    from megatron_rl.rollout import SamplingParams

    eng = _engine(model, pgs, max_running)
    news = new if isinstance(new, list) else [new] * len(batch_prompts)
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_new_tokens=m, n=n))
           for p, m in zip(batch_prompts, news)]
    outs, peak, t0, c0 = [], 0, time.perf_counter(), time.process_time()
    while eng.has_work:
        outs += eng.step()
        peak = max(peak, eng.cache.num_blocks - eng.cache.num_free)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    order = {o.request_id: o.samples[0].token_ids for o in outs}
    return [order[i] for i in ids], dt, peak * 16 * eng.cache.bytes_per_token(), cpu


@torch.inference_mode()
def run_hf_sampled(hf, batch_prompts: list[list[int]], cap: int, stop: list[int], seed: int
                   ) -> tuple[list[list[int]], float, float]:
    """Pure sampling (temperature 1, no top-k/top-p) until a stop token or `cap` new tokens; each row's tokens
    up to and including its stop token (what the batch generated after it is padding), wall and CPU seconds."""
    width = max(map(len, batch_prompts))
    ids = torch.tensor([[stop[0]] * (width - len(p)) + p for p in batch_prompts])  # [B, W] left-padded
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in batch_prompts])[:, None]).long()
    torch.manual_seed(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cap, do_sample=True, temperature=1.0,
                      top_k=0, top_p=1.0, eos_token_id=stop, pad_token_id=stop[0])
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        rows.append(row[:end])
    return rows, dt, cpu


@torch.inference_mode()
def score_hf(hf, prompt: list[int], tokens: list[int]) -> list[float]:
    """Teacher-forced log-softmax (fp32) of `tokens` after `prompt`: the reference log-probs."""
    logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


class HFWorker:
    """`run_hf` in a child process without megatron_rl imported; one JSON request/answer per line."""

    def __init__(self, model, threads: int, dtype: str = "fp32"):
        self.dir = tempfile.TemporaryDirectory(prefix="hf-bench-")
        if HF_DIR is None:
            hf = to_hf(model)
            hf.config.save_pretrained(self.dir.name)
            torch.save({k: v.detach().float().clone() for k, v in hf.state_dict().items()},
                       os.path.join(self.dir.name, "sd.pt"))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        cmd = [sys.executable, __file__, "--hf-worker", HF_DIR or self.dir.name, "--threads", str(threads),
               "--dtype", dtype]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, batch_prompts: list[list[int]], new: int) -> tuple[list[list[int]], float, float]:
        self.proc.stdin.write(json.dumps({"prompts": batch_prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        ans = json.loads(self.proc.stdout.readline())
        return ans["tokens"], ans["seconds"], ans["cpu_seconds"]

    def run_sampled(self, batch_prompts: list[list[int]], cap: int, stop: list[int], seed: int
                    ) -> tuple[list[list[int]], float, float]:
        self.proc.stdin.write(json.dumps({"prompts": batch_prompts, "new": cap, "stop": stop, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        ans = json.loads(self.proc.stdout.readline())
        return ans["tokens"], ans["seconds"], ans["cpu_seconds"]

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """HF's log-probs of each (prompt, tokens) pair (teacher-forced)."""
        self.proc.stdin.write(json.dumps({"score": pairs}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.dir.cleanup()


def hf_worker(path: str, dtype: str = "fp32") -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    # no CPU compat layer here (its torch-function modes hook every op): only megatron_rl's import-time
    # deferred_compile, which patches nothing once Megatron is imported
    assert not {"megatron_rl.compat.cpu", "megatron_rl.compat.device_check"} & set(sys.modules), sorted(sys.modules)
    assert not torch.overrides._get_current_function_mode_stack()
    if not os.path.exists(os.path.join(path, "sd.pt")):  # a real HF folder (--hf-model)
        hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=DTYPES[dtype]).eval()
    else:
        hf = LlamaForCausalLM(LlamaConfig.from_pretrained(path)).eval()
        hf.load_state_dict(torch.load(os.path.join(path, "sd.pt"), weights_only=True), strict=False)
        hf.tie_weights()
        hf = hf.to(DTYPES[dtype])
    for line in sys.stdin:
        req = json.loads(line)
        if "score" in req:
            t0, c0 = time.perf_counter(), time.process_time()
            lps = [score_hf(hf, prompt, toks) for prompt, toks in req["score"]]
            print(json.dumps({"tokens": lps, "seconds": time.perf_counter() - t0,
                              "cpu_seconds": time.process_time() - c0}), flush=True)
            continue
        if req.get("stop"):
            tokens, dt, cpu = run_hf_sampled(hf, req["prompts"], req["new"], req["stop"], req["seed"])
        else:
            tokens, dt, cpu = run_hf(hf, req["prompts"], req["new"])
        print(json.dumps({"tokens": tokens, "seconds": dt, "cpu_seconds": cpu}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--hf-model", help="a real HF model folder (Llama architecture) instead of the tiny model")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="weights and KV cache of both sides")
    p.add_argument("--hf-dtype", choices=list(DTYPES), help="HF's dtype when it differs from --dtype (reported)")
    p.add_argument("--group-size", type=int, default=1,
                   help="rl_workload: samples per prompt (the RL loop's group_size; one request with n samples)")
    p.add_argument("--backends", help="comma-separated sides among native,vllm,hf: the three-way comparison "
                   "(needs --hf-model) instead of the native-vs-HF sections; e.g. native,vllm,hf")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32],
                   help="--backends: sequences at once (vLLM max_num_seqs = our max_running = HF batch)")
    p.add_argument("--prompts", type=int, default=8, help="--backends: prompts of the rl_sampled workload")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="--backends with vllm: the vLLM environment's python (engine.vllm.python)")
    p.add_argument("--hf-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.hf_worker:
        return hf_worker(args.hf_worker, args.dtype)
    if args.backends:
        return main_backends(args)
    if args.hf_model:
        global CFG, HF_DIR
        from megatron_rl import config as C
        from megatron_rl.convert.source import resolve

        HF_DIR = args.hf_model
        CFG = C.from_dict(ModelConfig, {"init": f"hf:{args.hf_model}", "max_seq_length": 512})
        resolve(CFG)  # the checkpoint's shape
    CFG = dataclasses.replace(CFG, params_dtype=args.dtype)
    model, pgs = build_ours()
    hf = HFWorker(model, args.threads, args.hf_dtype or args.dtype)
    try:
        result = _measure(model, pgs, hf, args)
    finally:
        hf.close()
    print(json.dumps(result))


def main_backends(args) -> None:
    """--backends: the three-way comparison (measure_backends) as one JSON object."""
    global CFG, HF_DIR
    from megatron_rl import config as C
    from megatron_rl.convert.source import resolve

    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad or not args.backends:
        raise SystemExit(f"--backends {bad or args.backends}: choose among {', '.join(BACKENDS)}")
    if not args.hf_model:
        raise SystemExit("--backends needs --hf-model DIR (vLLM loads an HF folder; rl_sampled ends at its "
                         "end-of-turn token)")
    if min(args.concurrency) < args.group_size:
        raise SystemExit(f"--concurrency {args.concurrency}: each must hold a group (--group-size {args.group_size})")
    HF_DIR = args.hf_model
    CFG = C.from_dict(ModelConfig, {"init": f"hf:{args.hf_model}", "max_seq_length": 512})
    resolve(CFG)
    CFG = dataclasses.replace(CFG, params_dtype=args.dtype)
    model, pgs = build_ours()
    hf = HFWorker(model, args.threads, args.hf_dtype or args.dtype) if "hf" in args.backends else None
    log_dir = tempfile.TemporaryDirectory(prefix="vllm-bench-")
    vllm = VLLMSide(args.vllm_python, args.threads, args.dtype, log_dir.name) if "vllm" in args.backends else None
    try:
        result = {"model": HF_DIR, "backends": args.backends, "dtype": args.dtype, "threads": args.threads,
                  "new_tokens": args.new_tokens, "rl_cap": 2 * args.new_tokens, "group_size": args.group_size,
                  "prompts": args.prompts, "concurrency": args.concurrency, "repeats": args.repeats,
                  **measure_backends(model, pgs, hf, vllm, args)}
    finally:
        if vllm is not None:
            vllm.close()
        if hf is not None:
            hf.close()
        log_dir.cleanup()
    print(json.dumps(result))


def _measure(model, pgs, hf: HFWorker, args) -> dict:
    check = prompts(4, seed=99)
    ours_check, hf_check = run_ours(model, pgs, check, 16)[0], hf.run(check, 16)[0]
    result = {"model": {"init": CFG.init or "random", "layers": CFG.num_layers, "hidden": CFG.hidden_size,
                        "heads": CFG.num_attention_heads,
                        "kv_heads": CFG.num_query_groups}, "new_tokens": args.new_tokens,
              "greedy_parity_with_hf": ours_check == hf_check,
              "greedy_agreement": round(agreement(ours_check, hf_check), 3), "dtype": args.dtype,
              "hf_dtype": args.hf_dtype or args.dtype, "threads": args.threads, "repeats": args.repeats,
              "hf_in_subprocess_without_compat": True, "batches": {}}
    for b in args.batches:
        bp = prompts(b, seed=b)
        ours_out, hf_out = run_ours(model, pgs, bp, args.new_tokens)[0], hf.run(bp, args.new_tokens)[0]  # warm-up
        t_ours, t_hf, c_ours, c_hf, kv_paged = [], [], [], [], 0
        for _ in range(args.repeats):
            _, t, kv_paged, c = run_ours(model, pgs, bp, args.new_tokens)
            t_ours.append(t)
            c_ours.append(c)
            _, t, c = hf.run(bp, args.new_tokens)
            t_hf.append(t)
            c_hf.append(c)
        gen = b * args.new_tokens
        ctx_tokens = sum(len(x) for x in bp) + gen
        contiguous = b * (max(map(len, bp)) + args.new_tokens)
        result["batches"][str(b)] = {
            "ours_tokens_per_s": round(gen / min(t_ours), 1), "hf_tokens_per_s": round(gen / min(t_hf), 1),
            "speedup": round(min(t_hf) / min(t_ours), 2), "speedup_cpu_time": round(min(c_hf) / min(c_ours), 2),
            "ours_median_s": round(statistics.median(t_ours), 4), "hf_median_s": round(statistics.median(t_hf), 4),
            "same_greedy_tokens": ours_out == hf_out,
            "kv_bytes_per_token_paged": round(kv_paged / ctx_tokens, 1),
            "kv_bytes_per_token_contiguous": round(contiguous * _bytes_per_token() / ctx_tokens, 1)}
    result["speedup_at_32"] = result["batches"].get("32", {}).get("speedup")
    result["rl_workload"] = {str(b): _rl_workload(model, pgs, hf, b, args) for b in args.batches}
    result["rl_workload_speedup_at_32"] = result["rl_workload"].get("32", {}).get("speedup")
    if HF_DIR:  # the real model's own end-of-turn tokens end the samples
        result["rl_sampled"] = {str(b): _rl_sampled(model, pgs, hf, b, args) for b in args.batches}
        result["rl_sampled_speedup_at_32"] = result["rl_sampled"].get("32", {}).get("speedup")
    result["target_speedup_at_32"] = 3.0
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens equal before each row's first difference (1.0: identical greedy outputs)."""
    same = 0
    for x, y in zip(a, b):
        same += next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return same / max(1, sum(map(len, b)))


def rl_lengths(n: int, cap: int, seed: int) -> list[int]:
    """Long-tailed response lengths like RL rollouts: lognormal, median cap/4, clipped to [4, cap]."""
    rng = random.Random(seed)
    return [min(cap, max(4, int(rng.lognormvariate(math.log(cap / 4), 0.8)))) for _ in range(n)]


def _rl_workload(model, pgs, hf: HFWorker, b: int, args) -> dict:
    """4*b requests whose responses end at different lengths (as EOS ends them in RL), `b` generating at once.
    Ours: continuous batching (a finished request leaves, the next joins at once). HF generate(): static
    batches of `b` in the same order, each running until its longest member ends (a finished sequence keeps
    its slot, as with EOS in a batch). Both count only the requested (useful) tokens. `--group-size g`: 4*b/g
    prompts of g samples each (the RL loop's groups): ours prefills each prompt once and its g samples share
    its KV blocks; HF's batches repeat each prompt g times (as `num_return_sequences` does). All g samples of a
    prompt get its length (less spread inside HF's batches than RL's, so no extra padding waste for HF)."""
    g = args.group_size
    if b % g:
        raise SystemExit(f"--group-size {g} must divide every batch size (got {b})")
    n = 4 * b // g  # prompts; each gives g samples of the same length (one request with n=g, as the RL loop asks)
    bp, lens = prompts(n, seed=1000 + b), rl_lengths(n, 2 * args.new_tokens, seed=b)
    per = b // g  # prompts per HF static batch: each repeated g times (what generate's num_return_sequences does)
    batches = [([p for p in bp[i:i + per] for _ in range(g)], max(lens[i:i + per])) for i in range(0, n, per)]
    run_ours(model, pgs, bp[:per], lens[:per], max_running=b, n=g)        # warm-up
    t_ours, t_hf, c_ours, c_hf = [], [], [], []
    for _ in range(args.repeats):
        _, t, _, c = run_ours(model, pgs, bp, lens, max_running=b, n=g)
        t_ours.append(t)
        c_ours.append(c)
        runs = [hf.run(p, m) for p, m in batches]
        t_hf.append(sum(r[1] for r in runs))
        c_hf.append(sum(r[2] for r in runs))
    useful = g * sum(lens)
    return {"requests": n, "group_size": g, "useful_tokens": useful,
            "hf_generated_tokens": sum(len(p) * m for p, m in batches),
            "ours_tokens_per_s": round(useful / min(t_ours), 1), "hf_tokens_per_s": round(useful / min(t_hf), 1),
            "speedup": round(min(t_hf) / min(t_ours), 2), "speedup_cpu_time": round(min(c_hf) / min(c_ours), 2),
            "ours_cpu_s": round(min(c_ours), 2), "hf_cpu_s": round(min(c_hf), 2)}


def run_ours_sampled(model, pgs, batch_prompts: list[list[int]], cap: int, stop: list[int], max_running: int,
                     n: int, seed: int) -> tuple[list[list[int]], float, float]:
    """Each prompt's `n` samples (one request, pure sampling) until a stop token or `cap` tokens, at most
    `max_running` sequences at once: the samples' tokens, wall and CPU seconds."""
    from megatron_rl.rollout import SamplingParams

    eng = _engine(model, pgs, max_running)
    for i, p in enumerate(batch_prompts):
        eng.add_request(p, SamplingParams(temperature=1.0, max_new_tokens=cap, n=n, seed=seed + i,
                                          stop_token_ids=stop))
    outs, t0, c0 = [], time.perf_counter(), time.process_time()
    while eng.has_work:
        outs += eng.step()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return [s.token_ids for o in outs for s in o.samples], dt, cpu


def _rl_sampled(model, pgs, hf: HFWorker, b: int, args) -> dict:
    """The RL workload itself: 4*b/g chat prompts, g samples each, pure sampling (temperature 1) until the
    model's own end-of-turn token or 2*new tokens, at most `b` sequences at once on both sides. Ours: each
    sample leaves when it ends and a waiting prompt joins once its g samples fit; HF: static batches of b//g
    prompts x g, each running until its last sample ends. The samples differ between the sides (different
    random streams), so tokens/s counts each side's own useful tokens (up to and including the stop token);
    their mean lengths are reported to show the two length distributions agree."""
    from megatron_rl.tokenizer import HFTokenizer

    g, cap = args.group_size, 2 * args.new_tokens
    stop = HFTokenizer(HF_DIR).stop_ids
    n, per = 4 * b // g, b // g
    bp = prompts(n, seed=2000 + b)
    run_ours_sampled(model, pgs, bp[:per], cap, stop, b, g, seed=0)  # warm-up
    tried = {"ours": [], "hf": []}  # (wall s, CPU s, samples' tokens) of each repeat
    for r in range(args.repeats):
        toks, t, c = run_ours_sampled(model, pgs, bp, cap, stop, b, g, seed=100 * r)
        tried["ours"].append((t, c, toks))
        runs = [hf.run_sampled([p for p in bp[i:i + per] for _ in range(g)], cap, stop, 100 * r + i)
                for i in range(0, n, per)]
        tried["hf"].append((sum(x[1] for x in runs), sum(x[2] for x in runs), [row for x in runs for row in x[0]]))
    side = {}
    for name, runs in tried.items():
        t, c, toks = min(runs, key=lambda x: x[0] / sum(map(len, x[2])))  # the best wall time per token
        useful = sum(map(len, toks))
        side[name] = {"tokens_per_s": useful / t, "cpu_s_per_token": c / useful, "useful": useful,
                      "mean_len": useful / len(toks), "at_cap": sum(len(x) >= cap for x in toks) / len(toks)}
    o, h = side["ours"], side["hf"]
    return {"requests": n, "group_size": g, "cap": cap, "samples": n * g,
            "ours_tokens_per_s": round(o["tokens_per_s"], 1), "hf_tokens_per_s": round(h["tokens_per_s"], 1),
            "speedup": round(o["tokens_per_s"] / h["tokens_per_s"], 2),
            "speedup_cpu_time": round(h["cpu_s_per_token"] / o["cpu_s_per_token"], 2),
            "ours_mean_len": round(o["mean_len"], 1), "hf_mean_len": round(h["mean_len"], 1),
            "ours_at_cap": round(o["at_cap"], 3), "hf_at_cap": round(h["at_cap"], 3),
            "ours_useful_tokens": o["useful"], "hf_useful_tokens": h["useful"]}


# ------------------------------------------------------------------------------ --backends native,vllm,hf
BACKENDS = ("native", "vllm", "hf")


class VLLMSide:
    """vLLM engines for the benchmark: `rollout.vllm_engine.VLLMEngine` (what engine.backend=vllm runs), one
    process per concurrency (vLLM's max_num_seqs = c, as our max_running = c), on the same cores as the other
    sides (VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)); its CPU seconds are this process's (the proxy) plus
    the vLLM process's (/proc/PID/stat: all its threads)."""

    def __init__(self, python: str, threads: int, dtype: str, log_dir: str):
        self.python, self.threads, self.dtype, self.log_dir = python, threads, dtype, log_dir
        self.engine, self.c = None, None
        self.start_s: list[float] = []

    def at(self, c: int):
        """The engine with max_num_seqs = c (the previous one stopped when c changes)."""
        from megatron_rl.rollout import EngineConfig
        from megatron_rl.rollout.vllm_engine import VLLMConfig, VLLMEngine

        if self.c != c:
            self.close()
            bind = "0" if self.threads == 1 else f"0-{self.threads - 1}"
            t0 = time.perf_counter()
            self.engine = VLLMEngine(VLLMConfig(python=self.python, cpu_threads_bind=bind),
                                     EngineConfig(max_running=c, seed=0), f"hf:{HF_DIR}", CFG.max_seq_length,
                                     {"fp32": "float32", "bf16": "bfloat16"}[self.dtype], log_dir=self.log_dir)
            self.start_s.append(time.perf_counter() - t0)
            self.c = c
        return self.engine

    def cpu(self) -> float:
        """CPU seconds of the vLLM process so far."""
        fields = open(f"/proc/{self.engine.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine, self.c = None, None


def drive(eng, requests: list[tuple[list[int], object]], extra_cpu=None) -> tuple[list, float, float]:
    """Submit every (prompt, SamplingParams) at once and step `eng` (ours or the vLLM proxy) until all finish:
    the samples (prompt order), wall and CPU seconds (this process + `extra_cpu()`: the vLLM process's)."""
    ids = [eng.add_request(p, sp) for p, sp in requests]
    x0 = extra_cpu() if extra_cpu else 0.0
    outs, t0, c0 = {}, time.perf_counter(), time.process_time()
    while eng.has_work:
        outs.update((o.request_id, o) for o in eng.step())
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0 + (extra_cpu() - x0 if extra_cpu else 0.0)
    return [s for i in ids for s in outs[i].samples], dt, cpu


def run_side(side: str, c: int, requests: list[tuple[list[int], object]], model, pgs, hf: HFWorker,
             vllm: VLLMSide | None) -> tuple[list[list[int]], float, float]:
    """One side runs `requests` with at most `c` sequences at once: the samples' tokens, wall and CPU s.
    HF: static batches of c // n prompts x n samples (its generate has no continuous batching)."""
    if side == "native":
        samples, t, cpu = drive(_engine(model, pgs, c), requests)
        return [s.token_ids for s in samples], t, cpu
    if side == "vllm":
        eng = vllm.at(c)
        samples, t, cpu = drive(eng, requests, vllm.cpu)
        return [s.token_ids for s in samples], t, cpu
    sp, n = requests[0][1], requests[0][1].n
    per = max(1, c // n)
    rows, t, cpu = [], 0.0, 0.0
    for i in range(0, len(requests), per):
        batch = [p for p, _ in requests[i:i + per] for _ in range(n)]
        if sp.temperature == 0:
            out, dt, dc = hf.run(batch, sp.max_new_tokens)
        else:
            out, dt, dc = hf.run_sampled(batch, sp.max_new_tokens, list(sp.stop_token_ids), sp.seed + i)
        rows, t, cpu = rows + out, t + dt, cpu + dc
    return rows, t, cpu


def _workloads(args) -> dict:
    """The two workloads as request lists, per repeat (different prompts each repeat and for the warm-up).
    rl: `--prompts` chat prompts x `--group-size` samples, pure sampling (T=1) until the model's end-of-turn
    token or 2 x new tokens (the RL loop's rollouts); static: greedy, exactly `new` tokens per prompt, no stop."""
    from megatron_rl.rollout import SamplingParams
    from megatron_rl.tokenizer import HFTokenizer

    stop, g, cap = HFTokenizer(HF_DIR).stop_ids, args.group_size, 2 * args.new_tokens

    def rl(seed: int, k: int):
        return [(p, SamplingParams(temperature=1.0, max_new_tokens=cap, n=g, seed=seed + 10 * i,
                                   stop_token_ids=stop)) for i, p in enumerate(prompts(k, seed=seed))]

    def static(seed: int, k: int):
        return [(p, SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)) for p in prompts(k, seed=seed)]

    return {"rl_sampled": rl, "static_batch": static}


def _side_figures(runs: list[tuple[list[list[int]], float, float]]) -> dict:
    """Tokens/s and CPU-s/token of a side's best repeat (by wall time per useful token)."""
    toks, t, c = min(runs, key=lambda x: x[1] / max(1, sum(map(len, x[0]))))
    useful = sum(map(len, toks))
    return {"tokens_per_s": round(useful / t, 1), "cpu_s_per_token": round(c / useful, 5), "useful_tokens": useful,
            "mean_len": round(useful / len(toks), 1), "wall_s": round(t, 2), "cpu_s": round(c, 2)}


def measure_backends(model, pgs, hf: HFWorker, vllm: VLLMSide | None, args) -> dict:
    """Every side in `--backends` on both workloads at each concurrency of `--concurrency` (equal concurrency:
    vLLM's max_num_seqs = our max_running = HF's batch = c), repeats alternating between the sides; then each
    side's best over the concurrencies. Plus greedy parity and log-prob agreement (see `agreement_figures`)."""
    sides = args.backends
    work = _workloads(args)
    out: dict = {"parity": agreement_figures(model, pgs, hf, vllm, args)}
    for name, make in work.items():
        table = {}
        for c in args.concurrency:
            k = args.prompts if name == "rl_sampled" else c
            n = args.group_size if name == "rl_sampled" else 1
            for side in sides:  # untimed warm-up, one batch (vLLM: its engine for this c starts here)
                run_side(side, c, make(7000 + c, max(1, c // n)), model, pgs, hf, vllm)
            tried = {side: [] for side in sides}
            for r in range(args.repeats):
                reqs = make(100 * (r + 1) + c, k)
                for side in sides:
                    tried[side].append(run_side(side, c, reqs, model, pgs, hf, vllm))
            table[str(c)] = {side: _side_figures(tried[side]) for side in sides}
            table[str(c)]["ratios"] = _ratios(table[str(c)], sides)
            print(f"[bench] {name} c={c}: " + json.dumps(table[str(c)]), file=sys.stderr, flush=True)
        best = {side: max(((c, f[side]) for c, f in table.items()), key=lambda x: x[1]["tokens_per_s"])
                for side in sides}
        out[name] = {"requests": args.prompts if name == "rl_sampled" else "c",
                     "samples_per_request": args.group_size if name == "rl_sampled" else 1,
                     "equal_concurrency": table,
                     "best": {side: {"concurrency": int(c), **f} for side, (c, f) in best.items()},
                     "best_ratios": _ratios({s: f for s, (_, f) in best.items()}, sides)}
    if vllm is not None:
        out["vllm_start_s"] = [round(x, 1) for x in vllm.start_s]
    return out


def _ratios(fig: dict, sides: list[str]) -> dict:
    """native's speed over each other side: tokens/s ratio and CPU-s/token ratio (> 1: native better)."""
    if "native" not in sides:
        return {}
    n = fig["native"]
    return {f"native_vs_{s}": {"tokens_per_s": round(n["tokens_per_s"] / fig[s]["tokens_per_s"], 2),
                               "cpu_per_token": round(fig[s]["cpu_s_per_token"] / n["cpu_s_per_token"], 2)}
            for s in sides if s != "native"}


def agreement_figures(model, pgs, hf: HFWorker, vllm: VLLMSide | None, args) -> dict:
    """Greedy parity (16 tokens on 4 chat prompts) between every pair of sides, and log-prob agreement: each
    engine's log-probs of its own tokens against HF's teacher-forced log-softmax of the same tokens (HF: the
    reference), on the greedy tokens and on T=1 samples (4 prompts x 4 samples, up to 24 tokens); and ours
    against vLLM's directly on the greedy tokens both produced (up to their first difference).
    `kl_k1` = mean(engine log-prob - HF's) over the samples' tokens: the estimate of KL(engine || HF) that
    the RL loop's mismatch_kl uses against the trainer."""
    from megatron_rl.rollout import SamplingParams

    check = prompts(4, seed=99)
    c = max(16, args.group_size * 4)
    greedy = [(p, SamplingParams(temperature=0.0, max_new_tokens=16)) for p in check]
    sampled = [(p, SamplingParams(temperature=1.0, max_new_tokens=24, n=4, seed=5 + i)) for i, p in enumerate(check)]
    engines = [s for s in args.backends if s != "hf"]
    got = {}
    for side in engines:
        eng = _engine(model, pgs, c) if side == "native" else vllm.at(c)
        got[side] = {"greedy": drive(eng, greedy)[0], "sampled": drive(eng, sampled)[0]}
    tokens = {side: [s.token_ids for s in got[side]["greedy"]] for side in engines}
    if "hf" in args.backends:
        tokens["hf"] = hf.run(check, 16)[0]
    names = list(tokens)
    res = {"greedy_equal": {f"{a}_vs_{b}": tokens[a] == tokens[b] for i, a in enumerate(names) for b in names[i + 1:]},
           "greedy_agreement": {f"{a}_vs_{b}": round(agreement(tokens[a], tokens[b]), 3)
                                for i, a in enumerate(names) for b in names[i + 1:]}, "logprobs": {}}
    for side in engines:
        for kind in ("greedy", "sampled"):
            samples = got[side][kind]
            pr = [p for p, sp in (greedy if kind == "greedy" else sampled) for _ in range(sp.n)]
            if "hf" in args.backends:
                ref = hf.score([[p, s.token_ids] for p, s in zip(pr, samples)])
                res["logprobs"][f"{side}_vs_hf_{kind}"] = _lp_diff([s.logprobs for s in samples], ref)
    if {"native", "vllm"} <= set(engines):
        a, b = got["native"]["greedy"], got["vllm"]["greedy"]
        common = [(x.logprobs[:k], y.logprobs[:k]) for x, y in zip(a, b)
                  for k in [next((i for i, (u, v) in enumerate(zip(x.token_ids, y.token_ids)) if u != v),
                                 len(x.token_ids))]]
        res["logprobs"]["native_vs_vllm_greedy"] = _lp_diff([x for x, _ in common], [y for _, y in common])
    return res


def _lp_diff(a: list[list[float]], b: list[list[float]]) -> dict:
    d = [x - y for u, v in zip(a, b) for x, y in zip(u, v)]
    if not d:
        return {"tokens": 0}
    return {"tokens": len(d), "max_abs": float(f"{max(map(abs, d)):.3g}"),
            "mean_abs": float(f"{sum(map(abs, d)) / len(d):.3g}"), "kl_k1": float(f"{sum(d) / len(d):.3g}")}


def _bytes_per_token() -> int:
    """Contiguous-cache bytes per token slot: 2 (K, V) x layers x kv_heads x head_dim x element size."""
    head_dim = CFG.head_dim or CFG.hidden_size // CFG.num_attention_heads
    return 2 * CFG.num_layers * CFG.num_query_groups * head_dim * DTYPES[CFG.params_dtype].itemsize


if __name__ == "__main__":
    main()
