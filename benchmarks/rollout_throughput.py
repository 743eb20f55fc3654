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
    p.add_argument("--hf-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.hf_worker:
        return hf_worker(args.hf_worker, args.dtype)
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


def _bytes_per_token() -> int:
    """Contiguous-cache bytes per token slot: 2 (K, V) x layers x kv_heads x head_dim x element size."""
    head_dim = CFG.head_dim or CFG.hidden_size // CFG.num_attention_heads
    return 2 * CFG.num_layers * CFG.num_query_groups * head_dim * DTYPES[CFG.params_dtype].itemsize


if __name__ == "__main__":
    main()
