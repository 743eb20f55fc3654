"""Peak memory and time of fused log-prob/entropy (forward + backward) vs naive full logits, on CPU.

Naive: `log_softmax(h @ W.T / temp)` materialised as [T, V] fp32, gathered at the targets, entropy
`-(p * logp).sum(-1)`. Fused: `kernels.logprob.fused_logprob_entropy(impl="torch")` (chunked, recomputing
logits in the backward). Both: loss = sum(mask * (a * logprob + c * entropy)), backward to h and W.

Each case runs in a fresh subprocess. Peak memory = ru_maxrss after the step minus ru_maxrss after the inputs
were built (torch's CPU allocator keeps no peak statistics and tracemalloc does not see it); it includes the
gradients of h and W, which both paths must produce ("grads_mb"), and `*_work_mb` subtracts them. Time is one
fwd+bwd step after a small warm-up, the fastest of --reps interleaved runs (wall, and process CPU seconds,
which other load on a shared machine disturbs less). Targets (issue): at V=128k fused peak <= 1/16 of naive, fused time
<= 1.25x naive (time ratio naive/fused >= 0.8).

    .venv/bin/python benchmarks/logprob_memory.py [--tokens 4096] [--hidden 1024] [--vocabs 32768,131072]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _cpu_s() -> float:
    """User + system CPU seconds of this process (all threads): less sensitive to other load than wall time."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _inputs(T: int, H: int, V: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=g) / H ** 0.5).requires_grad_()  # [T, H]
    w = torch.randn(V, H, generator=g).requires_grad_()  # [V, H]
    targets = torch.randint(0, V, (T,), generator=g)  # [T]
    mask = (torch.rand(T, generator=g) < 0.8).float()  # [T]
    a, c = torch.randn(T, generator=g), torch.randn(T, generator=g)  # [T] upstream weights
    return h, w, targets, mask * a, mask * c


def _step(path: str, h, w, targets, ca, cc, temperature: float, chunk_tokens: int, chunk_vocab: int) -> None:
    from megatron_rl.kernels.logprob import fused_logprob_entropy
    from megatron_rl.kernels.logprob.reference import naive_logprob_entropy

    if path == "naive":
        logprob, entropy = naive_logprob_entropy(h, w, targets, temperature)
    else:
        logprob, entropy = fused_logprob_entropy(h, w, targets, temperature=temperature, impl="torch",
                                                 chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
    (ca * logprob + cc * entropy).sum().backward()


def run_case(args) -> dict:
    """One measurement in this (fresh) process."""
    import torch

    small = _inputs(64, 64, 512, seed=1)  # warm-up: load lazy kernels without touching the peak
    _step(args.case, *small, args.temperature, args.chunk_tokens, args.chunk_vocab)
    del small
    h, w, targets, ca, cc = _inputs(args.tokens, args.hidden, args.vocab)
    base = _maxrss_mb()
    t0, c0 = time.perf_counter(), _cpu_s()
    _step(args.case, h, w, targets, ca, cc, args.temperature, args.chunk_tokens, args.chunk_vocab)
    seconds, cpu_seconds = time.perf_counter() - t0, _cpu_s() - c0
    peak_mb = _maxrss_mb() - base  # before the checksum below allocates fp64 copies
    grads_mb = (h.grad.numel() + w.grad.numel()) * 4 / 2 ** 20
    checksum = float(h.grad.double().abs().sum() + w.grad.double().abs().sum())
    return {"peak_mb": peak_mb, "grads_mb": grads_mb, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "checksum": checksum, "threads": torch.get_num_threads()}


def _spawn(case: str, V: int, args) -> dict:
    cmd = [sys.executable, __file__, "--case", case, "--vocab", str(V), "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--temperature", str(args.temperature),
           "--chunk-tokens", str(args.chunk_tokens), "--chunk-vocab", str(args.chunk_vocab)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _best(runs: list[dict]) -> dict:
    """Fastest of the repetitions (the machine is shared: the minimum is the least disturbed); max peak."""
    return {"peak_mb": max(r["peak_mb"] for r in runs), "grads_mb": runs[0]["grads_mb"],
            "seconds": min(r["seconds"] for r in runs), "cpu_seconds": min(r["cpu_seconds"] for r in runs),
            "checksum": runs[0]["checksum"]}


def _compare(naive: dict, fused: dict) -> dict:
    return {
        "naive_peak_mb": round(naive["peak_mb"], 1), "fused_peak_mb": round(fused["peak_mb"], 1),
        "grads_mb": round(naive["grads_mb"], 1),
        "naive_work_mb": round(naive["peak_mb"] - naive["grads_mb"], 1),
        "fused_work_mb": round(fused["peak_mb"] - fused["grads_mb"], 1),
        "mem_ratio_fused_over_naive": round(fused["peak_mb"] / naive["peak_mb"], 4),
        "naive_s": round(naive["seconds"], 2), "fused_s": round(fused["seconds"], 2),
        "time_ratio_naive_over_fused": round(naive["seconds"] / fused["seconds"], 3),
        "naive_cpu_s": round(naive["cpu_seconds"], 2), "fused_cpu_s": round(fused["cpu_seconds"], 2),
        "cpu_time_ratio_naive_over_fused": round(naive["cpu_seconds"] / fused["cpu_seconds"], 3),
        "grad_checksum_rel_diff": abs(naive["checksum"] - fused["checksum"]) / abs(naive["checksum"]),
    }


def main(args) -> dict:
    result = {"tokens": args.tokens, "hidden": args.hidden, "temperature": args.temperature,
              "chunk_tokens": args.chunk_tokens, "chunk_vocab": args.chunk_vocab, "reps": args.reps,
              "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
    vocabs = [int(v) for v in args.vocabs.split(",")]
    for V in vocabs:
        runs = {"naive": [], "fused": []}
        for _ in range(args.reps):  # interleaved, so slow phases of the shared machine hit both paths
            for case in runs:
                runs[case].append(_spawn(case, V, args))
        result[f"V{V // 1024}k"] = _compare(_best(runs["naive"]), _best(runs["fused"]))
    last = result[f"V{vocabs[-1] // 1024}k"]
    result["targets"] = {"mem_ratio_max": 1 / 16, "time_ratio_min": 0.8,
                         "mem_ok": last["mem_ratio_fused_over_naive"] <= 1 / 16,
                         "time_ok": last["time_ratio_naive_over_fused"] >= 0.8}
    result["loadavg_end"] = os.getloadavg()[0]
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocabs", default="32768,131072", help="comma-separated vocab sizes")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions per case (fastest reported)")
    p.add_argument("--chunk-vocab", type=int, default=4096)
    p.add_argument("--case", choices=["naive", "fused"], help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    print(json.dumps(run_case(a) if a.case else main(a)))
