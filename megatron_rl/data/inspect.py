"""`megatron-rl inspect <shard|dir>`: what is in trajectory shards.

`summarize(path)` returns a JSON-able dict for one shard or every shard of a folder (not its quarantine);
`render(summary)` turns it into text. Statistics: std is the population std (ddof=0); reward components
count only the samples that reported them (NaN in the shard = absent). `bytes.raw` is the uncompressed size
of all numeric datasets (strings excluded), `bytes.compression_ratio` = raw / file size (> 1 = smaller).
Read-only: unreadable shards are listed under `errors`, never moved.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import h5py
import numpy as np

from megatron_rl.data.shards import SHARD_SUFFIXES, ShardReader


def _stats(values: np.ndarray) -> dict | None:
    values = values[~np.isnan(values)]
    if not len(values):
        return None
    return {"count": int(len(values)), "mean": float(values.mean()), "std": float(values.std()),
            "min": float(values.min()), "max": float(values.max())}


def _raw_bytes(f: h5py.File) -> int:
    total = 0

    def visit(_name, obj):
        nonlocal total
        if isinstance(obj, h5py.Dataset) and obj.dtype.kind != "O" and h5py.check_string_dtype(obj.dtype) is None:
            total += obj.size * obj.dtype.itemsize

    f.visititems(visit)
    return total


def _shard_facts(path: Path) -> dict:
    """Per-sample columns and sizes of one shard, without its token ids or log-probs."""
    with ShardReader(path) as r:
        f = r.h5
        facts = {k: f[k][()] for k in ("offsets", "reward", "policy_version_first", "policy_version_last")}
        facts.update({k: f[k].asstr()[()] if len(r) else np.zeros(0, object) for k in ("env", "status")})
        facts["model_tokens"] = int(np.count_nonzero(f["loss_mask"][()]))
        for group in ("reward_components", "timing"):
            facts[group] = {k: f[group][k][()] for k in f.get(group, {})}
        facts["attrs"] = r.attrs
        facts["has_token_versions"] = "token_versions" in f
        facts["raw_bytes"] = _raw_bytes(f)
    facts["file_bytes"] = path.stat().st_size
    return facts


def _shard_paths(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(SHARD_SUFFIXES))
    return [path]


def _concat(facts: list[dict], key: str, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(f[key], dtype) for f in facts]) if facts else np.zeros(0, dtype)


def _named_columns(facts: list[dict], group: str) -> dict[str, np.ndarray]:
    names = sorted({k for f in facts for k in f[group]})
    return {k: np.concatenate([f[group].get(k, np.full(len(f["reward"]), np.nan)) for f in facts])
            for k in names}


def _histogram(lengths: np.ndarray, bins: int) -> dict:
    if not len(lengths):
        return {"edges": [], "counts": []}
    counts, edges = np.histogram(lengths, bins=bins)
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def _aggregate(facts: list[dict], bins: int) -> dict:
    lengths = np.concatenate([np.diff(f["offsets"]) for f in facts]) if facts else np.zeros(0, np.int64)
    first, last = _concat(facts, "policy_version_first", np.int64), _concat(facts, "policy_version_last", np.int64)
    raw, size = sum(f["raw_bytes"] for f in facts), sum(f["file_bytes"] for f in facts)
    return {
        "num_samples": int(len(lengths)), "num_tokens": int(lengths.sum()),
        "num_model_tokens": sum(f["model_tokens"] for f in facts),
        "status_counts": dict(Counter(_concat(facts, "status", object).tolist())),
        "envs": dict(Counter(_concat(facts, "env", object).tolist())),
        "reward": _stats(_concat(facts, "reward", np.float64)),
        "reward_components": {k: _stats(v) for k, v in _named_columns(facts, "reward_components").items()},
        "timings": {k: _stats(v) for k, v in _named_columns(facts, "timing").items()},
        "length": {"min": int(lengths.min()) if len(lengths) else None,
                   "max": int(lengths.max()) if len(lengths) else None,
                   "mean": float(lengths.mean()) if len(lengths) else None, "histogram": _histogram(lengths, bins)},
        "policy_version": {"min": int(first.min()) if len(first) else None,
                           "max": int(last.max()) if len(last) else None,
                           "samples_per_version_first": {str(k): v for k, v in sorted(Counter(first.tolist()).items())},
                           "shards_with_token_versions": sum(f["has_token_versions"] for f in facts)},
        "bytes": {"raw": raw, "file": size, "compression_ratio": raw / size if size else None},
    }


def summarize(path: str | os.PathLike, bins: int = 10) -> dict:
    """Summary of one shard, or of all shards in a folder (unreadable ones listed under `errors`)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"inspect: {path} does not exist")
    facts, errors, names = [], {}, []
    for p in _shard_paths(path):
        try:
            facts.append(_shard_facts(p))
            names.append(p.name)
        except Exception as e:  # a bad shard is reported, not fatal
            errors[p.name] = f"{type(e).__name__}: {e}"
    attrs = [f["attrs"] for f in facts]
    return {"path": str(path), "kind": "directory" if path.is_dir() else "shard", "shards": names,
            "errors": errors, "schema_versions": sorted({a.get("schema_version") for a in attrs}),
            "compression": sorted({a.get("compression", "?") for a in attrs}),
            "created": [a.get("created") for a in attrs], **_aggregate(facts, bins)}


