"""Uniform domain weights vs the online curriculum across domains (envs.curriculum), same seed, same budget.

    python benchmarks/curriculum_vs_uniform.py real [--config configs/mixture_cpu.yaml] [--steps 20]
        [--set key=value ...] [--out DIR] [--parallel] [--dry-run]
    python benchmarks/curriculum_vs_uniform.py simulate [--domains 120] [--groups 3000] [--seed 0]

`real`: two runs of `megatron-rl train CONFIG` that differ only in envs.curriculum.enabled (false, true): the
same seed, steps, prompts per step and group size, so the same number of rollouts (the budget; each run's CPU
seconds from its summary.json are printed beside it to show the budgets match). Printed side by side, one JSON
object: held-out mean pass@1 over domains before -> after, domains improved / worse, domains with no gradient
over the run, the fraction of groups with a gradient (mixed rewards) over the run, the run's CPU seconds.
With many domains use the many-domains config (configs/many_domains_cpu.yaml, when present) for CONFIG; the
run is tens of minutes per side on 2 cores. Each side's output goes to <out>/<side>.log; `--parallel` runs the two
at once (on a shared machine both then see the same load; it needs the memory of both: a side of
configs/many_domains_cpu.yaml holds 4-6 GB through its steps and peaks at 9.9 GB for seconds in its last
checkpoint save; with --steps 3 and launch.threads_per_rank=1 the two sides ran at once beside the test suite on
23 GB, 2646 and 2792 CPU-s, docs/task_libraries.md), otherwise one after the other. `--dry-run` prints the
two commands only.

`simulate`: no model: a scripted policy over N synthetic domains (most out of reach, some solved, some
learnable: a success probability that rises with every group that had mixed rewards) sampled by
`envs.sampler.DomainSampler` with uniform weights and with the curriculum, the same number of groups and the
same seed; prints the fraction of groups with a gradient and the mean success over domains at the end.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------------ real runs
def _commands(args) -> dict[str, list[str]]:
    exe = str(Path(sys.executable).parent / "megatron-rl")
    out = {}
    for name, on in (("uniform", "false"), ("curriculum", "true")):
        out[name] = [exe, "train", args.config, f"output_dir={Path(args.out) / name}", f"rl.steps={args.steps}",
                     f"envs.curriculum.enabled={on}", "eval.every=0", *args.set]
    return out


def _side(run: Path) -> dict:
    from megatron_rl.commands.report import read_metrics
    from megatron_rl.eval_report import domain_table

    rows = read_metrics(run)
    rl = [r for r in rows if r["kind"] == "rl"]
    evals = [r for r in rows if r["kind"] == "eval"]
    k = int(next((key[5:] for key in evals[-1] if key.startswith("pass@") and key != "pass@1"), "1"))
    t = domain_table(evals, k, rl)
    groups = sum(v for r in rl for key, v in r.items() if key.endswith("/groups") and isinstance(v, (int, float)))
    flat = sum(v * (r.get(key[:-len("groups")] + "no_gradient_frac") or 0.0) for r in rl for key, v in r.items()
               if key.endswith("/groups") and isinstance(v, (int, float)))
    summary = json.loads((run / "summary.json").read_text())
    return {"pass@1_mean_before": t["pass@1_mean_before"], "pass@1_mean_after": t["pass@1_mean_after"],
            "domains": len(t["domains"]), "improved": t["improved"], "worse": t["worse"],
            "no_gradient_domains": len(t["no_gradient"]), "groups": groups,
            "groups_with_gradient_frac": 1.0 - flat / groups if groups else None, "cpu_s": summary["cpu_s"],
            "wall_s": summary["wall_s"]}


def launch(cmds: dict[str, list[str]], out: Path, parallel: bool) -> None:
    """Run each side's command (from the repository root), its output to <out>/<side>.log; one after the other,
    or (`parallel`) all at once, so that both sides see the same machine load and finish together. A side that
    fails stops the benchmark with its name, exit status and the tail of its log."""
    out.mkdir(parents=True, exist_ok=True)
    logs = {name: out / f"{name}.log" for name in cmds}

    def start(name: str) -> subprocess.Popen:
        with open(logs[name], "w") as f:
            return subprocess.Popen(cmds[name], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)

    procs = {name: start(name) for name in cmds} if parallel else {}
    for name in cmds:
        rc = (procs[name] if parallel else start(name)).wait()
        if rc != 0:
            for p in procs.values():  # SIGTERM: a run stops its ranks
                p.terminate()
                p.wait()
            raise SystemExit(f"{name} run failed ({rc}); {logs[name]}:\n{logs[name].read_text()[-3000:]}")


def real(args) -> dict:
    cmds = _commands(args)
    if args.dry_run:
        return {name: " ".join(c) for name, c in cmds.items()}
    launch(cmds, Path(args.out), args.parallel)
    out = {}
    for name in cmds:
        runs = [p.parent for p in (Path(args.out) / name).glob("*/summary.json")]
        out[name] = _side(runs[0])
    return out


# ------------------------------------------------------------------------------------------ simulation
def simulate(args) -> dict:
    from megatron_rl.envs.base import Task
    from megatron_rl.envs.curriculum import DomainCurriculumConfig
    from megatron_rl.envs.sampler import DomainSampler

    rng = random.Random(args.seed)
    n = args.domains
    start = {f"d{i:03d}": (0.0 if i < 0.7 * n else 1.0 if i < 0.8 * n else rng.uniform(0.05, 0.6))
             for i in range(n)}  # 70% out of reach, 10% solved, 20% learnable
    tasks = {d: [Task(f"{d}-{j}", d, "p") for j in range(8)] for d in start}
    out = {}
    for name, cur in (("uniform", None), ("curriculum", DomainCurriculumConfig(enabled=True))):
        p, s = dict(start), DomainSampler(tasks, None, seed=args.seed, curriculum=cur)
        draw, mixed = random.Random(args.seed + 1), 0
        for _ in range(args.groups):
            t = s.next()
            rewards = [float(draw.random() < p[t.domain]) for _ in range(args.group_size)]
            s.record_group(t, rewards)
            if max(rewards) != min(rewards):
                mixed += 1
                p[t.domain] = min(1.0, p[t.domain] + args.lr)  # a group with a gradient teaches a little
        out[name] = {"groups_with_gradient_frac": mixed / args.groups,
                     "success_mean_before": sum(start.values()) / n, "success_mean_after": sum(p.values()) / n}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("real", help="two real runs, uniform and curriculum")
    r.add_argument("--config", default="configs/mixture_cpu.yaml")
    r.add_argument("--steps", type=int, default=20)
    r.add_argument("--out", default="runs/curriculum_vs_uniform")
    r.add_argument("--set", nargs="*", default=[], help="extra run-config overrides, the same for both runs")
    r.add_argument("--parallel", action="store_true",
                   help="run the two sides at once (the same machine load on both, twice the memory; "
                        "each its <out>/<side>.log)")
    r.add_argument("--dry-run", action="store_true")
    s = sub.add_parser("simulate", help="a scripted policy over synthetic domains, no model")
    s.add_argument("--domains", type=int, default=120)
    s.add_argument("--groups", type=int, default=3000)
    s.add_argument("--group-size", type=int, default=4)
    s.add_argument("--lr", type=float, default=0.01, help="success gained per group with a gradient")
    s.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(real(args) if args.mode == "real" else simulate(args), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
