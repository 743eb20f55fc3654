"""Dispatch overhead: episodes/s of trivial episodes through real Slurm job arrays vs submitit's local executor.

For 1, 16 and 64 episodes per array task (TASKS tasks each), the same episodes (scripted TEST policy, all
answers rejected without a sandbox run, so an episode costs ~nothing) run through Dispatcher with
executor=slurm (the dev cluster's cpu partition) and executor=local. Prints one JSON object; the ratio
slurm/local at 64 episodes per task is the figure of merit (target >= 0.8).

The persistent fleet (`--fleet`, default on): STEPS batches of PER_STEP trivial episodes (>= 1,000 in all)
through one Fleet (FLEET_SIZE workers, leases of PER_LEASE) on the dev cluster, against the same steps run
with one Dispatcher job array per step (Slurm) and with the local executor (the baseline, same run). Per
1,000 episodes it reports scheduler queries (sacct calls made by submitit's watcher in this process, and
the fleet's own query ticks), job submissions and files created (shards + submitit files + fleet folder);
and the step-to-step wait with the fleet warm (from one batch's end to the next batch's first lease taken;
target <= 0.5 s).

Starts the dev cluster (slurm/dev-cluster.sh start) when it is not running and stops it afterwards if it
started it. Usage: python benchmarks/dispatch_overhead.py [--tasks 4] [--per-task 1 16 64] [--no-arrays] [--no-fleet]
       [--steps 10] [--per-step 100] [--fleet-size 4] [--per-lease 25]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCRIPT = REPO / "slurm" / "dev-cluster.sh"


def cluster(action: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), action], capture_output=True, text=True, timeout=300)


def measure(executor: str, per_task: int, tasks: int, root: Path) -> dict:
    from megatron_rl.dispatch import DispatchConfig, Dispatcher, GeneratorConfig, WorkerConfig, episodes_from_tasks
    from megatron_rl.envs.tasks import load_domain

    suite = load_domain("countdown", split="train")
    n = per_task * tasks
    eps = episodes_from_tasks((suite * (n // len(suite) + 1))[:n] if n > len(suite) else suite[:n],
                              prefix=f"{executor}{per_task}")
    for i, e in enumerate(eps):
        e.episode_id = f"{e.episode_id}-{i}"
    cfg = DispatchConfig(executor=executor, partition="cpu", folder=str(root / "submitit"), episodes_per_task=per_task,
                         time_min=10, mem_gb=0.5, poll_s=0.2)
    worker = WorkerConfig(threads=1, generator=GeneratorConfig(wrong_fraction=1.0))
    t0 = time.perf_counter()
    report = Dispatcher(cfg, worker, root / f"shards-{executor}-{per_task}").run(eps)
    dt = time.perf_counter() - t0
    if not report.ok or report.duplicates:
        raise RuntimeError(f"{executor} {per_task}: missing {len(report.missing)}, dup {report.duplicates}, "
                           f"failures {report.failures[:1]}")
    return {"episodes": n, "tasks": tasks, "seconds": round(dt, 3), "episodes_per_s": round(n / dt, 2)}


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _sacct_calls() -> int:
    from submitit.slurm.slurm import SlurmJob

    return SlurmJob.watcher.num_calls


def _batches(steps: int, per_step: int, tag: str) -> list[list]:
    from megatron_rl.dispatch import episodes_from_tasks
    from megatron_rl.envs.tasks import load_domain

    suite = load_domain("countdown", split="train")
    out = []
    for s in range(steps):
        eps = episodes_from_tasks([suite[(s * per_step + i) % len(suite)] for i in range(per_step)], prefix=f"{tag}{s}")
        for i, e in enumerate(eps):
            e.episode_id = f"{e.episode_id}-{i}"
        out.append(eps)
    return out


def _worker():
    from megatron_rl.dispatch import GeneratorConfig, WorkerConfig

    return WorkerConfig(threads=1, generator=GeneratorConfig(wrong_fraction=1.0))


def measure_fleet(args, root: Path) -> dict:
    from megatron_rl.dispatch.fleet import Fleet, FleetConfig

    batches = _batches(args.steps, args.per_step, "fleet")
    n = sum(map(len, batches))
    sacct0, t0 = _sacct_calls(), time.perf_counter()
    fleet = Fleet(FleetConfig(executor="slurm", size=args.fleet_size, episodes_per_lease=args.per_lease, mem_gb=0.5,
                              time_min=20), _worker(), root / "fleet").start()
    waits, step_s, end = [], [], None
    try:
        for s, eps in enumerate(batches):
            start = time.perf_counter()
            rep = fleet.run_batch(f"b{s}", eps, root / "shards" / f"b{s}", url="")
            if rep["given_up"]:
                raise RuntimeError(f"fleet: {len(rep['given_up'])} episodes given up")
            if end is not None:  # warm: the previous step's end -> this step's first episode leased
                waits.append(start - end + rep["first_lease_s"])
                step_s.append(rep["seconds"])
            end = time.perf_counter()
        dt = time.perf_counter() - t0
        counters = dict(fleet.counters)
    finally:
        fleet.close()
    per_k = 1000.0 / n
    return {"episodes": n, "steps": args.steps, "workers": args.fleet_size, "seconds_incl_startup": round(dt, 3),
            "episodes_per_s": round(n / dt, 2),
            "warm_episodes_per_s": round(sum(map(len, batches[1:])) / sum(step_s), 2) if step_s else None,
            "step_to_step_wait_s": {"max": round(max(waits), 4), "mean": round(sum(waits) / len(waits), 4)},
            "per_1000_episodes": {"sacct_calls": round((_sacct_calls() - sacct0) * per_k, 2),
                                  "fleet_query_ticks": round(counters["scheduler_queries"] * per_k, 2),
                                  "submissions": round(counters["submissions"] * per_k, 2),
                                  "files_created": round(_files(root) * per_k, 1)}}


def measure_arrays(args, executor: str, root: Path) -> dict:
    """The same steps with one Dispatcher job array per step (the pre-fleet path)."""
    from megatron_rl.dispatch import DispatchConfig, Dispatcher

    batches = _batches(args.steps, args.per_step, executor)
    n = sum(map(len, batches))
    cfg = DispatchConfig(executor=executor, partition="cpu", folder=str(root / "submitit"), time_min=10, mem_gb=0.5,
                         episodes_per_task=max(1, args.per_step // args.fleet_size), poll_s=0.5)
    sacct0, t0, step_s = _sacct_calls(), time.perf_counter(), []
    for s, eps in enumerate(batches):
        t = time.perf_counter()
        rep = Dispatcher(cfg, _worker(), root / "shards" / f"b{s}").run(eps)
        if not rep.ok:
            raise RuntimeError(f"{executor}: {len(rep.missing)} missing")
        step_s.append(time.perf_counter() - t)
    dt = time.perf_counter() - t0
    per_k = 1000.0 / n
    return {"episodes": n, "steps": args.steps, "seconds": round(dt, 3), "episodes_per_s": round(n / dt, 2),
            "step_s_mean": round(sum(step_s) / len(step_s), 3),
            "per_1000_episodes": {"sacct_calls": round((_sacct_calls() - sacct0) * per_k, 2),
                                  "submissions": round(args.steps * per_k, 2),
                                  "files_created": round(_files(root) * per_k, 1)}}


def fleet_section(args, tmp: Path) -> dict:
    fleet = measure_fleet(args, tmp / "fleet")
    arrays = measure_arrays(args, "slurm", tmp / "arrays-slurm")
    local = measure_arrays(args, "local", tmp / "arrays-local")
    return {"fleet_slurm": fleet, "job_array_per_step_slurm": arrays, "local_executor_per_step": local,
            "ratio_fleet_vs_local": round(fleet["episodes_per_s"] / local["episodes_per_s"], 3),
            "ratio_fleet_vs_arrays": round(fleet["episodes_per_s"] / arrays["episodes_per_s"], 3),
            "target_step_to_step_wait_s": 0.5,
            "meets_wait_target": fleet["step_to_step_wait_s"]["max"] <= 0.5}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", type=int, default=4, help="array tasks per measurement")
    p.add_argument("--per-task", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--no-arrays", action="store_true", help="skip the per-task-size job-array measurement")
    p.add_argument("--no-fleet", action="store_true", help="skip the persistent-fleet measurement")
    p.add_argument("--steps", type=int, default=10, help="fleet: steps (batches)")
    p.add_argument("--per-step", type=int, default=100, help="fleet: episodes per step")
    p.add_argument("--fleet-size", type=int, default=4, help="fleet: workers")
    p.add_argument("--per-lease", type=int, default=25, help="fleet: episodes per lease (one shard each)")
    args = p.parse_args()
    os.environ.setdefault("MRL_SLURM_STATE", "/tmp/megatron-rl-slurm")
    os.environ["SLURM_CONF"] = str(Path(os.environ["MRL_SLURM_STATE"]) / "etc" / "slurm.conf")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    started = cluster("status").returncode != 0
    if started:
        res = cluster("start")
        if res.returncode != 0:
            print(json.dumps({"error": "slurm/dev-cluster.sh start failed", "stderr": res.stderr[-2000:]}))
            return 1
    out: dict = {"benchmark": "dispatch_overhead", "tasks_per_measurement": args.tasks, "loadavg_start":
                 os.getloadavg()[0], "results": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="mrl-dispatch-bench-") as tmp:
            for k in [] if args.no_arrays else args.per_task:
                row = {ex: measure(ex, k, args.tasks, Path(tmp) / f"{ex}-{k}") for ex in ("local", "slurm")}
                row["ratio_slurm_vs_local"] = round(row["slurm"]["episodes_per_s"] / row["local"]["episodes_per_s"], 3)
                out["results"][str(k)] = row
            if not args.no_fleet:
                out["fleet"] = fleet_section(args, Path(tmp))
    finally:
        if started:
            cluster("stop")
    if out["results"]:
        last = out["results"].get("64") or out["results"][str(args.per_task[-1])]
        out["ratio_at_64"] = last["ratio_slurm_vs_local"]
        out["target_ratio_at_64"] = 0.8
        out["meets_target"] = out["ratio_at_64"] >= 0.8
    out["loadavg_end"] = os.getloadavg()[0]
    out["cluster_started_by_benchmark"] = started
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
