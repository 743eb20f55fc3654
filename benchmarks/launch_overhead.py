"""CPU of starting a world of local ranks: torchrun --standalone vs the project's launcher (LocalRanks).

    python benchmarks/launch_overhead.py [--pairs 3] [--nproc 2]

Each trial starts `nproc` ranks that only join the rendezvous (gloo), meet at a barrier and leave, from this
process (which has torch imported, as `megatron-rl train`, `tools/convert` and pytest have when they launch).
torchrun's way adds its agent process (an interpreter importing torch); LocalRanks serves the store from this
process. The two alternate, `pairs` times each (a shared machine's load falls on both alike); CPU seconds are
user + sys of the reaped children (the ranks, and torchrun's agent). Prints one JSON object: per launcher the
CPU-seconds and wall seconds of each trial, their medians, and the ratio of the medians (local / torchrun).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RANK = "import torch.distributed as d\nd.init_process_group('gloo')\nd.barrier()\nd.destroy_process_group()\n"


def trial(kind: str, script: str, nproc: int) -> tuple[float, float]:
    """(CPU seconds of the reaped children, wall seconds) of one launch."""
    from megatron_rl.commands.launch import LocalRanks, rank_env

    env = rank_env(extra={"OMP_NUM_THREADS": "1"})
    t0, w0 = os.times(), time.monotonic()
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
        rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    else:
        rc = LocalRanks([script], nproc, env).run()
    t1, w1 = os.times(), time.monotonic()
    if rc != 0:
        raise SystemExit(f"{kind} launch failed (exit {rc})")
    return t1.children_user - t0.children_user + t1.children_system - t0.children_system, w1 - w0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    import torch  # noqa: F401  (the launching process has torch, as the product's launchers do)

    out = {"nproc": args.nproc, "pairs": args.pairs}
    with tempfile.TemporaryDirectory(prefix="mrl-launch-bench-") as tmp:
        script = str(Path(tmp) / "rank.py")
        Path(script).write_text(RANK)
        runs = {"torchrun": [], "local": []}
        for _ in range(args.pairs):
            for kind in runs:
                runs[kind].append(trial(kind, script, args.nproc))
    for kind, got in runs.items():
        out[kind] = {"cpu_s": [round(c, 2) for c, _ in got], "wall_s": [round(w, 2) for _, w in got],
                     "cpu_s_median": round(statistics.median(c for c, _ in got), 2),
                     "wall_s_median": round(statistics.median(w for _, w in got), 2)}
    out["cpu_ratio_local_vs_torchrun"] = round(out["local"]["cpu_s_median"] / out["torchrun"]["cpu_s_median"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
