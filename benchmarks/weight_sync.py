"""Seconds per GB of the RL loop's weight sync, trainer -> engine, against a plain copy of the same bytes.

Launches itself under torchrun (gloo, CPU) with a trainer at `--pp` pipeline stages (2 ranks by default),
builds the loop's engine and weight sync (`loop.job.build_engine`: the TP-only engine and the sync that
gathers the stages into it) and times it against a plain copy of the same bytes by the same route, in the
same run, as `--repeats` pairs run back to back after one untimed warm-up each (a shared machine's load hits
both alike; the ratio is the median of the pairs'):
  in_process  `sync(engine, version, policy.global_named_tensors())` on every rank (the gather over the
              ranks sharing a TP rank, the broadcasts, and the engine's load with its completeness check);
              plain: each stage's bytes as one flat buffer broadcast over the same ranks, plus the stage's copy
              of its own share into an engine-sized buffer (no names, no buckets, no load); `memcpy_s_per_gb`
              (one in-process `copy_` of the engine's bytes) is reported too, as the memory's floor;
  separate    rank 0 pushes the engine's weights to a rollout server process (`loop.dispatched.
              RolloutServerProcess`: the weight file written next to the server (rollout/weight_file.py), POST
              /update_weights, the server reads it into its engine's parameters); plain: the same bytes written
              to a file in the same folder and read back into a buffer.
Ratios are plain_s / measured_s (1.0: as fast as the plain copy; target >= 0.5); times are the best of the
repeats. Prints one JSON object (rank 0).

    .venv/bin/python benchmarks/weight_sync.py [--pp 2] [--hidden 768 --layers 8 --vocab 32000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _paired(fn, base, repeats: int) -> tuple[float, float, float]:
    """(best fn s, best base s, median of the per-pair ratios base/fn): one untimed warm-up each, then `repeats`
    pairs run back to back, so that a shared machine's load hits both alike."""
    fn(), base()
    pairs = []
    for _ in range(repeats):
        pairs.append((_timed(fn), _timed(base)))
    ratios = sorted(b / f for f, b in pairs)
    return min(f for f, _ in pairs), min(b for _, b in pairs), ratios[len(ratios) // 2]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _config(args, run_dir: str):
    from megatron_rl.config import from_dict
    from megatron_rl.run_config import RunConfig

    model = {"num_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": args.hidden // 64,
             "num_query_groups": args.hidden // 128, "vocab_size": args.vocab, "max_seq_length": 256,
             "tie_embeddings": False}
    return from_dict(RunConfig, {"output_dir": run_dir, "parallel": {"pp": args.pp},
                                 "launch": {"nproc_per_node": args.pp}, "model": model,
                                 "engine": {"num_blocks": 16}})


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from megatron_rl.distributed import init_distributed
    from megatron_rl.loop.dispatched import RolloutServerProcess
    from megatron_rl.loop.job import build_engine, engine_weights
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.trainer.policy import OptimConfig, Policy

    run_dir = tempfile.mkdtemp(prefix="mrl-wsync-", dir=args.dir)
    cfg = _config(args, run_dir)
    ctx = init_distributed(ParallelConfig(pp=args.pp))
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    policy = Policy(cfg.model, OptimConfig(), ctx, total_steps=1)
    engine, sync = build_engine(cfg, ctx, cfg.model.vocab_size)
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())  # what each engine receives
    gb = nbytes / 1e9
    version = iter(range(1, 10**6))

    def in_process():
        sync(engine, next(version), policy.global_named_tensors())
        dist.barrier()

    plain = _plain_route(policy, dist)
    sync_s, plain_s, ratio = _paired(in_process, plain, args.repeats)
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    memcpy_s = min(_timed(lambda: dst.copy_(src)) for _ in range(args.repeats + 1))
    out = {"pp": args.pp, "engine_gb": gb, "repeats": args.repeats, "in_process": {
        "s_per_gb": sync_s / gb, "plain_s_per_gb": plain_s / gb, "memcpy_s_per_gb": memcpy_s / gb,
        "ratio_vs_plain": ratio, "ratio_vs_memcpy": memcpy_s / sync_s}}
    if ctx.rank == 0 and not args.no_server:
        out["separate"] = _separate(cfg, engine, engine_weights, RolloutServerProcess, run_dir, nbytes, args)
    dist.barrier()
    if ctx.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    shutil.rmtree(run_dir, ignore_errors=True)


def _plain_route(policy, dist):
    """The plain copy of the sync's bytes by its route: each stage's bytes as one flat buffer, broadcast from it
    over the same ranks, and copied by the stage itself into an engine-sized buffer (its own share), no names,
    no buckets, no load."""
    import torch

    mine = sum(p.numel() for _, p in policy.global_named_tensors())  # floats this stage owns
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, mine)
    flats = [torch.randn(n) if r == dist.get_rank() else torch.empty(n) for r, n in enumerate(sizes)]
    own = torch.empty(mine)

    def plain():
        for r, flat in enumerate(flats):
            dist.broadcast(flat, src=r)
        own.copy_(flats[dist.get_rank()])
        dist.barrier()
    return plain


def _separate(cfg, engine, engine_weights, server_cls, run_dir: str, nbytes: int, args) -> dict:
    import torch

    server = server_cls(Path(run_dir), cfg.model, cfg.engine, 1, ("127.0.0.1", "127.0.0.1"),
                        tokenizer_cfg=cfg.tokenizer)
    version = iter(range(1, 10**6))
    server.push(next(version), engine_weights(engine))  # starts the server process (not timed)
    data, back, path = torch.randn(nbytes // 4), torch.empty(nbytes // 4), Path(run_dir) / "plain.bin"

    def file_copy():  # the plain copy by the push's route: the same bytes written to a file there and read back
        with open(path, "wb") as f:
            f.write(data.numpy())
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(back.numpy()).cast("B"))

    try:
        push_s, copy_s, ratio = _paired(lambda: server.push(next(version), engine_weights(engine)), file_copy,
                                        args.repeats)
    finally:
        server.close()
    path.unlink()
    gb = nbytes / 1e9
    return {"s_per_gb": push_s / gb, "file_copy_s_per_gb": copy_s / gb, "ratio_vs_file_copy": ratio}


def main() -> int:
    from megatron_rl.distributed import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-server", action="store_true", help="skip the separate rollout server")
    p.add_argument("--dir", default=None, help="scratch folder (default: the system's temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.pp}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__, "--worker", *sys.argv[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
        return proc.returncode or 1
    print(lines[-1][len("RESULT "):])
    return 0


if __name__ == "__main__":
    sys.exit(main())
