"""Trajectory store: the s3 store (SeaweedFS + NATS JetStream, started here) against the shared filesystem.

1. Throughput: the same STEPS batches of PER_STEP scripted episodes (deterministic, no sandbox run) run on one
   local fleet (FLEET_SIZE workers) per store, each batch then read back by the trainer (`read_episodes`).
   Both fleets are started and warmed first (servers, workers, clients: outside the timed steps), then the
   stores' steps alternate, so a shared machine's load swings fall on both alike. Reports episodes/s (episodes
   over the summed step waits) and the trainer's wait per step (queueing a batch -> its episodes in memory) for
   fs and s3, and the ratio s3/fs of episodes/s (target >= 0.8 on one node).
2. Announcement latency: a worker-side store publishes N small shards while a trainer-side store polls in a
   loop; latency = the trainer's index time - the publish call's end (`seen_unix - published_unix`), p50/p99.

Prints one JSON object. Usage: python benchmarks/trajectory_store.py [--steps 4] [--per-step 32]
       [--fleet-size 2] [--per-lease 8] [--latency-shards 50]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


class StoreRun:
    """One store's fleet and trainer-side store, warmed up; `step` times one batch (queue it, read it back)."""

    def __init__(self, store_name: str, plane, root: Path, args):
        from megatron_rl.data.store import S3StoreConfig, build_store
        from megatron_rl.dispatch import GeneratorConfig, WorkerConfig, episodes_from_tasks
        from megatron_rl.dispatch.fleet import Fleet, FleetConfig
        from megatron_rl.envs.tasks import load_domain

        self.name, self.root, self.args = store_name, root, args
        self.tasks, self.batches = load_domain("countdown", split="train"), episodes_from_tasks
        s3 = S3StoreConfig(**plane.settings(), prefix=f"bench-{time.time_ns()}", spool_dir=str(root)) \
            if store_name == "s3" else S3StoreConfig()
        worker = WorkerConfig(threads=1, generator=GeneratorConfig(wrong_fraction=0.9), store=store_name, s3=s3)
        self.store = build_store(store_name, s3, index=root / f"{store_name}-index.jsonl")
        self.store.check()  # as `megatron-rl train` does before any work (it also creates the store's clients)
        self.fleet = Fleet(FleetConfig(size=args.fleet_size, episodes_per_lease=args.per_lease, heartbeat_s=1.0,
                                       wait_s=1.0), worker, root / f"{store_name}-fleet", store=self.store).start()
        self.waits, self.n = [], 0
        self.fleet.run_batch("warm", self.batches(self.tasks[:args.fleet_size], prefix="warm"),
                             root / "run" / "rl_episodes" / f"{store_name}-warm", url="")  # workers up and warm

    def step(self, step: int) -> None:
        from megatron_rl.loop.dispatched import read_episodes

        k = self.args.per_step
        batch = self.batches(self.tasks[step * k:(step + 1) * k], prefix=f"s{step}")
        folder = self.root / "run" / "rl_episodes" / f"{self.name}-b{step}"
        t = time.perf_counter()
        self.fleet.run_batch(f"b{step}", batch, folder, url="")
        got = read_episodes(folder, {e.episode_id for e in batch}, store=self.store)
        self.waits.append(time.perf_counter() - t)
        self.n += len(got)

    def result(self) -> dict:
        return {"episodes": self.n, "episodes_per_s": round(self.n / sum(self.waits), 2),
                "wait_per_step_s": round(float(np.mean(self.waits)), 3)}

    def close(self) -> None:
        self.fleet.close()
        self.store.close()


def throughput(plane, root: Path, args) -> dict:
    """fs and s3 fleets up and warm together, then their steps alternate (fs, s3, fs, ...): a shared machine's
    load swings fall on both alike (run one after the other, a ratio moved with the load)."""
    runs = []
    try:
        for name in ("fs", "s3"):
            runs.append(StoreRun(name, plane, root, args))
        for step in range(args.steps):
            for run in runs:
                run.step(step)
    finally:
        for run in runs:
            run.close()
    return {run.name: run.result() for run in runs}


def latency(plane, root: Path, shards: int) -> dict:
    from megatron_rl.data.shards import Trajectory
    from megatron_rl.data.store import S3StoreConfig, build_store

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
    th = threading.Thread(target=publish)
    th.start()
    while len(trainer.published(folder)) < shards or not done.is_set():  # poll while the worker publishes
        time.sleep(0.01)
    th.join()
    lat = [a["seen_unix"] - a["published_unix"] for a in trainer.index.values()]
    worker.close()
    trainer.close()
    return {"shards": len(lat), "p50_ms": round(1e3 * float(np.percentile(lat, 50)), 1),
            "p99_ms": round(1e3 * float(np.percentile(lat, 99)), 1)}


def main() -> None:
    from megatron_rl.data.servers import DataPlane

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--per-step", type=int, default=32)
    ap.add_argument("--fleet-size", type=int, default=2)
    ap.add_argument("--per-lease", type=int, default=8)
    ap.add_argument("--latency-shards", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mrl-bench-store-") as tmp:
        root = Path(tmp)
        plane = DataPlane(root / "plane").start()
        try:
            out = throughput(plane, root, args)
            out["s3_over_fs_episodes_per_s"] = round(out["s3"]["episodes_per_s"] / out["fs"]["episodes_per_s"], 3)
            out["announcement_latency"] = latency(plane, root, args.latency_shards)
        finally:
            plane.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
