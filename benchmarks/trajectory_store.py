"""Trajectory store: the s3 store (SeaweedFS + NATS JetStream, started here) against the shared filesystem.

1. Throughput: the same STEPS batches of PER_STEP scripted episodes (deterministic, no sandbox run) run on one
   local fleet (FLEET_SIZE workers) per store, each batch then read back by the trainer (`read_episodes`).
   The fleets are started and warmed first (servers, workers, clients: outside the timed steps), then the
   stores' steps alternate, so a shared machine's load swings fall on all alike. Reports per store episodes/s
   (episodes over the summed step waits), the trainer's wait per step (queueing a batch -> its episodes in
   memory: mean, p50, max) split into the batch (queued -> every episode published) and the read-back, the s3
   store's prefetch counts, and the ratio s3/fs of episodes/s (target >= 0.8 on one node). `--runs R` repeats
   this with fresh fleets (R alternating pairs) and reports each ratio, their median and the worst;
   `--no-prefetch-too` adds a third store, s3 with `prefetch=0` (the read fetching every shard), to the rotation.
2. Announcement latency: a worker-side store publishes N small shards while a trainer-side store polls in a
   loop; latency = the trainer's index time - the publish call's end (`seen_unix - published_unix`), p50/p99;
   `watch_*`: the same for a watcher of the subject (what starts a prefetch: the message's arrival).

Prints one JSON object. Usage: python benchmarks/trajectory_store.py [--steps 4] [--per-step 32]
       [--fleet-size 2] [--per-lease 8] [--latency-shards 50] [--runs 1] [--prefetch 2] [--no-prefetch-too]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


class StoreRun:
    """One store's fleet and trainer-side store, warmed up; `step` times one batch (queue it, read it back)."""

    def __init__(self, name: str, plane, root: Path, args):
        """name: fs, s3 (prefetch = --prefetch) or s3-noprefetch (prefetch = 0)."""
        from megatron_rl.data.store import S3StoreConfig, build_store
        from megatron_rl.dispatch import GeneratorConfig, WorkerConfig, episodes_from_tasks
        from megatron_rl.dispatch.fleet import Fleet, FleetConfig
        from megatron_rl.envs.tasks import load_domain

        self.name, self.root, self.args = name, root, args
        root.mkdir(parents=True)
        self.tasks, self.batches = load_domain("countdown", split="train"), episodes_from_tasks
        kind = name.split("-")[0]
        s3 = S3StoreConfig(**plane.settings(), prefix=f"bench-{time.time_ns()}", spool_dir=str(root),
                           prefetch=0 if name.endswith("noprefetch") else args.prefetch) \
            if kind == "s3" else S3StoreConfig()
        worker = WorkerConfig(threads=1, generator=GeneratorConfig(wrong_fraction=0.9), store=kind, s3=s3)
        self.store = build_store(kind, s3, index=root / f"{name}-index.jsonl")
        self.store.check()  # as `megatron-rl train` does before any work (it also creates the store's clients)
        self.fleet = Fleet(FleetConfig(size=args.fleet_size, episodes_per_lease=args.per_lease, heartbeat_s=1.0,
                                       wait_s=1.0), worker, root / f"{name}-fleet", store=self.store).start()
        self.waits, self.batch_s, self.read_s, self.n = [], [], [], 0
        self.fleet.run_batch("warm", self.batches(self.tasks[:args.fleet_size], prefix="warm"),
                             root / "run" / "rl_episodes" / f"{name}-warm", url="")  # workers up and warm

    def step(self, step: int) -> None:
        from megatron_rl.loop.dispatched import read_episodes

        k = self.args.per_step
        batch = self.batches(self.tasks[step * k:(step + 1) * k], prefix=f"s{step}")
        folder = self.root / "run" / "rl_episodes" / f"{self.name}-b{step}"
        t = time.perf_counter()
        self.fleet.run_batch(f"b{step}", batch, folder, url="")
        t1 = time.perf_counter()
        got = read_episodes(folder, {e.episode_id for e in batch}, store=self.store)
        t2 = time.perf_counter()
        self.waits.append(t2 - t)
        self.batch_s.append(t1 - t)
        self.read_s.append(t2 - t1)
        self.n += len(got)

    def result(self) -> dict:
        out = {"episodes": self.n, "episodes_per_s": round(self.n / sum(self.waits), 2),
               "wait_per_step_s": round(float(np.mean(self.waits)), 3),
               "wait_p50_s": round(float(np.median(self.waits)), 3), "wait_max_s": round(max(self.waits), 3),
               "batch_s": round(float(np.mean(self.batch_s)), 3), "read_s": round(float(np.mean(self.read_s)), 4)}
        pre = getattr(self.store, "prefetch", None)
        if pre is not None:
            out["prefetch"] = {k: pre.counts[k] for k in ("hits", "misses", "full", "peak_bytes")}
        return out

    def close(self) -> None:
        self.fleet.close()
        self.store.close()


