"""Dispatch overhead: episodes/s of trivial episodes through real Slurm job arrays vs submitit's local executor.

For 1, 16 and 64 episodes per array task (TASKS tasks each), the same episodes (scripted TEST policy, all
answers rejected without a sandbox run, so an episode costs ~nothing) run through Dispatcher with
executor=slurm (the dev cluster's cpu partition) and executor=local. Prints one JSON object; the ratio
slurm/local at 64 episodes per task is the figure of merit (target >= 0.8).

Starts the dev cluster (slurm/dev-cluster.sh start) when it is not running and stops it afterwards if it
started it. Usage: python benchmarks/dispatch_overhead.py [--tasks 4] [--repeats 1]
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
    from envs.tasks import load_domain
    from megatron_rl.dispatch import DispatchConfig, Dispatcher, GeneratorConfig, WorkerConfig, episodes_from_tasks

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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", type=int, default=4, help="array tasks per measurement")
    p.add_argument("--per-task", type=int, nargs="+", default=[1, 16, 64])
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
            for k in args.per_task:
                row = {ex: measure(ex, k, args.tasks, Path(tmp) / f"{ex}-{k}") for ex in ("local", "slurm")}
                row["ratio_slurm_vs_local"] = round(row["slurm"]["episodes_per_s"] / row["local"]["episodes_per_s"], 3)
                out["results"][str(k)] = row
    finally:
        if started:
            cluster("stop")
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
