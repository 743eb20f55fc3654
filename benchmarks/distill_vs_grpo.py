"""On-policy distillation vs plain GRPO from the same start, on the main job's task: held-out success against RL
steps and CPU-seconds.

    megatron-rl train configs/post_train_cpu.yaml           # the teacher: runs/post_train/export/hf-step-12
    python benchmarks/distill_vs_grpo.py --teacher runs/post_train/export/hf-step-12 [--steps 12] [--eval-every 4]
        [--out-dir runs/distill_bench] [--set key=value ...] [--report-only]

Runs `megatron-rl train configs/distill_cpu.yaml` (the base SmolLM2 distilled from the teacher) and
`configs/post_train_cpu.yaml` (GRPO on the task rewards), both from model.init's base checkpoint with the same
seed, steps, sampling, optimizer and held-out tasks, evaluated every --eval-every steps (no export), then reads
their metrics.jsonl: per evaluation, the RL steps done, the training CPU-seconds summed over those steps (the
rank's user + system CPU of each step, `cpu_step_s`: generation, rewards, the teacher's pass and the update; the
evaluations themselves are not counted) and the held-out pass@1 and greedy success. The teacher's own held-out
success is taken from its run's summary.json (`<teacher>/../../summary.json`, heldout_after) or --teacher-success;
for each method the first evaluation at or above it is reported (steps and CPU-seconds to reach the teacher).
Prints one JSON object. CPU-seconds are comparable between the two runs of one invocation on one machine; on a
loaded machine wall time is not.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {"distill": "configs/distill_cpu.yaml", "grpo": "configs/post_train_cpu.yaml"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True, help="the teacher's HF folder (the main job's export)")
    p.add_argument("--steps", type=int, default=12, help="RL steps of each run")
    p.add_argument("--eval-every", type=int, default=4, help="held-out evaluation every this many steps")
    p.add_argument("--out-dir", default="runs/distill_bench", help="output_dir of both runs")
    p.add_argument("--teacher-success", type=float, default=None, help="the teacher's held-out pass@1 (default: "
                   "its run's summary.json)")
    p.add_argument("--set", nargs="*", default=[], help="run-config overrides for both runs")
    p.add_argument("--report-only", action="store_true", help="read existing runs, do not train")
    p.add_argument("--methods", default="distill,grpo", help="which runs to train (the others are read): the GRPO "
                   "run of the main job's config with export on is also the teacher, so `megatron-rl train "
                   "configs/post_train_cpu.yaml name=grpo output_dir=OUT eval.every=4` then --methods distill "
                   "--teacher OUT/grpo/export/hf-step-12 trains the main job once instead of twice")
    return p.parse_args(argv)


def train(method: str, args) -> None:
    exe = str(Path(sys.executable).parent / "megatron-rl")
    cmd = [exe, "train", RUNS[method], f"name={method}", f"output_dir={args.out_dir}", f"rl.steps={args.steps}",
           f"eval.every={args.eval_every}", "export.enabled=false", *args.set]
    if method == "distill":
        cmd.append(f"distill.teacher=hf:{Path(args.teacher).resolve()}")
    subprocess.run(cmd, cwd=REPO, check=True)


def curve(run_dir: Path) -> list[dict]:
    """Per evaluation: steps done, training CPU-seconds and wall seconds over those steps, held-out success."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = {r["step"]: r for r in rows if r["kind"] == "rl"}
    out = []
    for e in (r for r in rows if r["kind"] == "eval"):
        done = [rl[s] for s in sorted(rl) if s < e["step"]]
        out.append({"steps": e["step"], "cpu_s": round(sum(r.get("cpu_step_s", 0.0) for r in done), 1),
                    "wall_s": round(sum(r["time_step_s"] for r in done), 1), "pass@1": e["pass@1"],
                    "success_greedy": e["success_greedy"],
                    "teacher_kl": done[-1].get("teacher_kl") if done else None})
    return out


def teacher_success(args) -> float | None:
    if args.teacher_success is not None:
        return args.teacher_success
    summary = Path(args.teacher).resolve().parents[1] / "summary.json"
    if summary.is_file():
        after = json.loads(summary.read_text()).get("heldout_after") or {}
        return after.get("pass@1")
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.report_only:
        for method in args.methods.split(","):
            if method not in RUNS:
                raise SystemExit(f"--methods: unknown method {method!r}; choose from {', '.join(RUNS)}")
            train(method, args)
    target = teacher_success(args)
    out = {"teacher": str(args.teacher), "teacher_pass@1": target, "steps": args.steps}
    for method in RUNS:
        pts = curve(REPO / args.out_dir / method)
        reach = next((p for p in pts if target is not None and p["pass@1"] >= target), None)
        out[method] = {"curve": pts, "reached_teacher": reach}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