def throughput(plane, root: Path, args) -> dict:
    """The stores' fleets up and warm together, then their steps alternate (fs, s3, fs, ...): a shared machine's
    load swings fall on all alike (run one after the other, a ratio moved with the load)."""
    runs = []
    try:
        for name in ("fs", "s3") + (("s3-noprefetch",) if args.no_prefetch_too else ()):
            runs.append(StoreRun(name, plane, root / name, args))
        for step in range(args.steps):
            for run in runs:
                run.step(step)
    finally:
        for run in runs:
            run.close()
    return {run.name: run.result() for run in runs}


def latency(plane, root: Path, shards: int) -> dict:
    from megatron_rl.data.shards import Trajectory
    from megatron_rl.data.store import Announcements, S3StoreConfig, build_store

    cfg = S3StoreConfig(**plane.settings(), prefix=f"lat-{time.time_ns()}", spool_dir=str(root))
    worker, trainer = build_store("s3", cfg), build_store("s3", cfg, index=root / "lat-index.jsonl")
    folder = root / "run" / "rl_episodes" / "lat"
    done = threading.Event()

    def publish():
        for i in range(shards):
            t = Trajectory(tokens=np.arange(64, dtype=np.int32), logprobs=np.zeros(64, np.float32),
                           loss_mask=np.ones(64, np.uint8), prompt_len=0, reward=0.0, group_id=i,
                           policy_version_first=0, policy_version_last=0, env="countdown", task_id="t",
                           episode_id=f"e{i}", status="ok")
            worker.publish(folder, f"s{i:04d}.h5", [t])
            time.sleep(0.05)
        done.set()

    trainer.published(folder)  # consumer created before the first publish
    watched: list[float] = []
    watcher = Announcements(cfg.queue_url, cfg.stream, cfg.timeout_s)
    watcher.watch(trainer.subject(folder), lambda data: watched.append(time.time() - json.loads(data)[
        "published_unix"]))
    th = threading.Thread(target=publish)
    th.start()
    while len(trainer.published(folder)) < shards or not done.is_set():  # poll while the worker publishes
        time.sleep(0.01)
    th.join()
    lat = [a["seen_unix"] - a["published_unix"] for a in trainer.index.values()]
    for client in (worker, trainer, watcher):
        client.close()
    return {"shards": len(lat), "p50_ms": round(1e3 * float(np.percentile(lat, 50)), 1),
            "p99_ms": round(1e3 * float(np.percentile(lat, 99)), 1), "watched": len(watched),
            "watch_p50_ms": round(1e3 * float(np.percentile(watched, 50)), 1),
            "watch_p99_ms": round(1e3 * float(np.percentile(watched, 99)), 1)}


def main() -> None:
    from megatron_rl.data.servers import DataPlane

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--per-step", type=int, default=32)
    ap.add_argument("--fleet-size", type=int, default=2)
    ap.add_argument("--per-lease", type=int, default=8)
    ap.add_argument("--latency-shards", type=int, default=50)
    ap.add_argument("--runs", type=int, default=1, help="alternating pairs, each with fresh fleets")
    ap.add_argument("--prefetch", type=int, default=2, help="episodes.s3.prefetch of the s3 store (0 = off)")
    ap.add_argument("--no-prefetch-too", action="store_true", help="also an s3 store with prefetch=0")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mrl-bench-store-") as tmp:
        root = Path(tmp)
        plane = DataPlane(root / "plane").start()
        try:
            runs = [throughput(plane, root / f"run{r}", args) for r in range(args.runs)]
            for run in runs:
                for name in [k for k in run if k.startswith("s3")]:
                    run[f"{name}_over_fs"] = round(run[name]["episodes_per_s"] / run["fs"]["episodes_per_s"], 3)
            out = runs[0] if args.runs == 1 else {"runs": runs}
            for key in [k for k in runs[0] if k.endswith("_over_fs")]:
                ratios = [run[key] for run in runs]
                out[key + "_median"], out[key + "_worst"] = round(statistics.median(ratios), 3), min(ratios)
            out["announcement_latency"] = latency(plane, root, args.latency_shards)
        finally:
            plane.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
