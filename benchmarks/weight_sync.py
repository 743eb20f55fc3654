"""Seconds per GB of the RL loop's weight sync, trainer -> engine, against a plain copy of the same bytes.

Launches itself under torchrun (gloo, CPU) with a trainer at `--pp` pipeline stages (2 ranks by default),
builds the loop's engine and weight sync (`loop.setup.build_engine`: the TP-only engine and the sync that
gathers the stages into it) and times, after one untimed warm-up each:
  in_process  `sync(engine, version, policy.global_named_tensors())` on every rank (the gather over the
              ranks sharing a TP rank, bucketed broadcasts, and the engine's load with its completeness check);
              baselines in the same run: `memcpy` (one `copy_` of a flat buffer of the same bytes) and
              `broadcast` (the same bytes as flat buffers broadcast over the same group from each stage, no
              names, no load: the transport's floor);
  separate    rank 0 pushes the engine's weights to a rollout server process (`loop.dispatched.
              RolloutServerProcess`: save next to the server, POST /update_weights, the server loads them);
              baseline: writing the same bytes to a file in the same folder and reading them back.
Ratios are baseline_s / measured_s (1.0: as fast as the baseline; target >= 0.5). Best of `--repeats`.
Prints one JSON object (rank 0).

    .venv/bin/python benchmarks/weight_sync.py [--pp 2] [--hidden 768 --layers 8 --vocab 32000] [--repeats 3]
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


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


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
    from megatron_rl.loop.setup import build_engine, engine_weights
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

    sync_s = _best(in_process, args.repeats)
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    memcpy_s = _best(lambda: dst.copy_(src), args.repeats)
    mine = sum(p.numel() for _, p in policy.global_named_tensors())  # floats this stage owns
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, mine)
    flats = [torch.empty(n) for n in sizes]

    def broadcast():
        for r, flat in enumerate(flats):
            dist.broadcast(flat, src=r)

    bcast_s = _best(broadcast, args.repeats)
    out = {"pp": args.pp, "engine_gb": gb, "in_process": {
        "s_per_gb": sync_s / gb, "memcpy_s_per_gb": memcpy_s / gb, "broadcast_s_per_gb": bcast_s / gb,
        "ratio_vs_memcpy": memcpy_s / sync_s, "ratio_vs_broadcast": bcast_s / sync_s}}
    if ctx.rank == 0 and not args.no_server:
        out["separate"] = _separate(cfg, engine, engine_weights, RolloutServerProcess, run_dir, nbytes, args)
    dist.barrier()
    if ctx.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
    shutil.rmtree(run_dir, ignore_errors=True)


def _separate(cfg, engine, engine_weights, server_cls, run_dir: str, nbytes: int, args) -> dict:
    import numpy as np

    server = server_cls(Path(run_dir), cfg.model, cfg.engine, 1, ("127.0.0.1", "127.0.0.1"),
                        tokenizer_cfg=cfg.tokenizer)
    version = iter(range(1, 10**6))
    try:
        push_s = _best(lambda: server.push(next(version), engine_weights(engine)), args.repeats)
    finally:
        server.close()
    data, path = np.random.rand(nbytes // 8), Path(run_dir) / "plain.bin"

    def file_copy():
        data.tofile(path)
        np.fromfile(path)

    copy_s = _best(file_copy, args.repeats)
    path.unlink()
    gb = nbytes / 1e9
    return {"s_per_gb": push_s / gb, "file_copy_s_per_gb": copy_s / gb, "ratio_vs_file_copy": copy_s / push_s}


def main() -> int:
    from megatron_rl.distributed import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
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
