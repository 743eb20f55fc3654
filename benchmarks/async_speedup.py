"""Sync vs async RL on this machine, and a discrete-event simulation of a cluster with long-tailed generation.

    python benchmarks/async_speedup.py [--steps 8] [--layout separate|fleet|inprocess] [--staleness 0 1 2 4]
        [--pin TRAINER_CPUS:GENERATION_CPUS] [--set key=value ...] [--skip-real]

Real: the same short run of `megatron-rl train configs/demo_cpu.yaml` (no warm-up, no dynamic sampling) with
rl.max_staleness 0, 1, 2, 4; the RL loop's wall time is the sum of its per-step times (metrics.jsonl).
Layout `separate` (default): one trainer rank, the engine in a rollout server process of its own, episodes on
rollout workers (submitit local processes) -- generation of the next steps runs while the trainer trains, as
on a cluster where rollout and training have their own devices; here they share 2 cores, so the trainer slows
down while workers run. `fleet`: the same with the episodes on a persistent fleet (workers submitted once
for the run, no per-step worker start-up). `inprocess`: the engine on the trainer ranks (only reward scoring
overlaps). The ratio depends on the balance of generation and training time (per-step splits are printed);
the first step cannot overlap anything (the pipeline fills), so `speedup_after_first_step` is reported beside
the total.
`--pin 0:1` pins the trainer (launcher, torchrun, the trainer rank) to CPU 0 and the generation processes
(rollout server, fleet workers and their sandboxes) to CPU 1 (benchmarks/cpu_pinning.py), the same for every
run, sync and async: on a 2-core machine each side then has a core of its own, as on a cluster where rollout
and training have their own devices, instead of async overlap only sharing the CPU. `--set` adds run-config
overrides (to balance generation and training time); both are recorded in the JSON, with the load average.
The fleet target (>= 1.5x over all steps) is measured with
    python benchmarks/async_speedup.py --layout fleet --staleness 1 2 --pin 0:1 --set rl.trainer.epochs=1
(one epoch: a step's training, ~5 s on one core, then about equals its generation, ~3.5 s on the other).
Per step it reports the generation wait (time_generate_s), the training time and the rest of the step
(weight sync, queueing, shard reading: `other_s`, the step-to-step overhead) and the fleet's queue-to-first-
lease time.
Simulation: G generation workers produce episodes whose durations are log-normal (long tail); the trainer
consumes B episodes per step and trains for T seconds. Sync: each step waits for its whole batch, then trains.
Async with staleness k: workers keep generating while the trainer trains, as long as an episode started at
policy version v is consumed by step v + k at the latest (the buffer holds at most k+1 batches).
Prints one JSON object: wall-time ratios sync/async and trainer idle fractions.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


LAYOUTS = {
    # the engine in a rollout server process of its own, episodes on rollout workers (submitit local
    # processes): the layout where generation can overlap training; 1 trainer rank (TP=1)
    "separate": ("episodes.runner=dispatch", "episodes.server=separate", "parallel.tp=1", "launch.nproc_per_node=1",
                 "episodes.dispatch.episodes_per_task=64", "episodes.worker_threads=2"),
    # the same, the episodes on a persistent fleet (episodes.runner=fleet): workers submitted once, warm for
    # every step (no per-step start-up of worker processes)
    "fleet": ("episodes.runner=fleet", "episodes.server=separate", "parallel.tp=1", "launch.nproc_per_node=1",
              "episodes.fleet.size=2", "episodes.fleet.episodes_per_lease=16", "episodes.worker_threads=2"),
    # the engine in-process on the 2 trainer ranks (TP=2), rewards on rank 0's threads: only scoring overlaps
    "inprocess": (),
}


def real_run(staleness: int, steps: int, out: Path, layout: str, pin: dict | None = None,
             extra: tuple = ()) -> dict:
    from benchmarks.cpu_pinning import TreePinner

    exe = str(Path(sys.executable).parent / "megatron-rl")
    args = [exe, "train", "configs/demo_cpu.yaml", f"output_dir={out}", "train.steps=0", f"rl.steps={steps}",
            f"rl.max_staleness={staleness}", "rl.dynamic_sampling=false", "eval.every=0", "eval.tasks=4",
            "data.heldout_tasks=4", "data.train_tasks=16", "monitor.tensorboard=false", *LAYOUTS[layout], *extra]
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
        pinner = TreePinner(proc.pid, pin).start() if pin else None
        try:
            rc = proc.wait(timeout=1800)
        finally:
            pinned = pinner.stop() if pinner else None
            if proc.poll() is None:
                proc.kill()
    if pin and not (pinned or {}).get("generation"):
        raise RuntimeError("--pin: no generation process was found to pin (markers in benchmarks/cpu_pinning.py)")
    if rc != 0:
        raise RuntimeError(f"run failed (staleness {staleness}):\n{out.with_suffix('.log').read_text()[-3000:]}")
    rows = [json.loads(x) for x in (out / "demo" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["kind"] == "rl"]
    wall = sum(r["time_step_s"] for r in rl)
    train = sum(r["time_train_s"] for r in rl)
    other = [r["time_step_s"] - r["time_generate_s"] - r["time_train_s"] for r in rl]
    return {"wall_s": round(wall, 3), "steady_wall_s": round(wall - rl[0]["time_step_s"], 3),
            "process_wall_s": round(time.perf_counter() - t0, 1),
            "trainer_idle_frac": round(1 - train / wall, 3), "samples": sum(r["trained_samples"] for r in rl),
            "step_s": [round(r["time_step_s"], 2) for r in rl],
            "generate_wait_s": [round(r["time_generate_s"], 2) for r in rl],
            "train_s": [round(r["time_train_s"], 2) for r in rl],
            "other_s": [round(x, 3) for x in other],
            "fleet_first_lease_s": [round(r.get("fleet_first_lease_s", 0.0), 4) for r in rl],
            "policy_lag_max": max(r["policy_lag_max"] for r in rl),
            "processes_pinned": pinned}


def simulate(staleness: int, steps: int = 200, batch: int = 64, workers: int = 128, train_s: float = 20.0,
             gen_median_s: float = 30.0, sigma: float = 1.0, seed: int = 0) -> dict:
    """Discrete-event simulation; returns wall time and trainer idle fraction."""
    rng = random.Random(seed)
    duration = [gen_median_s * rng.lognormvariate(0.0, sigma) for _ in range(steps * batch)]
    t, version, started, free, events, ready, busy = 0.0, 0, 0, workers, [], [], 0.0
    trainer_free_at = 0.0
    for step in range(steps):
        # start episodes for steps up to step + staleness (sync: only this step's), on free workers
        while started < min((step + staleness + 1) * batch, steps * batch):
            if free == 0:
                end, idx = heapq.heappop(events)
                ready.append(idx)
                free += 1
                t = max(t, end)
                continue
            heapq.heappush(events, (max(t, trainer_free_at if staleness == 0 else t) + duration[started], started))
            started, free = started + 1, free - 1
        need = (step + 1) * batch
        while len(ready) < need and events:  # wait for this step's batch
            end, idx = heapq.heappop(events)
            ready.append(idx)
            free += 1
            t = max(t, end)
        t = max(t, trainer_free_at)
        trainer_free_at = t + train_s
        busy += train_s
        version += 1
        if staleness == 0:
            t = trainer_free_at  # sync: generation of the next step waits for the update
    wall = max(t, trainer_free_at)
    return {"wall_s": round(wall, 1), "trainer_idle_frac": round(1 - busy / wall, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="separate")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="real runs (0 = the baseline)")
    p.add_argument("--pin", default="", help="TRAINER_CPUS:GENERATION_CPUS, e.g. 0:1 (default: no pinning)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra run-config overrides")
    p.add_argument("--skip-real", action="store_true")
    args = p.parse_args()
    pin = None
    if args.pin:
        from benchmarks.cpu_pinning import parse_cpus

        trainer, _, generation = args.pin.partition(":")
        pin = {"trainer": parse_cpus(trainer), "generation": parse_cpus(generation or trainer)}
    result: dict = {"simulation": {"config": {"steps": 200, "batch": 64, "workers": 128, "train_s": 20.0,
                                              "gen_median_s": 30.0, "lognormal_sigma": 1.0}}}
    sim = {k: simulate(k) for k in (0, 1, 2, 4)}
    result["simulation"].update({f"staleness_{k}": v for k, v in sim.items()})
    result["simulation"]["speedup"] = {f"staleness_{k}": round(sim[0]["wall_s"] / sim[k]["wall_s"], 2)
                                       for k in (1, 2, 4)}
    if not args.skip_real:
        with tempfile.TemporaryDirectory() as tmp:
            ks = sorted({0, *args.staleness})
            load0 = os.getloadavg()
            real = {k: real_run(k, args.steps, Path(tmp) / f"s{k}", args.layout, pin, tuple(args.set)) for k in ks}
        result["real_cpu"] = {"layout": args.layout, "overrides": [*LAYOUTS[args.layout], *args.set],
                              "steps": args.steps, "cpus": os.cpu_count(),
                              "pin": {k: sorted(v) for k, v in pin.items()} if pin else None,
                              "loadavg_start": [round(x, 2) for x in load0],
                              "loadavg_end": [round(x, 2) for x in os.getloadavg()],
                              **{f"staleness_{k}": v for k, v in real.items()}}
        result["real_cpu"]["speedup"] = {f"staleness_{k}": round(real[0]["wall_s"] / real[k]["wall_s"], 2)
                                         for k in ks if k}
        result["real_cpu"]["speedup_after_first_step"] = {
            f"staleness_{k}": round(real[0]["steady_wall_s"] / real[k]["steady_wall_s"], 2) for k in ks if k}
    result["targets"] = {"real_cpu": 1.5, "simulation": 2.5}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
