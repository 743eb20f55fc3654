"""`megatron-rl train <config.yaml> [key=value ...]`: the main job.

What it runs today (the RL loop arrives with the rollout-engine and RL-loop issues; this command grows into
it): the supervised warm-up phase of the demo, end to end on the real parts that exist:

  1. tasks of the configured domain from its suite; every reference solution is checked by the
     environment's own reward in the sandbox (bubblewrap by default); verified ones become trajectories
     (prompt tokens loss-masked) written as atomic HDF5 shards;
  2. torchrun starts the ranks (gloo on CPU); Megatron-Core builds the policy at the configured TP/PP/EP
     layout (DDP + distributed optimizer) and trains on the shards, evaluating held-out loss;
  3. metrics go to <run>/metrics.jsonl; the summary says what ran and where the outputs are.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_rl import config as C
from megatron_rl.run_config import RunConfig


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-rl train", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("config", help="YAML run config (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5 parallel.tp=2")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank started by torchrun
    p.add_argument("--dry-run", action="store_true", help="load and validate the config, print it, stop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = C.load(RunConfig, args.config, args.overrides)
    except C.ConfigError as e:
        print(f"megatron-rl train: config error: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.output_dir) / cfg.name
    if args.worker:
        from megatron_rl.commands.warmup import worker_main

        return worker_main(cfg, run_dir)
    if args.dry_run:
        print(C.dump_yaml(cfg))
        return 0
    return drive(cfg, run_dir, args)


def drive(cfg: RunConfig, run_dir: Path, args: argparse.Namespace) -> int:
    from megatron_rl.commands.warmup import prepare_data

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(C.dump_yaml(cfg))
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    t0 = time.time()
    _say(f"run '{cfg.name}' -> {run_dir}  (layout tp={cfg.parallel.tp} pp={cfg.parallel.pp} ep={cfg.parallel.ep}, "
         f"{cfg.launch.nproc_per_node} ranks)")
    data = prepare_data(cfg, run_dir)
    _say(f"data: {data['train_samples']} train / {data['heldout_samples']} held-out samples from "
         f"'{cfg.data.domain}'; reference solutions verified in the '{cfg.data.sandbox}' sandbox: "
         f"{data['verified']}/{data['checked']} correct, corrupted answers rejected: {data['rejected']}/"
         f"{data['checked']}; shards in {data['shard_dir']}")
    rc = launch_workers(cfg, run_dir, args)
    if rc != 0:
        _say(f"training ranks failed (exit {rc}); see the output above")
        return rc
    summary(cfg, run_dir, time.time() - t0)
    return 0


def launch_workers(cfg: RunConfig, run_dir: Path, args: argparse.Namespace) -> int:
    """Start the ranks: in-process when already under a launcher (torchrun, srun), else torchrun here."""
    module = ["-m", "megatron_rl.commands.train", args.config, *args.overrides, "--worker"]
    if "RANK" in os.environ or "SLURM_STEP_ID" in os.environ:
        return subprocess.call([sys.executable, *module])
    from megatron_rl.distributed import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg.launch.nproc_per_node}",
           "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={free_port()}", *module]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.call(cmd, env=env)


def summary(cfg: RunConfig, run_dir: Path, seconds: float) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    _say(f"trained {len(train)} steps in {seconds:.0f} s: train loss {train[0]['loss']:.3f} -> "
         f"{train[-1]['loss']:.3f}; held-out loss {evals[0]['loss']:.3f} -> {evals[-1]['loss']:.3f}")
    _say(f"metrics: {run_dir / 'metrics.jsonl'}; shards: {run_dir / 'shards'} "
         f"(inspect with: megatron-rl inspect {run_dir / 'shards'})")
    _say("not yet in this job: generation by the rollout engine and the GRPO loop (rollout-engine and RL-loop "
         "issues); this run is the supervised warm-up phase of the demo")


def _say(msg: str) -> None:
    print(f"[megatron-rl] {msg}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
