"""`megatron-rl train <config.yaml> [key=value ...]`: the main job.

  1. tasks (the configured domain's suite, or its generated tasks: `curriculum:`, envs.task_source); every reference
     solution is checked by the environment's own reward in the sandbox (bubblewrap by default); verified ones
     become warm-up trajectories (prompt tokens loss-masked) in atomic HDF5 shards;
  2. the ranks start (gloo on CPU; a single rank runs in this process); Megatron-Core builds the policy at the
     configured layout and trains it supervised on those shards (the warm-up);
  3. the RL loop (`megatron_rl/driver.py`): the rollout engine in-process on the same ranks generates groups,
     rank 0 scores them in the sandbox, GRPO updates the policy, weights are copied into the engine; sync or
     async (rl.max_staleness), dynamic sampling, held-out evaluation (pass@k), checkpoints, alerts;
  4. metrics go to <run>/metrics.jsonl (and TensorBoard), plots to <run>/plots; the summary says what ran.

SIGTERM/SIGUSR1 stop the run after the current step (warm-up or RL) with a checkpoint; the same command resumes it.
Both phases also checkpoint periodically (train.checkpoint_every, rl.checkpoint_every). Logs are append-only: a
resumed run appends (a "resume" row marks where; readers take the last row of each (kind, step)), and a fresh run
in a folder that holds an earlier run's metrics.jsonl / alerts.jsonl first moves them to <name>.N.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from megatron_rl import config as C
from megatron_rl.commands.launch import run_here, run_ranks
from megatron_rl.run_config import RunConfig
from megatron_rl.slurm_env import under_launcher


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
        return rank_main(cfg, run_dir)
    if args.dry_run:
        print(C.dump_yaml(cfg))
        return 0
    try:
        check_store(cfg)
    except RuntimeError as e:
        print(f"megatron-rl train: {e}", file=sys.stderr)
        return 2
    return drive(cfg, run_dir, here=True)


def check_store(cfg: RunConfig) -> None:
    """`episodes.store` other than fs: its servers answer, its bucket exists and its keys are accepted, before
    any work (StoreError naming the setting)."""
    if cfg.episodes.runner == "inprocess" or cfg.episodes.store == "fs":
        return
    from megatron_rl.data.store import build_store

    store = build_store(cfg.episodes.store, cfg.episodes.s3)
    try:
        store.check()
    finally:
        store.close()


def run(cfg: RunConfig) -> dict:
    """The Python API's `train`: drive the run of `cfg`; its summary.json, or RuntimeError naming the exit."""
    run_dir = Path(cfg.output_dir) / cfg.name
    check_store(cfg)
    rc = drive(cfg, run_dir)
    if rc != 0:
        raise RuntimeError(f"run {cfg.name!r} ended with exit {rc} (3: stopped early with a checkpoint; run "
                           f"train(cfg) again to resume); see {run_dir}")
    return json.loads((run_dir / "summary.json").read_text())


