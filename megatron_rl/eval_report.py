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


# ------------------------------------------------------------------------------------ per-domain, over a run
def eval_domains(row: dict) -> list[str]:
    """The domains of an eval row (metrics.jsonl): those with a '<domain>/pass@1' (names may hold '/')."""
    return sorted({key.rsplit("/", 1)[0] for key in row if key.endswith("/pass@1")})


def no_gradient_domains(rl_rows: list[dict]) -> list[str]:
    """Domains every one of whose groups over the run had equal rewards (no gradient), from the rl rows'
    '<domain>/groups' and '<domain>/no_gradient_frac'."""
    groups: dict[str, float] = {}
    flat: dict[str, float] = {}
    for r in rl_rows:
        for key, n in r.items():
            if key.endswith("/groups") and isinstance(n, (int, float)):
                d = key.rsplit("/", 1)[0]
                groups[d] = groups.get(d, 0.0) + n
                flat[d] = flat.get(d, 0.0) + n * float(r.get(f"{d}/no_gradient_frac") or 0.0)
    return sorted(d for d, n in groups.items() if n > 0 and flat[d] >= n - 1e-9)


def domain_table(evals: list[dict], k: int, rl_rows: list[dict] | None = None) -> dict:
    """Held-out success per domain before (the first eval row) and after (the last): one row per domain with its
    task count, pass@1, greedy and pass@k before/after and the change of pass@1, plus counts (improved, worse,
    unchanged, no gradient over the run) and the means over domains. {} without an eval row."""
    if not evals:
        return {}
    first, last = evals[0], evals[-1]
    rows, flat = [], set(no_gradient_domains(rl_rows or []))
    for d in eval_domains(last) or eval_domains(first):
        row = {"domain": d, "tasks": last.get(f"{d}/tasks", first.get(f"{d}/tasks")), "no_gradient": d in flat}
        for m in ("pass@1", "success_greedy", f"pass@{k}"):
            row[f"{m}_before"], row[f"{m}_after"] = first.get(f"{d}/{m}"), last.get(f"{d}/{m}")
        b, a = row["pass@1_before"], row["pass@1_after"]
        row["pass@1_change"] = a - b if a is not None and b is not None else None
        rows.append(row)
    changes = [r["pass@1_change"] for r in rows if r["pass@1_change"] is not None]
    mean = lambda key: _mean([r[key] for r in rows if r[key] is not None])  # noqa: E731
    return {"steps": [first["step"], last["step"]], "domains": rows, "improved": sum(c > 0 for c in changes),
            "worse": sum(c < 0 for c in changes), "unchanged": sum(c == 0 for c in changes),
            "no_gradient": sorted(flat), "pass@1_mean_before": mean("pass@1_before"),
            "pass@1_mean_after": mean("pass@1_after")}


def domain_markdown(table: dict, k: int) -> str:
    """The per-domain before/after table as markdown (sorted by the change of pass@1, largest first)."""
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    sign = lambda v: "-" if v is None else f"{v:+.3f}"  # noqa: E731
    head = (f"Held-out success per domain, step {table['steps'][0]} -> {table['steps'][1]}: mean pass@1 "
            f"{f(table['pass@1_mean_before'])} -> {f(table['pass@1_mean_after'])}; {table['improved']} improved, "
            f"{table['worse']} worse, {table['unchanged']} unchanged; {len(table['no_gradient'])} with no gradient "
            f"over the run.\n\n| domain | tasks | pass@1 before | pass@1 after | change | greedy before | greedy after "
            f"| pass@{k} before | pass@{k} after | no gradient |\n|---|---|---|---|---|---|---|---|---|---|\n")
    order = sorted(table["domains"], key=lambda r: (-(r["pass@1_change"] or 0.0), r["domain"]))
    body = "".join(f"| {r['domain']} | {r['tasks']} | {f(r['pass@1_before'])} | {f(r['pass@1_after'])} | "
                   f"{sign(r['pass@1_change'])} | "
                   f"{f(r['success_greedy_before'])} | {f(r['success_greedy_after'])} | {f(r[f'pass@{k}_before'])} | "
                   f"{f(r[f'pass@{k}_after'])} | {'yes' if r['no_gradient'] else ''} |\n" for r in order)
    return head + body


def domain_heatmap(evals: list[dict], path: Path, metric: str = "pass@1") -> str:
    """A heat map of held-out `metric` per domain (rows, sorted by the last eval) over the eval steps (columns);
    returns the path, or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no heat map: matplotlib is not installed"
    domains = eval_domains(evals[-1]) if evals else []
    if not domains:
        return "no heat map: no eval row with per-domain results"
    last = evals[-1]
    domains.sort(key=lambda d: (-(last.get(f"{d}/{metric}") or 0.0), d))
    grid = [[float("nan") if r.get(f"{d}/{metric}") is None else float(r[f"{d}/{metric}"]) for r in evals]
            for d in domains]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(evals) + 3), max(3.0, 0.14 * len(domains) + 1.5)))
    im = ax.imshow(grid, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
    ax.set_xticks(range(len(evals)), [str(r["step"]) for r in evals], fontsize=7)
    ax.set_yticks(range(len(domains)), domains, fontsize=8 if len(domains) <= 40 else 5.5)  # 0.14 in a row
    ax.set_xlabel("RL step")
    ax.set_title(f"held-out {metric} per domain ({len(domains)} domains)")
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
