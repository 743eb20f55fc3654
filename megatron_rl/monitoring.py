"""Run monitoring: per-step metrics to JSONL, TensorBoard (when installed) and W&B (when configured), and alert
rules that log loudly and can stop the run.

    monitor = Monitor(MonitorConfig(), run_dir, active=(rank == 0))
    monitor.log("rl", step, metrics)          # JSONL row {kind, step, time_s, ...}; scalars to TB / W&B
    alerts = monitor.check(step, metrics)     # [] or ["reward collapse: ..."]; monitor.should_stop after
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


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
    stall_s: float = 300.0
    """Alert when episodes are pending but none finished for this many seconds (stalled workers)."""
    mismatch_kl: float = 0.05
    """Alert when the train/rollout log-prob mismatch KL exceeds this."""
    stop_on: list[str] = field(default_factory=lambda: ["nan"])
    """Rules that stop the run (after a checkpoint): any of nan, sandbox_errors, reward_collapse, stall, mismatch."""


@dataclass
class MonitorConfig:
    """Where metrics go."""

    tensorboard: bool = True
    """Write TensorBoard event files to <run>/tb when the tensorboard package is installed."""
    wandb_project: str = ""
    """Log to this W&B project when set (needs the wandb package; never required)."""
    alerts: AlertConfig = field(default_factory=AlertConfig)
    """Alert rules."""


class Monitor:
    """Metric sinks and alert rules of rank 0 (inactive on the other ranks)."""

    def __init__(self, cfg: MonitorConfig, run_dir: Path, active: bool = True):
        self.cfg, self.run_dir, self.active, self.t0 = cfg, Path(run_dir), active, time.time()
        self.tb = self.wandb = None
        self.rewards: list[float] = []
        self.should_stop: str | None = None
        if active:
            self._open_sinks()

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

    def log(self, kind: str, step: int, metrics: dict) -> None:
        if not self.active:
            return
        rec = {"kind": kind, "step": step, "time_s": round(time.time() - self.t0, 3), **metrics}
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec, default=float) + "\n")
        scalars = {f"{kind}/{k}": float(v) for k, v in metrics.items() if _is_number(v)}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

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
        fired += self._collapse(m.get("reward_mean"))
        if m.get("episodes_stalled_s", 0.0) > a.stall_s:
            fired.append(("stall", f"no episode finished for {m['episodes_stalled_s']:.0f} s with work pending"))
        if m.get("mismatch_kl", 0.0) > a.mismatch_kl:
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
        if stop and self.should_stop is None:
            self.should_stop = f"{rule}: {msg}"

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
