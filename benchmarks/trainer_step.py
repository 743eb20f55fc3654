"""Throughput of one policy training step on Megatron-Core (CPU, TP=1) vs a plain PyTorch module, and peak
memory of the trainer's log-prob computation with and without chunking.

1. Step throughput. The same GPT (RMSNorm, GQA attention with RoPE, SwiGLU MLP, tied embeddings, fp32) as
   (a) `Policy` (Megatron-Core local spec, DDP grad buffers, Megatron optimizer = torch Adam, one process
   started with `init_distributed(source="single")`, `Policy.train_step` through `get_forward_backward_func`)
   and (b) `PlainGPT` below: a minimal nn.Module with the same layers and parameter count (checked), same
   packed micro-batches ([1, S], block-causal mask), same masked cross-entropy, same Adam (lr, betas, eps)
   and the same gradient clipping. Tokens/s counts the real (non-padding) tokens of a step; the steps of the
   two are interleaved (a shared machine's load hits both alike) and the median is reported, by wall time and
   by process CPU time (user + system: less disturbed by other load on a shared machine).
   ratio = megatron tokens/s / plain tokens/s (1.0 = no overhead).
2. Log-prob memory. `token_logprobs_and_entropy((hidden, weight), ...)` forward + backward at vocab 32k and
   128k, unchunked vs chunked, each in a fresh subprocess: peak = the process's resident high-water mark
   (VmHWM, reset to the current RSS through /proc/self/clear_refs once the inputs exist) during the step
   minus the RSS before it (torch's CPU allocator keeps no peak statistics; ru_maxrss cannot be reset and
   remembers import-time peaks). It includes the gradients of hidden and weight (`grads_mb`), which both
   must produce; `work_mb` subtracts them. ratio = unchunked peak / chunked peak (and the same for work).

    .venv/bin/python benchmarks/trainer_step.py [--steps 5] [--layers 4 --hidden 256 ...]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------ plain model
class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):  # [..., h]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, pos, base: float):  # x [S, n, d], pos [S]
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [d/2]
    ang = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)[:, None]  # [S, 1, d]
    x1, x2 = x.chunk(2, dim=-1)
    return x * ang.cos() + torch.cat([-x2, x1], dim=-1) * ang.sin()


class Layer(nn.Module):
    def __init__(self, h: int, heads: int, groups: int, ffn: int, base: float):
        super().__init__()
        self.heads, self.groups, self.hd, self.base = heads, groups, h // heads, base
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        self.qkv = nn.Linear(h, (heads + 2 * groups) * self.hd, bias=False)
        self.proj = nn.Linear(heads * self.hd, h, bias=False)
        self.fc1, self.fc2 = nn.Linear(h, 2 * ffn, bias=False), nn.Linear(ffn, h, bias=False)

    def forward(self, x, pos, mask):  # x [S, h], pos [S], mask [S, S] True = masked
        S = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(S, -1, self.hd).split([self.heads, self.groups, self.groups], 1)
        q, k = rope(q, pos, self.base), rope(k, pos, self.base)
        k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))  # [S, n, d]
        scores = torch.einsum("qnd,knd->nqk", q, k) / math.sqrt(self.hd)  # [n, S, S]
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj(torch.einsum("nqk,knd->qnd", probs, v).reshape(S, -1))
        a, b = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(a) * b)


class PlainGPT(nn.Module):
    """The Megatron GPT of `ModelConfig` (local spec) as one plain module: same layers and shapes."""

    def __init__(self, cfg):
        super().__init__()
        h, ffn = cfg.hidden_size, cfg.ffn_hidden_size or 4 * cfg.hidden_size
        self.embedding = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(Layer(h, cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads,
                                          ffn, cfg.rotary_base) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(h)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=cfg.init_std)

    def forward(self, tokens, mask):  # tokens [S], mask [S, S] -> logits [S, V]
        x, pos = self.embedding(tokens), torch.arange(tokens.shape[0], dtype=torch.float32)
        for layer in self.layers:
            x = layer(x, pos, mask)
        return self.final_norm(x) @ self.embedding.weight.t()


# ------------------------------------------------------------------------------------ throughput
def _batch(vocab: int, n: int, seed: int = 0):
    from megatron_rl.data.shards import Trajectory, TrajectoryColumns

    gen = np.random.default_rng(seed)
    trajs = []
    for i in range(n):
        length, prompt = int(gen.integers(64, 257)), 16
        mask = (np.arange(length) >= prompt).astype(np.uint8)
        trajs.append(Trajectory(tokens=gen.integers(0, vocab, length).astype(np.int32), loss_mask=mask,
                                logprobs=np.zeros(length, np.float32), prompt_len=prompt, reward=0.0,
                                group_id=i, policy_version_first=0, policy_version_last=0, env="bench",
                                task_id=str(i), episode_id=str(i)))
    return TrajectoryColumns.from_trajectories(trajs)


def _masked_ce(logits, batch, total: float):  # logits [..., V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch["labels"].reshape(-1), reduction="none")
    return (ce * batch["loss_mask"].reshape(-1)).sum() / total


def throughput(args) -> dict:
    from megatron_rl.distributed import init_distributed
    from megatron_rl.models.gpt import ModelConfig
    from megatron_rl.trainer.packing import PackingConfig, block_causal_mask, check_samples, pack
    from megatron_rl.trainer.policy import OptimConfig, Policy

    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      num_query_groups=args.groups, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                      max_seq_length=args.max_tokens)
    ocfg = OptimConfig(lr=1e-4, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0,
                       distributed_optimizer=False)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ctx = init_distributed(source="single")
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    policy = Policy(cfg, ocfg, ctx, total_steps=args.steps + 1)
    plain = PlainGPT(cfg)
    adam = torch.optim.Adam(plain.parameters(), lr=ocfg.lr, betas=(ocfg.adam_beta1, ocfg.adam_beta2), eps=ocfg.adam_eps)
    n_meg = sum(p.numel() for _, p in policy.named_parameters())
    n_plain = sum(p.numel() for p in plain.parameters())
    if n_meg != n_plain:
        raise RuntimeError(f"baseline is not the same model: {n_plain} vs {n_meg} parameters")

    cols, pcfg = _batch(args.vocab, args.samples), PackingConfig(max_tokens=args.max_tokens)
    keep, _ = check_samples(cols, args.vocab, pcfg)
    mbs, _ = pack(cols, keep, pcfg, 0, 1)
    total = float(sum(mb["loss_mask"].sum() for mb in mbs))
    tokens = int(sum((mb["sample_index"] >= 0).sum() for mb in mbs))
    masks = [block_causal_mask(mb["cu_seqlens"], args.max_tokens)[0, 0] for mb in mbs]  # each [S, S]

    def megatron_step():
        def loss_fn(output, batch):
            loss = _masked_ce(output, batch, total)
            return loss * len(mbs) * policy.grad_scale, {"loss": loss.detach()}
        return policy.train_step(mbs, loss_fn, args.max_tokens)["loss"]

    def plain_step():
        adam.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for mb, mask in zip(mbs, masks):
            loss = _masked_ce(plain(mb["tokens"][0], mask), mb, total)
            loss.backward()
            loss_sum += float(loss)
        torch.nn.utils.clip_grad_norm_(plain.parameters(), ocfg.clip_grad)
        adam.step()
        return loss_sum

    times: dict[str, list[float]] = {"megatron": [], "plain": []}
    cpu: dict[str, list[float]] = {"megatron": [], "plain": []}
    losses: dict[str, list[float]] = {"megatron": [], "plain": []}
    for i in range(args.steps + 1):  # step 0 warms up both
        for name, fn in (("megatron", megatron_step), ("plain", plain_step)):
            t, c = time.perf_counter(), _cpu_s()
            loss = fn()
            if i:
                times[name].append(time.perf_counter() - t)
                cpu[name].append(_cpu_s() - c)
                losses[name].append(float(loss))
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    tps_cpu = {k: tokens / statistics.median(v) for k, v in cpu.items()}
    return {"model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "query_groups": args.groups,
                      "ffn": args.ffn, "vocab": args.vocab, "parameters": n_meg},
            "microbatches": len(mbs), "max_tokens": args.max_tokens, "tokens_per_step": tokens,
            "step_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
            "megatron_tokens_per_s": round(tps["megatron"], 1), "plain_tokens_per_s": round(tps["plain"], 1),
            "ratio_megatron_vs_plain": round(tps["megatron"] / tps["plain"], 3),
            "step_cpu_s": {k: [round(x, 3) for x in v] for k, v in cpu.items()},
            "megatron_tokens_per_cpu_s": round(tps_cpu["megatron"], 1),
            "plain_tokens_per_cpu_s": round(tps_cpu["plain"], 1),
            "ratio_megatron_vs_plain_cpu_time": round(tps_cpu["megatron"] / tps_cpu["plain"], 3),
            "losses": {k: [round(x, 4) for x in v] for k, v in losses.items()},
            "torch_threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------ memory
def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB -> MiB


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def memory_case(vocab: int, chunk: int, tokens: int, hidden: int) -> dict:
    """Runs in a fresh subprocess: forward + backward of the log-probs/entropy from (hidden, weight)."""
    from megatron_rl.trainer.logprobs import token_logprobs_and_entropy

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) / hidden ** 0.5).requires_grad_()  # [T, H]
    w = torch.randn(vocab, hidden, generator=g).requires_grad_()  # [V, H]
    targets = torch.randint(0, vocab, (tokens,), generator=g)  # [T]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    before = _status_mb("VmRSS")
    t = time.perf_counter()
    lp, ent = token_logprobs_and_entropy((h, w), targets, None, 1.0, chunk or None)
    (lp.sum() + 0.01 * ent.sum()).backward()
    seconds = time.perf_counter() - t
    grads_mb = (h.numel() + w.numel()) * 4 / 2**20
    peak = _status_mb("VmHWM") - before
    return {"vocab": vocab, "chunk": chunk, "peak_mb": round(peak, 1), "grads_mb": round(grads_mb, 1),
            "work_mb": round(peak - grads_mb, 1), "seconds": round(seconds, 3)}


def memory(args) -> dict:
    out = {"tokens": args.mem_tokens, "hidden": args.mem_hidden, "chunk_size": args.chunk}
    for vocab in (int(v) for v in args.vocabs.split(",")):
        cases = {}
        for chunk in (0, args.chunk):
            cmd = [sys.executable, __file__, "--_memory-case", f"{vocab},{chunk},{args.mem_tokens},{args.mem_hidden}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
            if proc.returncode:
                raise RuntimeError(f"memory case vocab={vocab} chunk={chunk} failed:\n{proc.stderr[-3000:]}")
            cases["chunked" if chunk else "unchunked"] = json.loads(proc.stdout.strip().splitlines()[-1])
        un, ch = cases["unchunked"], cases["chunked"]
        out[f"vocab_{vocab}"] = {
            **cases, "ratio_unchunked_vs_chunked_peak": round(un["peak_mb"] / max(ch["peak_mb"], 1), 2),
            "ratio_unchunked_vs_chunked_work": round(un["work_mb"] / max(ch["work_mb"], 1), 2)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--samples", type=int, default=8, help="samples of the global batch (64..256 tokens each)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--mem-tokens", type=int, default=1024)
    p.add_argument("--mem-hidden", type=int, default=512)
    p.add_argument("--vocabs", default="32768,131072")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--_memory-case", dest="memory_case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_case:
        v, c, t, h = (int(x) for x in args.memory_case.split(","))
        print(json.dumps(memory_case(v, c, t, h)))
        return
    result = {"benchmark": "trainer_step", "machine_cpus": os.cpu_count(),
              "load_avg_1m": round(os.getloadavg()[0], 2)}
    result["step"] = throughput(args)
    if not args.skip_memory:
        result["logprob_memory"] = memory(args)
    result["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