def drive(cfg: RunConfig, run_dir: Path, here: bool = False) -> int:
    """The run from the launching process: prepare, start the ranks, export, summarise. `here`: a single-rank run
    is run in this process (the command line); the Python API keeps its caller's process clean."""
    t0, cpu0 = time.time(), cpu_seconds()  # a baseline: what ran before (scripts/run.sh's set-up) is not counted
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(C.dump_yaml(cfg))
    if cfg.envs.patterns:  # envs.domains by pattern: the resolved list, logged and saved with the run
        from megatron_rl.envs.procedural.domains import describe, resolved

        (run_dir / "envs_domains.json").write_text(json.dumps(resolved(cfg.envs), indent=1) + "\n")
        _say(f"{describe(cfg.envs)}; list: {run_dir / 'envs_domains.json'}")
    _say(f"run '{cfg.name}' -> {run_dir}  (layout tp={cfg.parallel.tp} pp={cfg.parallel.pp} ep={cfg.parallel.ep}, "
         f"{cfg.launch.nproc_per_node} ranks; RL: {cfg.rl.steps} GRPO steps of {cfg.rl.prompts_per_step} prompts x "
         f"{cfg.rl.group_size} samples, max_staleness={cfg.rl.max_staleness})")
    before = _resume_or_start(cfg, run_dir)
    rc = launch_workers(cfg, run_dir, here)
    if rc == 3:
        _say(_stopped_message(run_dir, before))
        return rc
    if rc != 0:
        _say(f"training ranks failed (exit {rc}); see the output above")
        return rc
    export_dir = _export(cfg, run_dir) if cfg.export.enabled and cfg.rl.steps > 0 else None
    summary(cfg, run_dir, time.time() - t0, cpu_seconds() - cpu0, export_dir)
    return 0


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that were waited for (the ranks, their
    sandboxes). Both counters survive `exec`: scripts/run.sh's set-up (pip, the model import) is in them when
    the run starts, so a run reports the difference from its start (`drive`)."""
    import resource

    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def rank_main(cfg: RunConfig, run_dir: Path) -> int:
    """One rank: the supervised warm-up (unless resuming an RL run), then the RL loop. Returns 0, or 3 when a
    signal (or an alert) stopped the run after a checkpoint of the phase it was in."""
    import torch
    from megatron.core import tensor_parallel

    from megatron_rl.commands.warmup import warmup_phase
    from megatron_rl.distributed import destroy_distributed, init_distributed
    from megatron_rl.driver import StopFlag, run_rl
    from megatron_rl.loop.job import monitor_config
    from megatron_rl.monitoring import Monitor
    from megatron_rl.trainer.latest import latest

    stop = StopFlag()  # first: from here on SIGTERM/SIGUSR1 stop at a step boundary, after a checkpoint
    ctx = init_distributed(cfg.parallel, cfg.launch.backend, timeout_minutes=cfg.launch.timeout_minutes)
    torch.manual_seed(cfg.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    warm, rc = None, 0
    monitor = Monitor(monitor_config(cfg), run_dir, ctx.rank == 0)  # one for both phases
    if not latest(run_dir, "rl") and cfg.train.steps > 0:
        warm, reason = warmup_phase(cfg, run_dir, ctx, stop, monitor)
        rc = 3 if reason and (warm is None or cfg.rl.steps > 0) else 0
    if rc == 0 and cfg.rl.steps > 0:
        rc = run_rl(cfg, run_dir, ctx, warm, stop=stop, monitor=monitor)
    monitor.close()
    destroy_distributed()
    return rc


def _latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint a rerun resumes from: the newest one, RL or warm-up (the run's one pointer)."""
    from megatron_rl.trainer.latest import latest

    return latest(run_dir)


def _resume_or_start(cfg: RunConfig, run_dir: Path) -> Path | None:
    """Say what this launch resumes; a fresh start keeps an earlier run's logs (rotated, never truncated) and
    prepares the warm-up data. Returns the checkpoint resumed from (None: a fresh start)."""
    from megatron_rl.commands.warmup import HELDOUT_SHARD, TRAIN_SHARD, warmup_latest
    from megatron_rl.loop.state import latest

    ckpt = _latest_checkpoint(run_dir)
    if latest(run_dir):
        _say(f"resuming from {ckpt} (delete {run_dir / 'checkpoints'} to start over)")
        return ckpt
    if warmup_latest(run_dir):
        _say(f"resuming the warm-up from {ckpt} (delete {run_dir / 'checkpoints'} to start over)")
        if all((run_dir / "shards" / n).exists() for n in (TRAIN_SHARD, HELDOUT_SHARD)):
            return ckpt
    else:
        for old, kept in rotate_logs(run_dir):
            _say(f"a fresh run in an existing run folder: the earlier {old.name} is kept as {kept.name}")
    if cfg.train.steps > 0:
        _prepare(cfg, run_dir)
    return ckpt


LOGS = ("metrics.jsonl", "alerts.jsonl")


def rotate_logs(run_dir: Path) -> list[tuple[Path, Path]]:
    """Move each non-empty log of LOGS to the first free <name>.N (1, 2, ...): a fresh start in a run folder
    that holds an earlier run's logs keeps them. Returns the (old, kept) paths moved."""
    moved = []
    for name in LOGS:
        old = run_dir / name
        if not old.exists() or old.stat().st_size == 0:
            continue
        n = 1
        while (run_dir / f"{name}.{n}").exists():
            n += 1
        kept = run_dir / f"{name}.{n}"
        os.replace(old, kept)
        moved.append((old, kept))
    return moved


