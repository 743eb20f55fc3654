"""Run monitoring: per-step metrics to JSONL, TensorBoard (when installed), W&B (when configured) and a
Prometheus endpoint (when a port is configured), a progress bar for long loops, and alert rules that log
loudly and can stop the run.

    monitor = Monitor(MonitorConfig(), run_dir, active=(rank == 0))
    monitor.expect("rl", total=45)            # progress bar for kind "rl" (steps 0..44)
    monitor.log("rl", step, metrics)          # JSONL row {kind, step, time_s, ...}; scalars to TB / W&B / Prometheus
    alerts = monitor.check(step, metrics)     # [] or ["reward collapse: ..."]; monitor.should_stop after
"""
from __future__ import annotations

import json
import math
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from megatron_rl import http_auth, prometheus_text


@dataclass
class AlertConfig:
    """Alert rules evaluated after every step; a fired rule is printed to stderr and written to alerts.jsonl."""

    nan: bool = True
    """Alert when the loss, grad norm or a reward is NaN/inf."""
    sandbox_error_rate: float = 0.2
    """Alert when more than this fraction of the step's episodes had an invalid (infrastructure) reward."""
    reward_collapse_frac: float = 0.3
    """Alert when the step's mean reward falls below this fraction of the best 5-step mean so far (0 disables)."""
    reward_collapse_min_best: float = 0.2
    """The collapse rule applies only after the best 5-step mean reward exceeded this."""
    judge_unparsed_frac: float = 0.05
    """Alert when more than this fraction of the step's samples were masked because the LLM judge's answer did not
    end with exactly one 'Score: N' line (a judge that stopped following the format, or responses that make it
    quote scores: either way those samples are not trained on)."""
    stall_s: float = 300.0
    """Alert when episodes are pending but none finished for this many seconds (stalled workers)."""
    mismatch_kl: float | None = None
    """Alert when the train/rollout log-prob mismatch KL exceeds this (None: off); the RL loop sets it from
    rl.mismatch_alert_kl, so set that one in a run config."""
    stop_on: list[str] = field(default_factory=lambda: ["nan"])
    """Rules that stop the run (after a checkpoint): any of nan, sandbox_errors, judge_unparsed, reward_collapse,
    stall, mismatch."""


