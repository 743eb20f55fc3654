"""`megatron-rl eval <run config.yaml> [key=value ...]`: held-out success of a checkpoint, per domain and per task.

Loads a `train` checkpoint (default: the run's latest, `<output_dir>/<name>/checkpoints/latest`), or with
`--hf DIR` an HF model folder (`model.init=hf:DIR`: no RL checkpoint needed), at the config's parallel layout,
copies the weights into the rollout engine and measures on each domain's held-out tasks
greedy success, pass@1 and pass@k (k = eval.k samples at rl.temperature), scored by the domain's own reward in
the configured sandbox: the same measurement as the RL loop's in-loop evaluation. The run's domain uses the
run's held-out split (the generated curriculum when enabled); `--domains` adds other registered domains'
shipped held-out suites. Results are printed and written as JSON (`--out`, default `<run>/eval.json`); the per-task
table (pass@1 and pass@k per task, per domain and overall; `megatron_rl.eval_report`) is printed and written next
to it as `eval_tasks.json`, `eval_tasks.md` and a plot `eval_tasks.png` (when matplotlib is installed).
Episodes run on the run's episode runner, the same one the RL loop uses: in process, or dispatched to rollout
workers or the persistent fleet (`episodes.runner: dispatch | fleet`, `loop.job.rollouts_for`). Harbor tasks:
`--domains harbor` (its shipped held-out tasks), or `envs.domains.harbor.task_files=[DIR]` for a folder of tasks.
Pass the run's saved `<run>/config.yaml` to evaluate it as trained.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_rl import config as C
from megatron_rl.run_config import RunConfig


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-rl eval", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("config", help="the run's YAML config (e.g. <run>/config.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.k=8 eval.tasks=32")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the run's latest)")
    p.add_argument("--hf", help="evaluate an HF model folder instead of a checkpoint (sets model.init=hf:DIR)")
    p.add_argument("--domains", default="", help="comma-separated extra domains (their shipped held-out suites)")
    p.add_argument("--out", help="JSON results file (default: <run>/eval.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        overrides = [*args.overrides, f"model.init=hf:{args.hf}"] if args.hf else args.overrides
        cfg = C.load(RunConfig, args.config, overrides)
        plan = _plan(cfg, args)
    except C.ConfigError as e:
        print(f"megatron-rl eval: {e}", file=sys.stderr)
        return 2
    if args.worker:
        return worker_main(cfg, **plan)
    rc = _launch(cfg, args)
    if rc == 0:
        _say(json.loads(Path(plan["out"]).read_text()), plan["out"])
    return rc


def _say(results: dict, out: Path) -> None:
    for domain, m in results["domains"].items():
        k = m["k"]
        print(f"[megatron-rl] eval {domain}: greedy {m['success_greedy']:.3f}  pass@1 {m['pass@1']:.3f}  "
              f"pass@{k} {m[f'pass@{k}']:.3f}  ({m['tasks']} tasks)", flush=True)
    report = results.get("report") or {}
    if report.get("markdown"):
        print(Path(report["markdown"]).read_text(), flush=True)
    print(f"[megatron-rl] results: {out}; per task: {report.get('json')}, {report.get('markdown')}, "
          f"{report.get('plot')}", flush=True)


def _plan(cfg: RunConfig, args: argparse.Namespace) -> dict:
    """Checkpoint, domains and output path; errors name the fix."""
    import megatron_rl.envs  # noqa: F401  (registers the built-in environments)
    from megatron_rl.envs.base import ENVIRONMENTS
    from megatron_rl.loop.state import latest

    run_dir = Path(cfg.output_dir) / cfg.name
    if args.hf and args.checkpoint:
        raise C.ConfigError("--hf and --checkpoint exclude each other: evaluate one model")
    ckpt = None if args.hf else Path(args.checkpoint) if args.checkpoint else latest(run_dir)
    if not args.hf and (ckpt is None or not ckpt.is_dir()):
        raise C.ConfigError(f"no checkpoint {'at ' + str(ckpt) if ckpt else 'in ' + str(run_dir / 'checkpoints')}; "
                            "train first or pass --checkpoint DIR")
    extra = [d for d in args.domains.split(",") if d and d not in cfg.envs.domains]
    unknown = [d for d in extra if d not in ENVIRONMENTS.names()]
    if unknown:
        raise C.ConfigError(f"--domains: {unknown} not registered; known: {sorted(ENVIRONMENTS.names())}")
    return {"checkpoint": ckpt, "domains": [*cfg.envs.domains, *extra],
            "out": Path(args.out) if args.out else run_dir / "eval.json"}


def _launch(cfg: RunConfig, args: argparse.Namespace) -> int:
    from megatron_rl.commands.launch import run_ranks

    module = ["-m", "megatron_rl.commands.eval", *_argv(args), "--worker"]
    return run_ranks(module, cfg.launch.nproc_per_node)  # threads: $OMP_NUM_THREADS or 1 (launch.py: rank_threads)


def _argv(args: argparse.Namespace) -> list[str]:
    out = [args.config, *args.overrides]
    for flag in ("checkpoint", "hf", "domains", "out"):
        if getattr(args, flag):
            out += [f"--{flag}", str(getattr(args, flag))]
    return out


def _heldout(cfg: RunConfig, domain: str) -> list:
    from megatron_rl.envs.tasks import load_domain
    from megatron_rl.loop.job import task_lists

    if domain == cfg.data.domain and cfg.task_source() is not None:  # the run's generated held-out tasks
        return task_lists(cfg)["eval"]
    return load_domain(domain, cfg.envs.domains[domain].task_files or None if domain in cfg.envs.domains else None,
                       split="heldout", **cfg.envs.loader_options(domain))


def worker_main(cfg: RunConfig, checkpoint: Path | None, domains: list[str], out: Path) -> int:
    """One rank: policy from the checkpoint (None: model.init) -> engine -> held-out success per domain and task
    (rank 0 scores, writes)."""
    import torch
    from megatron.core import tensor_parallel

    from megatron_rl.distributed import destroy_distributed, init_distributed
    from megatron_rl.eval_report import write_report
    from megatron_rl.loop.evaluation import heldout_run
    from megatron_rl.loop.job import build_eval, close_engine, engine_weights, eval_fitting, rollouts_for
    from megatron_rl.prompts import prompt_ids

    ctx = init_distributed(cfg.parallel, cfg.launch.backend, timeout_minutes=cfg.launch.timeout_minutes)
    torch.manual_seed(cfg.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    run_dir = Path(cfg.output_dir) / cfg.name
    job = build_eval(cfg, run_dir, ctx, checkpoint)  # the policy's weights in the engine, rank 0's runner
    policy, engine, tok, runner, rank0 = job.policy, job.engine, job.tok, job.runner, job.is_rank0
    rollouts = rollouts_for(cfg, ctx, engine, runner, tok, lambda t: prompt_ids(tok, t), run_dir)
    rollouts.push_weights(policy.step_count, engine_weights(engine))  # to a separate rollout server, if any
    results, rows = {}, []
    try:
        for domain in domains:
            tasks = eval_fitting(_heldout(cfg, domain), tok, cfg, say=rank0)
            if tasks:
                metrics, task_rows = heldout_run(rollouts, tasks, cfg, tag=f"eval-{domain}")
                results[domain] = {**metrics, "k": cfg.eval.k}
                rows += task_rows
    finally:
        rollouts.close()
        close_engine(engine)
    if rank0:
        out.parent.mkdir(parents=True, exist_ok=True)
        report = write_report(out, rows, cfg.eval.k)
        out.write_text(json.dumps({"checkpoint": str(checkpoint) if checkpoint else None, "model_init": cfg.model.init,
                                   "trainer_step": policy.step_count, "domains": results, "report": report},
                                  indent=1) + "\n")
        runner.close()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
