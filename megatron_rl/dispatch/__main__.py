"""Command line for the sbatch scripts in slurm/.

    python -m megatron_rl.dispatch run   --env countdown --num 64 --executor slurm --partition cpu --out DIR
    python -m megatron_rl.dispatch slice --env countdown --split heldout --count 4 --out DIR   # one array task

    python -m megatron_rl.dispatch fleet --env countdown --steps 4 --per-step 32 --size 3 --executor slurm --out DIR

`fleet` runs `--steps` batches of episodes through one persistent fleet (a loop without a trainer: the
benchmark's and the fault test's driver); a rerun with the same --out resumes after the last finished step
(DIR/steps.jsonl) and re-queues only the unpublished episodes of the interrupted one.
`run` dispatches a fleet with submitit (the driver of rl_submitit.sbatch) and writes DIR/report.json.
`slice` runs the array task's share of a task suite in this process (eval_array.sbatch); the slice index
comes from the Slurm array task id (through megatron_rl.slurm_env) unless --index is given.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from megatron_rl.dispatch.dispatcher import DispatchConfig, Dispatcher, episodes_from_tasks
from megatron_rl.dispatch.spec import GeneratorConfig, WorkerConfig, WorkerSpec
from megatron_rl.slurm_env import SlurmEnv


def _tasks(args):
    from megatron_rl.envs.tasks import load_domain

    tasks = load_domain(args.env, split=args.split)
    return tasks[: args.num] if args.num else tasks


def _worker(args) -> WorkerConfig:
    gen = GeneratorConfig(kind="http", url=args.engine_url) if args.engine_url else GeneratorConfig(
        wrong_fraction=args.wrong_fraction)
    return WorkerConfig(generator=gen, threads=args.threads)


def cmd_run(args) -> int:
    cfg = DispatchConfig(executor=args.executor, partition=args.partition, folder=str(Path(args.out) / "submitit"),
                         episodes_per_task=args.episodes_per_task, time_min=args.time_min,
                         cpus_per_task=args.cpus_per_task, mem_gb=args.mem_gb, max_retries=args.max_retries)
    eps = episodes_from_tasks(_tasks(args), samples_per_task=args.samples, prefix=args.prefix)
    report = Dispatcher(cfg, _worker(args), Path(args.out) / "shards").run(eps)
    (Path(args.out) / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
    print(json.dumps({"finished": len(report.finished), "missing": len(report.missing),
                      "duplicates": report.duplicates, "recovered": report.recovered, "shards": len(report.shards),
                      "rounds": report.rounds}))
    return 0 if report.ok else 1


def cmd_slice(args) -> int:
    senv = SlurmEnv.from_environ()
    index = args.index if args.index is not None else (senv.array_task_id if senv else None)
    if index is None:
        print("slice: no --index and not a Slurm array task", file=sys.stderr)
        return 2
    tasks = _tasks(args)[index:: args.count]
    eps = episodes_from_tasks(tasks, samples_per_task=args.samples, prefix=f"{args.prefix}-s{index}")
    spec = WorkerSpec(episodes=eps, shard_dir=str(Path(args.out) / "shards"), shard_prefix=f"{args.prefix}-s{index}",
                      worker=_worker(args))
    from megatron_rl.dispatch.worker import run_episode_batch

    res = run_episode_batch(spec)
    print(json.dumps({"slice": index, "episodes": len(res.finished), "shards": res.shards}))
    return 0


def cmd_fleet(args) -> int:
    from megatron_rl.dispatch.fleet import Fleet, FleetConfig
    from megatron_rl.dispatch.spec import FaultConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = FleetConfig(executor=args.executor, size=args.size, partition=args.partition, time_min=args.time_min,
                      mem_gb=args.mem_gb, episodes_per_lease=args.episodes_per_lease, lease_s=args.lease_s,
                      heartbeat_s=args.heartbeat_s, wait_s=args.wait_s, poll_s=args.poll_s,
                      orphan_exit_s=args.orphan_exit_s, max_attempts=args.max_attempts)
    worker = _worker(args)
    worker.faults = FaultConfig(delay_s=args.delay_s)
    log_path = out / "steps.jsonl"
    done = [json.loads(line)["step"] for line in log_path.read_text().splitlines()] if log_path.exists() else []
    tasks = _tasks(args)
    fleet = Fleet(cfg, worker, out / "fleet").start()
    try:
        for step in range(len(done), args.steps):
            part = [tasks[(step * args.per_step + i) % len(tasks)] for i in range(args.per_step)]
            eps = episodes_from_tasks(part, samples_per_task=args.samples, prefix=f"{args.prefix}{step}")
            for i, e in enumerate(eps):
                e.episode_id = f"{e.episode_id}-{i}"
            rep = fleet.run_batch(f"step{step:04d}", eps, out / "shards" / f"step{step:04d}", args.engine_url)
            row = {"step": step, **rep, "given_up": len(rep["given_up"]), **fleet.counters,
                   **fleet.state.queue.counters}
            with open(log_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    finally:
        fleet.close()
    return 0


def _add_fleet_args(f) -> None:
    f.add_argument("--executor", default="slurm", choices=("local", "slurm"))
    f.add_argument("--partition", default="cpu")
    f.add_argument("--steps", type=int, default=4, help="batches (steps) to run")
    f.add_argument("--per-step", type=int, default=32, help="tasks per step (x --samples episodes)")
    f.add_argument("--size", type=int, default=2, help="fleet size (workers)")
    f.add_argument("--episodes-per-lease", type=int, default=8)
    f.add_argument("--lease-s", type=float, default=30.0)
    f.add_argument("--heartbeat-s", type=float, default=5.0)
    f.add_argument("--wait-s", type=float, default=10.0)
    f.add_argument("--poll-s", type=float, default=5.0)
    f.add_argument("--orphan-exit-s", type=float, default=300.0)
    f.add_argument("--max-attempts", type=int, default=3, help="leases of one episode lost before it is given up")
    f.add_argument("--time-min", type=int, default=60)
    f.add_argument("--mem-gb", type=float, default=1.0)
    f.add_argument("--delay-s", type=float, default=0.0, help="TEST: sleep before each episode")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.dispatch")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "slice", "fleet"):
        s = sub.add_parser(name)
        s.add_argument("--env", default="countdown", help="environment whose task suite to run")
        s.add_argument("--split", default="train", help="train or heldout")
        s.add_argument("--num", type=int, default=0, help="first N tasks (0 = all)")
        s.add_argument("--samples", type=int, default=1, help="episodes per task (a group)")
        s.add_argument("--out", required=True, help="output folder (shards/, report.json)")
        s.add_argument("--prefix", default="ep", help="episode id prefix")
        s.add_argument("--engine-url", default="", help="rollout engine URL; empty = scripted TEST policy")
        s.add_argument("--wrong-fraction", type=float, default=0.5, help="test policy: wrong-answer fraction")
        s.add_argument("--threads", type=int, default=0, help="episodes at once per task (0 = CPUs given)")
    r = sub.choices["run"]
    r.add_argument("--executor", default="slurm", choices=("local", "slurm", "debug"))
    r.add_argument("--partition", default="cpu")
    r.add_argument("--episodes-per-task", type=int, default=16)
    r.add_argument("--time-min", type=int, default=10)
    r.add_argument("--cpus-per-task", type=int, default=1)
    r.add_argument("--mem-gb", type=float, default=1.0)
    r.add_argument("--max-retries", type=int, default=2)
    sl = sub.choices["slice"]
    sl.add_argument("--count", type=int, required=True, help="number of slices (array size)")
    sl.add_argument("--index", type=int, help="slice index (default: the Slurm array task id)")
    _add_fleet_args(sub.choices["fleet"])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"run": cmd_run, "slice": cmd_slice, "fleet": cmd_fleet}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