def _stopped_message(run_dir: Path, before: Path | None) -> str:
    """What a stopped launch leaves (exit 3): the checkpoint the same command resumes from, true to the disk."""
    now = _latest_checkpoint(run_dir)
    if now is None:
        return "the run stopped (signal or alert) before any checkpoint was saved; the same command starts it again"
    when = "saved by this launch" if now != before else "from an earlier launch: nothing newer was saved"
    return f"the run stopped early (signal or alert); checkpoint {now} ({when}); the same command resumes from it"


def _export(cfg: RunConfig, run_dir: Path) -> Path:
    """The latest RL checkpoint as an HF folder (`megatron-rl export`), in <run>/export/hf-step-N."""
    from megatron_rl.commands.export import export_run

    report = export_run(run_dir, step=None, out=None, verify=cfg.export.verify, replace=True)
    diff = report.get("verify", {}).get("max_abs_logit_diff")
    checked = f" (verified: max |logit diff| {diff:.2e})" if diff is not None else ""
    _say(f"exported the policy of step {report['step']} as an HF folder: {report['out']}{checked}")
    if cfg.lora.enabled:  # and the adapters alone, as a PEFT folder
        peft = export_run(run_dir, step=None, out=None, replace=True, adapter=True)
        _say(f"exported the LoRA adapters as a PEFT folder: {peft['out']}")
    return Path(report["out"])


def _prepare(cfg: RunConfig, run_dir: Path) -> None:
    from megatron_rl.commands.warmup import RECHECKS, prepare_data

    data = prepare_data(cfg, run_dir)
    _say(f"data: {data['train_samples']} train / {data['heldout_samples']} held-out samples from "
         f"'{cfg.data.domain}'; reference solutions verified in the '{cfg.data.sandbox}' sandbox: "
         f"{data['verified']}/{data['checked']} correct, corrupted answers rejected: {data['rejected']}/"
         f"{data['checked']}; shards in {data['shard_dir']}")
    if data["unverified"]:
        _say(f"data: {data['unverified']} reference solutions failed {1 + RECHECKS} checks each and are left out "
             f"({data['rechecked']} re-checks in all): " + "; ".join(data["unverified_tasks"]))


def launch_workers(cfg: RunConfig, run_dir: Path, here: bool = False) -> int:
    """Start the ranks (they read <run>/config.yaml, the config this process resolved and wrote): one process
    when already under a launcher (torchrun, srun), else launch.nproc_per_node local ranks; with `here` and one
    rank, that rank runs in this process (no second interpreter importing torch and Megatron)."""
    config = run_dir / "config.yaml"
    if here and cfg.launch.nproc_per_node == 1 and not under_launcher():
        return run_here(lambda: rank_main(C.load(RunConfig, str(config), []), run_dir), cfg.launch)
    return run_ranks(["-m", "megatron_rl.commands.train", str(config), "--worker"], cfg.launch.nproc_per_node,
                     cfg.launch)


