"""The one Prometheus text renderer (exposition format 0.0.4): the rollout server's /metrics and the Monitor's.

    render([Sample("rollout_queue_length", 3), Sample("megatron_rl_alerts_total", 2.0, {"rule": "nan"})])
    # TYPE rollout_queue_length gauge
    rollout_queue_length 3
    # TYPE megatron_rl_alerts_total counter
    megatron_rl_alerts_total{rule="nan"} 2.0

Rules: a metric name keeps [a-zA-Z0-9_:] (anything else becomes _; a leading digit gets a _ before it); a
family is a counter when its name ends in `_total`, else a gauge, unless the sample says (`kind`); one TYPE
line per family, before all its samples (samples of a family are grouped, in first-seen order); label values
escape backslash, double quote and newline; ints print as ints, floats as Python's repr, NaN and infinities
as NaN, +Inf, -Inf. Standard library only.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Content-Type of a /metrics reply."""
KINDS = ("counter", "gauge")


@dataclass(frozen=True)
class Sample:
    """One line of the exposition."""

    name: str
    """Metric name (sanitised when rendered)."""
    value: float
    """Its value (int or float; bool counts as int)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Label name -> value (values escaped when rendered)."""
    kind: str | None = None
    """'counter' or 'gauge'; None: a counter when the name ends in _total, else a gauge."""


def metric_name(name: str) -> str:
    """`name` as a valid Prometheus metric name."""
    name = re.sub(r"[^a-zA-Z0-9_:]", "_", name)
    return f"_{name}" if name[:1].isdigit() or not name else name


def render(samples) -> str:
    """The exposition text of `samples`; ValueError names a family typed two ways or an unknown kind."""
    families: dict[str, list[str]] = {}
    kinds: dict[str, str] = {}
    for s in samples:
        name = metric_name(s.name)
        kind = s.kind or ("counter" if name.endswith("_total") else "gauge")
        if kind not in KINDS:
            raise ValueError(f"metric {name}: kind {kind!r} is not one of {KINDS}")
        if kinds.setdefault(name, kind) != kind:
            raise ValueError(f"metric {name} is both a {kinds[name]} and a {kind}")
        families.setdefault(name, []).append(f"{name}{_labels(s.labels)} {_value(s.value)}")
    return "".join(f"# TYPE {n} {kinds[n]}\n" + "".join(f"{line}\n" for line in lines)
                   for n, lines in families.items())


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{re.sub(r"[^a-zA-Z0-9_]", "_", k)}="{_escape(str(v))}"'
                          for k, v in labels.items()) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _value(v) -> str:
    if isinstance(v, (bool, int)):
        return str(int(v))
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)
