"""Rewards as named, weighted components of registered reward functions, and that registry (`REWARDS`).

The generic reward functions and helpers live in `envs.rewards`; a domain's own (the code domain's unit tests,
the terminal domain's verifier) live next to its verifier and are registered by its package.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.envs.sandbox.base import Sandbox
from megatron_rl.envs.types import EnvError, RewardOutput, RewardResult, Task
from megatron_rl.registry import Registry

log = logging.getLogger(__name__)


JUDGE_UNPARSED = "judge_unparsed"
"""Provenance key (count of judge answers without a parsable final score) and the weight-0 reward component
that marks such a masked sample (`RewardSpec.compute`), counted per step as `judge_unparsed[_frac]`."""

@dataclass
class RewardComponent:
    """One named reward component: a registered reward function, its weight and parameters."""

    name: str
    """Component name (a column in the trajectory shard)."""
    fn: str
    """Name of the reward function in `REWARDS`."""
    weight: float = 1.0
    """Weight in the total."""
    params: dict = field(default_factory=dict)
    """Keyword arguments passed to the reward function."""


@dataclass
class RewardContext:
    """Everything a reward function may look at."""

    task: Task
    """The task of the episode (its payload holds the hidden answers/tests)."""
    response: str
    """The model's final action text."""
    transcript: list[tuple[str, str]] = field(default_factory=list)
    """(role, text) of the whole episode: ('assistant', ...), ('tool', ...)."""
    state: dict = field(default_factory=dict)
    """Environment-specific state (workspace files, extracted answer)."""
    sandbox: Sandbox | None = None
    """Where verifiers run model code (never in the worker)."""
    judge: Any = None
    """An `envs.rewards.JudgeClient`, or None."""


@dataclass
class RewardSpec:
    """A weighted composition of reward components."""

    components: list[RewardComponent]
    """The named components; the total is their weighted sum."""

    def __post_init__(self):
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise EnvError(f"duplicate reward component names in {names}")

    def with_weights(self, weights: dict[str, float] | None) -> RewardSpec:
        """A copy with some weights replaced; unknown names are an error listing the known ones."""
        weights = dict(weights or {})
        known = {c.name for c in self.components}
        unknown = sorted(set(weights) - known)
        if unknown:
            raise EnvError(f"unknown reward component(s) {unknown}; known: {sorted(known)}")
        return RewardSpec([dataclasses.replace(c, weight=float(weights.get(c.name, c.weight)))
                           for c in self.components])

    def compute(self, ctx: RewardContext) -> RewardResult:
        out = RewardResult(total=0.0)
        for comp in self.components:
            r = run_reward(REWARDS.get(comp.fn), ctx, comp.params)
            r.provenance.setdefault("fn", comp.fn)
            out.components[comp.name] = float(r.score)
            out.weights[comp.name] = comp.weight
            out.reasons[comp.name] = r.reason
            out.provenance[comp.name] = r.provenance
            if r.provenance.get(JUDGE_UNPARSED):  # a marker (weight 0) that reaches the step metrics, even from shards
                out.components[JUDGE_UNPARSED], out.weights[JUDGE_UNPARSED] = 1.0, 0.0
            if out.status == "ok" and r.status != "ok":
                out.status = r.status
            out.total += comp.weight * float(r.score)
        return out


RewardFn = Callable[..., RewardOutput]
REWARDS: Registry[RewardFn] = Registry("reward function", entry_point_group="megatron_rl.rewards")


def reward(name: str, version: str = "1"):
    """Register a reward function under `name`, stamping `version` into its provenance."""

    def deco(fn: RewardFn) -> RewardFn:
        fn.reward_name, fn.reward_version = name, version
        return REWARDS.register(name, fn)

    return deco


def run_reward(fn: RewardFn, ctx: RewardContext, params: dict) -> RewardOutput:
    """Call a reward function; an exception (a bug) becomes an invalid zero with the reason, logged."""
    try:
        out = fn(ctx, **params)
    except Exception as e:
        log.exception("reward function %s failed on task %s", getattr(fn, "reward_name", fn), ctx.task.id)
        out = RewardOutput(0.0, f"reward function error: {e.__class__.__name__}: {e}", status="error")
    out.provenance.setdefault("version", getattr(fn, "reward_version", "?"))
    if not math.isfinite(out.score):
        out.score, out.reason = 0.0, f"non-finite score ({out.reason})"
    return out
