"""Shard write/read throughput against raw np.save/np.load of the same CSR arrays, measured in the same run.

Write, same arrays (the target): `write_shard(path, columns)` (validation, compression, per-sample metadata,
fsync, atomic rename, directory fsync) vs np.save of the columns' tokens/logprobs/loss_mask/offsets, each
file fsynced, plus a directory fsync. Write, end to end: `write_shard(path, list_of_Trajectory)` vs
concatenating the same trajectories + the same np.save. Read: `read_arrays` (everything, columnar) vs np.load
of the four arrays. Right before each read the files' pages are dropped from the page cache with
posix_fadvise(DONTNEED) (after fsync they are clean, so this works without root); a VM host may still cache.
Both reads are then repeated with the files in the page cache ("read_warm", no target).
MB/s counts the CSR payload bytes for both sides (the shard's per-sample metadata is extra work for it).
Medians over --reps rounds after --warmup uncounted ones; rounds alternate which side goes first.
Targets (issue): write >= 0.7x, read >= 0.8x raw.

    .venv/bin/python benchmarks/shard_io.py [--mb 160] [--reps 7] [--compression blosc-lz4] [--tokens zipf]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_rl.data import Trajectory, TrajectoryColumns, read_arrays, write_shard  # noqa: E402
from megatron_rl.data.shards import fsync_dir  # noqa: E402

ARRAYS = ("tokens", "logprobs", "loss_mask", "offsets")


VOCAB = 151_000


def token_sampler(kind: str, rng: np.random.Generator):
    """'zipf': Zipf(1.1) frequencies like text, over randomly permuted ids; 'uniform': ids uniform (worst case)."""
    if kind == "uniform":
        return lambda n: rng.integers(0, VOCAB, n, dtype=np.int32)
    perm = rng.permutation(VOCAB).astype(np.int32)
    return lambda n: perm[np.minimum(rng.zipf(1.1, n) - 1, VOCAB - 1)]


def make_trajectories(target_bytes: int, tokens: str = "zipf", seed: int = 0) -> list[Trajectory]:
    """Samples of 500-4000 tokens, 30% prompt, vocab 151k, log-probs of model tokens ~ -Exp(0.5)."""
    rng = np.random.default_rng(seed)
    sample_tokens = token_sampler(tokens, rng)
    trajs, total, i = [], 0, 0
    while total < target_bytes:
        n = int(rng.integers(500, 4000))
        p = int(n * 0.3)
        mask = np.zeros(n, np.uint8)
        mask[p:] = 1
        logp = np.zeros(n, np.float32)
        logp[p:] = -rng.exponential(0.5, n - p)
        trajs.append(Trajectory(
            tokens=sample_tokens(n), logprobs=logp, loss_mask=mask, prompt_len=p,
            reward=float(rng.random()), group_id=i // 8, policy_version_first=7, policy_version_last=7,
            env="math", task_id=f"t{i // 8}", episode_id=f"bench-{i}", reward_components={"correct": 1.0},
            timings={"generate": 1.0, "total": 1.5}, provenance={"verifier": "bench"}))
        total += n * 9 + 8
        i += 1
    return trajs


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def raw_write(cols: TrajectoryColumns, d: Path) -> int:
    d.mkdir()
    for name in ARRAYS:
        with open(d / f"{name}.npy", "wb") as f:
            np.save(f, getattr(cols, name))
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(d)
    return sum((d / f"{name}.npy").stat().st_size for name in ARRAYS)


def raw_read(d: Path) -> dict[str, np.ndarray]:
    return {name: np.load(d / f"{name}.npy") for name in ARRAYS}


def _check(name: str, back, cols: TrajectoryColumns) -> None:
    tokens, offsets = (back["tokens"], back["offsets"]) if name == "raw_r" else (back.tokens, back.offsets)
    assert np.array_equal(tokens, cols.tokens) and np.array_equal(offsets, cols.offsets), name


def one_round(trajs: list[Trajectory], cols: TrajectoryColumns, d: Path, args, flip: bool) -> dict[str, float]:
    """All six timings once; `flip` puts the shard side first (rounds alternate, so neither side always runs
    on the heels of the other). Every file gets a fresh name (no timed step frees blocks of an old file);
    files are fsynced, dropped from the page cache right before each read, each read is checked and freed
    before the next, and all files are deleted (then synced) after the round."""
    kw = dict(compression=args.compression, chunk_elems=args.chunk_elems)
    writes = {"raw_w": lambda: raw_write(cols, d / "raw"),
              "raw_w_e2e": lambda: raw_write(TrajectoryColumns.from_trajectories(trajs), d / "raw_e2e"),
              "shard_w": lambda: write_shard(d / "cols.h5", cols, **kw),
              "shard_w_e2e": lambda: write_shard(d / "trajs.h5", trajs, **kw)}
    reads = {"raw_r": lambda: raw_read(d / "raw"), "shard_r": lambda: read_arrays(d / "cols.h5")}
    t = {}
    for name in sorted(writes, reverse=flip):  # raw_* first, or shard_* first
        t[name], _ = timed(writes[name])
    for name in sorted(reads, reverse=flip):
        for path in [d / "cols.h5"] + [d / "raw" / f"{a}.npy" for a in ARRAYS]:
            drop_cache(path)
        t[name], back = timed(reads[name])
        _check(name, back, cols)
        del back
    for name in sorted(reads, reverse=flip):  # again, the files now in the page cache
        t[f"{name}_warm"], back = timed(reads[name])
        del back
    t["raw_size"] = sum((d / "raw" / f"{a}.npy").stat().st_size for a in ARRAYS)
    t["shard_size"] = (d / "cols.h5").stat().st_size
    for child in d.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    os.sync()
    return t


TARGETS = {"write": 0.7, "write_end_to_end": 0.7, "read": 0.8}


def ratios(mbps: dict[str, float]) -> dict[str, float]:
    return {"write": mbps["shard_w"] / mbps["raw_w"], "write_end_to_end": mbps["shard_w_e2e"] / mbps["raw_w_e2e"],
            "read": mbps["shard_r"] / mbps["raw_r"], "read_warm": mbps["shard_r_warm"] / mbps["raw_r_warm"]}


def median_mbps(payload: int, seconds: list[float]) -> float:
    return round(payload / statistics.median(seconds) / 1e6, 1)


def run(args) -> dict:
    load_start = os.getloadavg()[0]
    trajs = make_trajectories(int(args.mb * 1e6), args.tokens)
    cols = TrajectoryColumns.from_trajectories(trajs)
    payload = sum(getattr(cols, name).nbytes for name in ARRAYS)
    d = Path(tempfile.mkdtemp(prefix="shard_io.", dir=args.dir))
    try:
        for i in range(args.warmup):  # first touches of memory and files, not counted
            one_round(trajs, cols, d, args, flip=bool(i % 2))
        rounds = [one_round(trajs, cols, d, args, flip=bool(i % 2)) for i in range(args.reps)]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    keys = ("raw_w", "shard_w", "raw_w_e2e", "shard_w_e2e", "raw_r", "shard_r", "raw_r_warm", "shard_r_warm")
    mbps = {k: median_mbps(payload, [r[k] for r in rounds]) for k in keys}
    best = {k: round(payload / min(r[k] for r in rounds) / 1e6, 1) for k in keys}
    ratio = ratios(mbps)
    return {
        "benchmark": "shard_io", "token_distribution": args.tokens, "compression": args.compression,
        "chunk_elems": args.chunk_elems,
        "blosc": "lz4 clevel 5, shuffle per dataset (shards.SHUFFLE)" if args.compression == "blosc-lz4" else None,
        "samples": len(trajs), "tokens": cols.num_tokens, "payload_mb": round(payload / 1e6, 1),
        "shard_file_mb": round(rounds[-1]["shard_size"] / 1e6, 1),
        "raw_file_mb": round(rounds[-1]["raw_size"] / 1e6, 1),
        "file_size_ratio": round(rounds[-1]["shard_size"] / rounds[-1]["raw_size"], 3), "reps": args.reps,
        "warmup_rounds": args.warmup,
        "write_mb_s": {"shard_columns": mbps["shard_w"], "raw_np_save_fsync": mbps["raw_w"],
                       "shard_from_trajectories": mbps["shard_w_e2e"], "raw_concat_np_save_fsync": mbps["raw_w_e2e"]},
        "read_mb_s": {"shard_read_arrays": mbps["shard_r"], "raw_np_load": mbps["raw_r"],
                      "shard_read_arrays_page_cache": mbps["shard_r_warm"],
                      "raw_np_load_page_cache": mbps["raw_r_warm"]},
        "seconds": {k: [round(r[k], 3) for r in rounds] for k in keys},
        "best_mb_s": best,
        "ratio": {k: round(v, 3) for k, v in ratio.items()},
        "ratio_best_of_reps": {k: round(v, 3) for k, v in ratios(best).items()},
        "targets": TARGETS,
        "meets_targets": {k: v >= TARGETS[k] for k, v in ratio.items() if k in TARGETS},
        "loadavg_1min": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "cpus": os.cpu_count(), "blosc_nthreads_env": os.environ.get("BLOSC_NTHREADS"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=160, help="CSR payload size in MB (default 160)")
    parser.add_argument("--reps", type=int, default=7, help="rounds (alternating which side goes first); medians")
    parser.add_argument("--warmup", type=int, default=1, help="uncounted rounds first")
    parser.add_argument("--compression", default="blosc-lz4", choices=["blosc-lz4", "none"])
    parser.add_argument("--chunk-elems", type=int, default=262144)
    parser.add_argument("--tokens", default="zipf", choices=["zipf", "uniform"], help="token id distribution")
    parser.add_argument("--dir", default=None, help="folder for the files (default: system temp)")
    print(json.dumps(run(parser.parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
