"""Per-task eval results: pass@1 and pass@k per task and per domain, as a printed table, JSON, markdown and a plot.

A row per task: `greedy` (the greedy episode solved it: 1/0, None when it was an infrastructure failure),
`samples` (valid sampled episodes; infra failures are left out, never scored), `solved` (of those),
`pass@1` = solved / samples, `pass@k` = the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021) with
n = samples, c = solved; when fewer than k samples are valid it is 1 if any solved (marked `k_short`).
Summaries average over the tasks that have a valid sample, per domain and over all tasks.
"""
from __future__ import annotations

import json
from math import comb
from pathlib import Path


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (1.0 if any correct when n < k)."""
    if n == 0:
        return 0.0
    if n < k:
        return float(c > 0)
    return 1.0 - comb(n - c, k) / comb(n, k)


def task_rows(tasks: list, greedy: list[list[int]], sampled: list[list[int]], turns: list[list[int]], k: int
              ) -> list[dict]:
    """One row per task from per-task 0/1 lists of its valid greedy and sampled episodes."""
    rows = []
    for t, g, s, tu in zip(tasks, greedy, sampled, turns):
        n, c = len(s), sum(s)
        rows.append({"task": t.id, "domain": t.domain, "greedy": g[0] if g else None, "samples": n, "solved": c,
                     "pass@1": c / n if n else 0.0, f"pass@{k}": pass_at_k(n, c, k), "k_short": n < k,
                     "turns_mean": sum(tu) / len(tu) if tu else 0.0})
    return rows


def _mean(xs: list) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarise(rows: list[dict], k: int) -> dict[str, dict]:
    """Per domain and 'all': tasks, tasks with a valid sample, mean greedy, pass@1 and pass@k."""
    out = {}
    for name in sorted({r["domain"] for r in rows}) + ["all"]:
        rs = [r for r in rows if name == "all" or r["domain"] == name]
        valid = [r for r in rs if r["samples"]]
        greedy = [r["greedy"] for r in rs if r["greedy"] is not None]
        out[name] = {"tasks": len(rs), "scored_tasks": len(valid), "greedy": _mean(greedy),
                     "pass@1": _mean([r["pass@1"] for r in valid]), f"pass@{k}": _mean([r[f"pass@{k}"] for r in valid])}
    return out


def markdown(rows: list[dict], k: int) -> str:
    """A markdown table: one line per task, then one per domain and overall."""
    head = f"| task | domain | greedy | samples | solved | pass@1 | pass@{k} |\n|---|---|---|---|---|---|---|\n"
    body = "".join(f"| {r['task']} | {r['domain']} | {'-' if r['greedy'] is None else r['greedy']} | {r['samples']} "
                   f"| {r['solved']} | {r['pass@1']:.3f} | {r[f'pass@{k}']:.3f}{'*' if r['k_short'] else ''} |\n"
                   for r in rows)
    tail = "".join(f"| **{name}** ({s['scored_tasks']}/{s['tasks']} scored) | | {s['greedy']:.3f} | | | "
                   f"{s['pass@1']:.3f} | {s[f'pass@{k}']:.3f} |\n" for name, s in summarise(rows, k).items())
    short = any(r["k_short"] for r in rows)
    note = f"\n\\* fewer than {k} valid samples: pass@{k} is 1 if any solved.\n" if short else ""
    return head + body + tail + note


def plot(rows: list[dict], k: int, path: Path) -> str:
    """A bar chart of pass@1 and pass@k per task; returns the path, or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(rows) + 2), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["pass@1"] for r in rows], 0.4, label="pass@1")
    ax.bar([x + 0.2 for x in xs], [r[f"pass@{k}"] for r in rows], 0.4, label=f"pass@{k}")
    ax.set_xticks(list(xs), [r["task"] for r in rows], rotation=70, ha="right", fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("success")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def write_report(out_json: Path, rows: list[dict], k: int, with_plot: bool = True) -> dict[str, str]:
    """Write <stem>_tasks.json, <stem>_tasks.md and (`with_plot`) <stem>_tasks.png next to `out_json`; returns what
    was written."""
    base = out_json.with_name(out_json.stem + "_tasks")
    js, md = base.with_suffix(".json"), base.with_suffix(".md")
    js.write_text(json.dumps({"k": k, "tasks": rows, "summary": summarise(rows, k)}, indent=1) + "\n")
    md.write_text(markdown(rows, k))
    shown = plot(rows, k, base.with_suffix(".png")) if with_plot else "no plot: not asked for"
    return {"json": str(js), "markdown": str(md), "plot": shown}