def summary(cfg: RunConfig, run_dir: Path, seconds: float, cpu: float, export_dir: Path | None = None) -> None:
    """Print the run's outcome and write summary.json; `seconds` and `cpu`: the run's own wall and CPU time."""
    from megatron_rl.commands.report import read_metrics

    rows = read_metrics(run_dir)
    sft = [r for r in rows if r["kind"] == "sft"]
    sft_eval = [r for r in rows if r["kind"] == "sft_eval"]
    rl = [r for r in rows if r["kind"] == "rl"]
    evals = [r for r in rows if r["kind"] == "eval"]
    _say(f"finished in {seconds:.0f} s wall, {cpu:.0f} s CPU (this process and the ranks, sandboxes included)")
    write_summary(cfg, run_dir, rows, seconds, cpu, export_dir)
    if sft:
        _say(f"warm-up: {len(sft)} supervised steps, train loss {sft[0]['loss']:.3f} -> {sft[-1]['loss']:.3f}; "
             f"held-out loss {sft_eval[0]['loss']:.3f} -> {sft_eval[-1]['loss']:.3f}")
    if rl:
        w = max(1, min(5, len(rl) // 2))
        trained = sum(not r.get("update_skipped") for r in rl)
        first, last = (sum(r["reward_mean"] for r in part) / len(part) for part in (rl[:w], rl[-w:]))
        _say(f"RL: {len(rl)} GRPO steps, rollout reward (mean of {w} steps) {first:.3f} -> {last:.3f}; "
             f"{trained} updates (a step whose groups all have equal rewards has none); "
             f"trainer idle {sum(r['trainer_idle_frac'] for r in rl) / len(rl):.0%}")
    if len(evals) >= 2:
        k = cfg.eval.k
        domains = ", ".join(cfg.envs.domains)
        _say(f"held-out success ({domains}: each domain's own sandboxed success, {evals[0]['tasks']} tasks): greedy "
             f"{evals[0]['success_greedy']:.3f} -> {evals[-1]['success_greedy']:.3f}, pass@1 "
             f"{evals[0]['pass@1']:.3f} -> {evals[-1]['pass@1']:.3f}, pass@{k} "
             f"{evals[0][f'pass@{k}']:.3f} -> {evals[-1][f'pass@{k}']:.3f} (before -> after GRPO, "
             f"steps {evals[0]['step']} -> {evals[-1]['step']})")
    if len(evals) >= 2 and len(cfg.envs.domains) >= 2:
        t = write_summary_table(run_dir)
        _say(f"per domain ({len(t['domains'])}): mean held-out pass@1 {t['pass@1_mean_before']:.3f} -> "
             f"{t['pass@1_mean_after']:.3f}; {t['improved']} improved, {t['worse']} worse, {t['unchanged']} "
             f"unchanged; {len(t['no_gradient'])} had no gradient over the run (table: {run_dir / 'domains.md'})")
    from megatron_rl.commands.report import make_report

    plots = make_report(run_dir)
    _say(f"metrics: {run_dir / 'metrics.jsonl'}; plots: {', '.join(str(p) for p in plots) or 'none'}; "
         f"shards: {run_dir / 'rl_shards'} (megatron-rl inspect DIR); checkpoints: {run_dir / 'checkpoints'}")


def write_summary(cfg: RunConfig, run_dir: Path, rows: list[dict], wall: float, cpu: float, export_dir) -> dict:
    """<run>/summary.json: the model, held-out success before and after RL (overall and per domain), steps, time."""
    evals = [r for r in rows if r["kind"] == "eval"]
    k = f"pass@{cfg.eval.k}"

    def heldout(r: dict | None) -> dict | None:
        if r is None:
            return None
        keys = ("success_greedy", "pass@1", k, "tasks")
        per = {d: {m: r[f"{d}/{m}"] for m in keys if f"{d}/{m}" in r} for d in _domains(r)}
        return {**{m: r[m] for m in keys if m in r}, "domains": per}

    from megatron_rl.eval_report import domain_table

    table = domain_table(evals, cfg.eval.k, [r for r in rows if r["kind"] == "rl"])
    out = {"name": cfg.name, "model": cfg.model.init or "random (model section)",
           "domains": _run_domains(cfg), "heldout_before": heldout(evals[0] if evals else None),
           "heldout_after": heldout(evals[-1] if len(evals) > 1 else None),
           "rl_steps": len([r for r in rows if r["kind"] == "rl"]), "warmup_steps": len([r for r in rows
                                                                                         if r["kind"] == "sft"]),
           "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "export_dir": str(export_dir) if export_dir else None,
           "domain_table": table}  # per domain: held-out before/after, task count, no gradient (eval_report)
    (run_dir / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def write_summary_table(run_dir: Path) -> dict:
    """The per-domain table just written into summary.json."""
    return json.loads((run_dir / "summary.json").read_text())["domain_table"]


def _run_domains(cfg: RunConfig) -> list[str]:
    """The RL mixture's domains (envs.domains, patterns expanded; data.domain alone when it is empty), with the
    warm-up's data.domain when there is a warm-up."""
    return sorted(set(cfg.envs.domains) | ({cfg.data.domain} if cfg.train.steps else set()))


def _domains(row: dict) -> list[str]:
    return sorted({key.rsplit("/", 1)[0] for key in row if key.endswith("/pass@1")})  # names may hold '/'


def _say(msg: str) -> None:
    print(f"[megatron-rl] {msg}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