@dataclass
class MonitorConfig:
    """Where metrics go."""

    tensorboard: bool = True
    """Write TensorBoard event files to <run>/tb when the tensorboard package is installed."""
    wandb_project: str = ""
    """Log to this W&B project when set (needs the wandb package; never required)."""
    prometheus_port: int = -1
    """Serve the latest metrics at http://<host>:<port>/metrics (rank 0): -1 off, 0 any free port (written to
    <run>/prometheus_port). A scrape needs `Authorization: Bearer <token>`, the token in <run>/prometheus_token
    (mode 600; Prometheus: `authorization: {credentials_file: <run>/prometheus_token}`)."""
    prometheus_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds (0.0.0.0 to be scraped from other nodes)."""
    progress: bool = True
    """Show a progress bar for the RL steps on stderr (redrawn on a terminal, a line per 10% in logs)."""
    alerts: AlertConfig = field(default_factory=AlertConfig)
    """Alert rules."""
    domain_scalars_max: int = 16
    """With more domains than this, TensorBoard, W&B and Prometheus get the per-domain summary only (`domains/*`:
    mean, movers, no-gradient count), not every '<domain>/...' scalar; metrics.jsonl always has them all."""
    domain_summary: bool = True
    """Print a line per RL step and eval with the domains' summary (mean, top and bottom movers, the domains
    with no gradient) when the mixture has 2+ domains."""
    domain_movers: int = 3
    """Top and bottom movers shown in the summary (change of each domain's reward / held-out pass@1 since the
    previous row of the same kind)."""


class Monitor:
    """Metric sinks and alert rules of rank 0 (inactive on the other ranks)."""

    def __init__(self, cfg: MonitorConfig, run_dir: Path, active: bool = True):
        self.cfg, self.run_dir, self.active, self.t0 = cfg, Path(run_dir), active, time.time()
        self.tb = self.wandb = self.prometheus = None
        self.rewards: list[float] = []
        self.should_stop: str | None = None
        self.bars: dict[str, Progress] = {}
        self.domains: list[str] = []
        self._last: dict[str, dict[str, float]] = {}  # kind -> domain -> its summary metric in the previous row
        if active:
            self._open_sinks()

    def restart_clock(self) -> None:
        """Rows' time_s count from now (a phase's start)."""
        self.t0 = time.time()

    def expect(self, kind: str, total: int, start: int = 0) -> None:
        """Show a progress bar for `kind` rows: steps start..total-1."""
        if self.active and self.cfg.progress and total > 0:
            self.bars[kind] = Progress(kind, total, start)

    def _open_sinks(self) -> None:
        if self.cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tb"))
            except ImportError:
                print("[megatron-rl] tensorboard not installed: metrics go to metrics.jsonl only", flush=True)
        if self.cfg.wandb_project:
            import wandb  # optional; configured explicitly, so a missing package is an error

            self.wandb = wandb.init(project=self.cfg.wandb_project, name=self.run_dir.name, dir=str(self.run_dir))
        if self.cfg.prometheus_port >= 0:
            self.prometheus = PrometheusExporter(self.cfg.prometheus_host, self.cfg.prometheus_port)
            http_auth.write_token_file(self.run_dir / "prometheus_token", self.prometheus.token)
            (self.run_dir / "prometheus_port").write_text(f"{self.prometheus.port}\n")
            print(f"[megatron-rl] Prometheus metrics at http://{self.cfg.prometheus_host}:{self.prometheus.port}/metrics"
                  f" while the run lasts (Authorization: Bearer, token in {self.run_dir / 'prometheus_token'})",
                  flush=True)

    def set_domains(self, names) -> None:
        """The mixture's domains: their '<domain>/...' metrics are summarised (`domain_summary`)."""
        self.domains = sorted(names)

    def log(self, kind: str, step: int, metrics: dict) -> None:
        if not self.active:
            return
        summary = self._domain_summary(kind, step, metrics)
        rec = {"kind": kind, "step": step, "time_s": round(time.time() - self.t0, 3), **metrics, **summary}
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec, default=float) + "\n")
        hide = set(self.domains) if len(self.domains) > self.cfg.domain_scalars_max else set()
        scalars = {f"{kind}/{k}": float(v) for k, v in {**metrics, **summary}.items()
                   if _is_number(v) and k.rsplit("/", 1)[0] not in hide}  # (domain names may hold '/')
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if self.prometheus is not None:
            self.prometheus.update(kind, step, scalars)
        if kind in self.bars:
            shown = {k: metrics[k] for k in ("reward_mean", "loss") if _is_number(metrics.get(k))}
            self.bars[kind].update(step + 1, shown)

    def _domain_summary(self, kind: str, step: int, metrics: dict) -> dict:
        """`domains/*` summary metrics of an rl or eval row (and its console line); {} for other rows."""
        key = SUMMARY_KEYS.get(kind)
        if key is None or len(self.domains) < 2:
            return {}
        out, line = domain_summary(metrics, self.domains, key, self._last.get(kind, {}), self.cfg.domain_movers)
        self._last[kind] = {d: metrics[f"{d}/{key}"] for d in self.domains if _is_number(metrics.get(f"{d}/{key}"))}
        if self.cfg.domain_summary:
            print(f"[megatron-rl] domains {kind} step {step}: {line}", flush=True)
        return out

    def check(self, step: int, m: dict) -> list[str]:
        """Evaluate the alert rules on a step's metrics; sets `should_stop` when a stopping rule fires."""
        if not self.active:
            return []
        a, fired = self.cfg.alerts, []
        if a.nan and any(isinstance(m.get(k), float) and not math.isfinite(m[k])
                         for k in ("loss", "grad_norm", "reward_mean")):
            fired.append(("nan", f"non-finite loss/grad_norm/reward: loss={m.get('loss')} "
                                 f"grad_norm={m.get('grad_norm')} reward={m.get('reward_mean')}"))
        if m.get("sandbox_error_rate", 0.0) > a.sandbox_error_rate:
            fired.append(("sandbox_errors", f"sandbox error rate {m['sandbox_error_rate']:.2f} > "
                                            f"{a.sandbox_error_rate}"))
        if m.get("judge_unparsed_frac", 0.0) > a.judge_unparsed_frac:
            fired.append(("judge_unparsed", f"{m['judge_unparsed_frac']:.2f} of the step's samples masked: the "
                                            f"judge's answer had no parsable final 'Score: N' line (> "
                                            f"{a.judge_unparsed_frac})"))
        fired += self._collapse(m.get("reward_mean"))
        if m.get("episodes_stalled_s", 0.0) > a.stall_s:
            fired.append(("stall", f"no episode finished for {m['episodes_stalled_s']:.0f} s with work pending"))
        if a.mismatch_kl is not None and m.get("mismatch_kl", 0.0) > a.mismatch_kl:
            fired.append(("mismatch", f"train/rollout log-prob mismatch KL {m['mismatch_kl']:.4f} > {a.mismatch_kl}"))
        for rule, msg in fired:
            self._alert(step, rule, msg)
        return [msg for _, msg in fired]

    def _collapse(self, reward) -> list[tuple[str, str]]:
        a = self.cfg.alerts
        if reward is None or not a.reward_collapse_frac:
            return []
        self.rewards.append(float(reward))
        means = [sum(self.rewards[i:i + 5]) / 5 for i in range(len(self.rewards) - 4)]
        best = max(means, default=0.0)
        if best > a.reward_collapse_min_best and reward < a.reward_collapse_frac * best:
            return [("reward_collapse",
                     f"reward {reward:.3f} < {a.reward_collapse_frac} x best 5-step mean {best:.3f}")]
        return []

    def _alert(self, step: int, rule: str, msg: str) -> None:
        stop = rule in self.cfg.alerts.stop_on
        print(f"[megatron-rl] ALERT step {step}: {rule}: {msg}{' -- stopping the run' if stop else ''}",
              file=sys.stderr, flush=True)
        with open(self.run_dir / "alerts.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "rule": rule, "message": msg, "stop": stop}) + "\n")
        if self.prometheus is not None:
            self.prometheus.alert(rule)
        if stop and self.should_stop is None:
            self.should_stop = f"{rule}: {msg}"

    def close(self) -> None:
        """Close the sinks (idempotent: the RL phase and the rank's entry point may both close it)."""
        if self.prometheus is not None:
            self.prometheus.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.prometheus = self.tb = self.wandb = None


SUMMARY_KEYS = {"rl": "reward_mean", "eval": "pass@1"}
"""The per-domain metric a row kind is summarised by."""


def domain_summary(metrics: dict, domains: list[str], key: str, last: dict[str, float], movers: int = 3,
                   names: int = 12) -> tuple[dict, str]:
    """The summary over `domains` of a row's '<domain>/<key>' metrics: `domains/<key>_mean` (over the domains
    that have it), `domains/reported`, movers (change since `last`, the previous row's values), and the domains
    with no gradient (every group of theirs had equal rewards: '<domain>/no_gradient_frac' == 1), the range of
    the sampling weights ('<domain>/weight': `domains/weight_min`, `_max`). Returns the
    metrics (with the no-gradient names as `domains/no_gradient`) and a console line (at most `names` names)."""
    vals = {d: float(metrics[f"{d}/{key}"]) for d in domains if _is_number(metrics.get(f"{d}/{key}"))}
    delta = sorted(((vals[d] - last[d], d) for d in vals if d in last), key=lambda x: (-x[0], x[1]))
    up = [(v, d) for v, d in delta[:movers] if v > 0]
    down = [(v, d) for v, d in reversed(delta[-movers:]) if v < 0]
    flat = [d for d in domains if metrics.get(f"{d}/no_gradient_frac") == 1.0]
    out = {f"domains/{key}_mean": sum(vals.values()) / len(vals) if vals else None, "domains/reported": len(vals),
           "domains/no_gradient_count": len(flat), "domains/no_gradient": flat,
           "domains/top_movers": {d: v for v, d in up}, "domains/bottom_movers": {d: v for v, d in down}}
    weights = {d: float(metrics[f"{d}/weight"]) for d in domains if _is_number(metrics.get(f"{d}/weight"))}
    if weights:  # the sampler's (the curriculum's) probabilities of the next draws
        top = max(weights, key=lambda d: (weights[d], d))
        out.update({"domains/weight_min": min(weights.values()), "domains/weight_max": weights[top]})
    fmt = lambda xs: ", ".join(f"{d} {v:+.3f}" for v, d in xs) or "-"  # noqa: E731
    mean = "-" if out[f"domains/{key}_mean"] is None else f"{out[f'domains/{key}_mean']:.3f}"
    shown = ", ".join(flat[:names]) + (f" (+{len(flat) - names} more)" if len(flat) > names else "")
    line = (f"{len(vals)}/{len(domains)} domains with {key}, mean {mean}; up: {fmt(up)}; down: {fmt(down)}; "
            f"no gradient ({len(flat)}): {shown or '-'}")
    if weights:
        line += f"; weights {out['domains/weight_min']:.3f}..{out['domains/weight_max']:.3f} (max: {top})"
    return out, line


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class PrometheusExporter:
    """`GET /metrics` in Prometheus text format (`prometheus_text`): the latest value of every numeric metric of
    each kind as a gauge `megatron_rl_<kind>_<name>` (names sanitised), the kind's last step, and the counter
    `megatron_rl_alerts_total{rule}`. Every request needs `Authorization: Bearer <token>` (`token`: given, else
    random; the Monitor writes it to <run>/prometheus_token)."""

    def __init__(self, host: str, port: int, token: str | None = None):
        self.values: dict[tuple[str, str], float] = {}  # (metric name, alert rule or '') -> value
        self.lock = threading.Lock()
        self.token = token or secrets.token_urlsafe(24)
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                if not http_auth.authorised(self, exporter.token, TOKEN_SOURCE):
                    return
                if self.path.split("?")[0] != "/metrics":
                    return http_auth.reply_json(self, 404, http_auth.error_body(404, "only /metrics is served"))
                body = exporter.text().encode()
                self.send_response(200)
                self.send_header("Content-Type", prometheus_text.CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # no access log on stderr
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="prometheus", daemon=True)
        self.thread.start()

    def update(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        with self.lock:
            self.values[metric_name(kind, "step"), ""] = float(step)
            for k, v in scalars.items():  # k is "<kind>/<name>"
                self.values[metric_name(kind, k.split("/", 1)[1]), ""] = v

    def alert(self, rule: str) -> None:
        key = ("megatron_rl_alerts_total", rule)
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + 1

    def text(self) -> str:
        with self.lock:
            items = sorted(self.values.items())
        return prometheus_text.render(prometheus_text.Sample(name, v, {"rule": rule} if rule else {},
                                                             "counter" if rule else "gauge")
                                      for (name, rule), v in items)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


TOKEN_SOURCE = "the Monitor's token, in <run>/prometheus_token (mode 600)"
"""Where a scraper finds the Prometheus endpoint's token (named in a 401's message)."""


def metric_name(kind: str, name: str) -> str:
    """A valid Prometheus metric name for a metric of `kind` (anything outside [a-zA-Z0-9_] becomes _)."""
    return prometheus_text.metric_name(f"megatron_rl_{kind}_{name}".replace(":", "_"))


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal; in a log file, one line per 10% of the work."""

    def __init__(self, desc: str, total: int, start: int = 0, stream=None, width: int = 24):
        self.desc, self.total, self.start, self.width = desc, total, start, width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty() and os.environ.get("TERM") != "dumb"
        self.t0, self.last_decile, self.first = time.monotonic(), start * 10 // total, True

    def render(self, done: int, extra: dict | None = None) -> str:
        frac = done / self.total
        fill = int(frac * self.width)
        rate = (time.monotonic() - self.t0) / max(done - self.start, 1)
        eta = rate * (self.total - done)
        tail = "".join(f" {k} {v:.3g}" for k, v in (extra or {}).items())
        return (f"[{self.desc}] {done}/{self.total} [{'=' * fill}{' ' * (self.width - fill)}] {100 * frac:3.0f}% "
                f"{rate:.1f} s/step eta {int(eta) // 60}m{int(eta) % 60:02d}s{tail}")

    def update(self, done: int, extra: dict | None = None) -> None:
        if self.first:  # a resumed run starts past 0: rates count from the first step seen
            self.first, self.start = False, done - 1
            self.last_decile = self.start * 10 // self.total
        line = self.render(done, extra)
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= self.total else ""))
        elif done * 10 // self.total > self.last_decile or done >= self.total:
            self.last_decile = done * 10 // self.total
            self.stream.write(line + "\n")
        self.stream.flush()