def _fmt_stats(s: dict | None, unit: str = "") -> str:
    if s is None:
        return "n/a"
    return (f"mean {s['mean']:.4g}{unit} std {s['std']:.4g}{unit} min {s['min']:.4g}{unit} "
            f"max {s['max']:.4g}{unit} (n={s['count']})")


def _fmt_counts(counts: dict) -> str:
    return "  ".join(f"{k} {v:,}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


def _render_histogram(hist: dict, width: int = 40) -> list[str]:
    counts, edges = hist["counts"], hist["edges"]
    top = max(counts, default=0) or 1
    return [f"  {edges[i]:>9.0f} - {edges[i + 1]:>9.0f} | {'#' * round(width * c / top):<{width}} {c:,}"
            for i, c in enumerate(counts)]


def render(s: dict) -> str:
    """Human-readable text of a `summarize` result."""
    b, pv, ln = s["bytes"], s["policy_version"], s["length"]
    ratio = f"{b['compression_ratio']:.2f}x" if b["compression_ratio"] else "n/a"
    lines = [
        f"{s['kind']} {s['path']}: {len(s['shards'])} shard(s), schema version(s) {s['schema_versions']},"
        f" compression {', '.join(s['compression']) or '-'}",
        f"samples  {s['num_samples']:,}   tokens {s['num_tokens']:,} (model {s['num_model_tokens']:,})",
        f"bytes    file {b['file'] / 1e6:.2f} MB, raw {b['raw'] / 1e6:.2f} MB, compression ratio {ratio}",
        f"status   {_fmt_counts(s['status_counts'])}",
        f"envs     {_fmt_counts(s['envs'])}",
        f"policy   versions {pv['min']}..{pv['max']}; samples per first version "
        f"{pv['samples_per_version_first'] or '-'}; shards with per-token versions {pv['shards_with_token_versions']}",
        f"reward   {_fmt_stats(s['reward'])}",
        *[f"  {k:<20} {_fmt_stats(v)}" for k, v in s["reward_components"].items()],
        "timings",
        *[f"  {k:<20} {_fmt_stats(v, 's')}" for k, v in s["timings"].items()],
        f"length   min {ln['min']} max {ln['max']} mean {ln['mean'] if ln['mean'] is None else round(ln['mean'], 1)}"
        " tokens/sample",
        *_render_histogram(ln["histogram"]),
    ]
    lines += [f"ERROR    {name}: {msg}" for name, msg in s["errors"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 = all shards readable, 1 = some shard unreadable, 2 = bad arguments / missing path."""
    parser = argparse.ArgumentParser(prog="megatron-rl inspect",
                                     description="Summarise a trajectory shard or a folder of shards.")
    parser.add_argument("path", help="a shard file (.h5) or a folder of shards")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument("--bins", type=int, default=10, help="length histogram bins (default 10)")
    args = parser.parse_args(argv)
    if args.bins < 1:
        parser.error("--bins must be >= 1")
    try:
        summary = summarize(args.path, bins=args.bins)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1) if args.json else render(summary))
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["summarize", "render", "main"]
