"""`megatron-rl report <run dir>`: plots of a run's metrics.jsonl (reward, success, lengths, time split) as PNG,
and with per-domain held-out results a per-domain before/after table (<run>/domains.md, <run>/domains.json) and
a heat map of held-out pass@1 per domain over the steps (<run>/plots/domains_heldout.png)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of <run>/metrics.jsonl as the run now stands. The file is append-only: a resumed run logs again
    the steps after its checkpoint, so the last row of each (kind, step) wins (in the order first seen)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: pass a run directory written by `megatron-rl train`")
    rows: dict[tuple, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r.get("kind"), r.get("step"))] = r
    return list(rows.values())



def _plot(ax, rows: list[dict], keys: list[str], title: str) -> None:
    drawn = False
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
        if pts:
            ax.plot(*zip(*pts), marker=".", label=k)
            drawn = True
    ax.set_title(title)
    ax.set_xlabel("step")
    if drawn:  # (an empty legend makes matplotlib warn at the end of a run)
        ax.legend(fontsize=7)


def _has_data(rows: list[dict], keys: list[str]) -> bool:
    return any(isinstance(r.get(k), (int, float)) for r in rows for k in keys)


def make_report(run_dir: str | Path) -> list[Path]:
    """Write <run>/plots/{rewards,lengths,time}.png, each figure only when one of its panels has data (a warm-up-only
    run has no RL or eval rows: nothing to draw, and matplotlib is not even imported); returns the paths written."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    rl, ev = [r for r in rows if r["kind"] == "rl"], [r for r in rows if r["kind"] == "eval"]
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    pass_k = sorted({k for r in ev for k in r if k.startswith("pass@")})
    figures = {"rewards": [(rl, ["reward_mean", *sorted({k for r in rl for k in r if k.endswith("/correct_mean")})],
                            "rollout reward / success"), (ev, ["success_greedy", *pass_k], "held-out success")],
               "lengths": [(rl, ["response_len_mean", "response_len_max"], "response tokens"),
                           (rl, ["mismatch_kl", "entropy_mean", "clip_fraction"], "KL / entropy / clip")],
               "time": [(rl, ["time_generate_s", "time_env_wait_s", "time_train_s", "time_sync_s", "time_step_s"],
                         "seconds per step"), (rl, ["trainer_idle_frac", "policy_lag_mean"], "idle / lag")]}
    paths = []
    for name, panels in figures.items():
        if not any(_has_data(data, keys) for data, keys, _ in panels):
            continue
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5))
        for ax, (data, keys, title) in zip(axes, panels):
            _plot(ax, data, keys, title)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=90)
        plt.close(fig)
        paths.append(out / f"{name}.png")
    return paths + domain_report(run_dir, rl, ev)


def domain_report(run_dir: Path, rl: list[dict], ev: list[dict]) -> list[Path]:
    """<run>/domains.json and domains.md (per-domain held-out success before/after) and
    <run>/plots/domains_heldout.png (the heat map); [] when no eval row has per-domain results."""
    from megatron_rl.eval_report import domain_heatmap, domain_markdown, domain_table, eval_domains

    if not ev or not eval_domains(ev[-1]):
        return []
    ks = sorted(int(key[5:]) for key in ev[-1] if key.startswith("pass@") and key[5:].isdigit() and key != "pass@1")
    k = ks[0] if ks else 1
    table = domain_table(ev, k, rl)
    (run_dir / "domains.json").write_text(json.dumps(table, indent=1) + "\n")
    (run_dir / "domains.md").write_text(domain_markdown(table, k))
    shown = domain_heatmap(ev, run_dir / "plots" / "domains_heldout.png")
    if not shown.endswith(".png"):
        print(f"megatron-rl report: {shown}", file=sys.stderr)
    return [run_dir / "domains.json", run_dir / "domains.md", *([Path(shown)] if shown.endswith(".png") else [])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-rl report", description=__doc__.split(": ", 1)[1])
    p.add_argument("run", help="run directory (output_dir/name), holding metrics.jsonl")
    args = p.parse_args(argv)
    try:
        paths = make_report(args.run)
    except FileNotFoundError as e:
        print(f"megatron-rl report: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
