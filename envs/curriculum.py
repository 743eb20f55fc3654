"""An online curriculum across the mixture's domains (the run config's `envs.curriculum`). Pure bookkeeping: no
I/O, no clock, no randomness (the sampler draws; this only says with which weights).

    cur = DomainCurriculumConfig(enabled=True, floor=0.1).build({"a": 1.0, "b": 1.0, "c": 2.0})
    cur.observe("a", [1.0, 1.0, 1.0, 1.0])   # one group's rewards (its valid samples): all equal, no gradient
    cur.observe("b", [0.0, 1.0, 0.0, 1.0])   # mixed: the policy can learn here
    cur.probabilities()                       # {"a": ..., "b": ..., "c": ...}: sums to 1, moved toward b
    cur.state_dict() / cur.load_state_dict(state)

Each domain keeps a learnability score in [0, 1]: an exponential moving average, over its groups, of whether
the group's rewards differed (a group whose samples all got the same reward gives GRPO no gradient: the domain
is always failed or always solved at that point). A domain never observed scores `prior`. The sampling
probability of domain d is

    p_d = floor * base_d + (1 - floor) * base_d * score_d / sum_e(base_e * score_e)

with base_d the configured weights normalised to sum 1, so every domain keeps at least `floor` times its
configured share (none is forgotten: a domain the policy now always fails is still tried and comes back when it
starts to succeed sometimes), and the rest goes to where groups have mixed outcomes. With every score 0 the
probabilities are the configured ones. Scores change only in `observe`, in the order the caller observes groups:
the same observations give the same weights, bit for bit, so a resumed run (state from `state_dict`) samples the
same sequence as the unbroken one.

Difficulty within a domain is not moved here; `success(d)` (an average of the domain's mean group reward) is
the signal a generator's own difficulty curriculum (e.g. reasoning-gym's) can follow: a hook for the domain.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class CurriculumError(ValueError):
    """Bad curriculum settings or state."""


@dataclass
class DomainCurriculumConfig:
    """Online curriculum across the mixture's domains (`envs.curriculum`): sampling weights move toward domains
    whose groups have mixed outcomes, away from those always failed or always solved, never below a floor."""

    enabled: bool = False
    """Move the domains' sampling weights during the run (False: the configured weights, fixed)."""
    floor: float = 0.2
    """Every domain keeps at least this fraction of its configured share of the draws (0 < floor <= 1; 1 = no
    curriculum: the configured weights)."""
    decay: float = 0.8
    """How much of a domain's learnability score each new group keeps (0 <= decay < 1): the score is
    decay * score + (1 - decay) * [the group's rewards differ]. Higher: slower, steadier moves."""
    prior: float = 1.0
    """Learnability score of a domain before its first group (0..1); 1 = an unseen domain is tried as eagerly as
    the most learnable one, so every domain is explored early."""
    min_samples: int = 2
    """A group with fewer valid samples says nothing about learnability and is ignored (>= 2)."""
    level_up_at: float = 0.8
    """A domain with difficulty levels (`envs.domains.<d>.levels`) moves to its next level once the mean reward of
    its last `level_groups` groups at the current level reaches this (levels climb whether or not `enabled`)."""
    level_groups: int = 4
    """Groups of a domain at its current level before it may move up (>= 1)."""

    def validate(self) -> None:
        from megatron_rl.config import ConfigError

        bad = []
        if not 0.0 < self.floor <= 1.0:
            bad.append(f"floor={self.floor} (need 0 < floor <= 1)")
        if not 0.0 <= self.decay < 1.0:
            bad.append(f"decay={self.decay} (need 0 <= decay < 1)")
        if not 0.0 <= self.prior <= 1.0:
            bad.append(f"prior={self.prior} (need 0 <= prior <= 1)")
        if not 0.0 < self.level_up_at <= 1.0:
            bad.append(f"level_up_at={self.level_up_at} (need 0 < level_up_at <= 1)")
        if self.level_groups < 1:
            bad.append(f"level_groups={self.level_groups} (need >= 1)")
        if self.min_samples < 2:
            bad.append(f"min_samples={self.min_samples} (need >= 2: one sample has no spread)")
        if bad:
            raise ConfigError(f"envs.curriculum: {'; '.join(bad)}")

    def build(self, weights: dict[str, float]) -> DomainCurriculum:
        """The curriculum over `weights` (domain -> configured weight > 0)."""
        self.validate()
        return DomainCurriculum(self, weights)


class DomainCurriculum:
    """Per-domain learnability scores and the sampling probabilities they give (see the module docstring)."""

    def __init__(self, cfg: DomainCurriculumConfig, weights: dict[str, float]):
        bad = {d: w for d, w in weights.items() if not (math.isfinite(w) and w > 0)}
        if not weights or bad:
            raise CurriculumError(f"curriculum weights must be finite and > 0, got {bad or weights}")
        total = sum(weights.values())
        self.cfg = cfg
        self.domains = sorted(weights)
        self.base = {d: weights[d] / total for d in self.domains}
        self.score = {d: float(cfg.prior) for d in self.domains}
        self.success_avg = {d: 0.0 for d in self.domains}
        self.groups = {d: 0 for d in self.domains}
        self.mixed = {d: 0 for d in self.domains}
        self._probs: dict[str, float] | None = None

    def observe(self, domain: str, rewards: list[float]) -> bool | None:
        """One group of `domain`: its valid samples' rewards. Returns whether the outcomes were mixed (None: too
        few samples, ignored, or a domain the curriculum does not sample)."""
        if domain not in self.score or len(rewards) < self.cfg.min_samples:
            return None
        mixed = max(rewards) - min(rewards) > 1e-9
        k = self.cfg.decay
        self.score[domain] = k * self.score[domain] + (1.0 - k) * float(mixed)
        mean = sum(rewards) / len(rewards)
        n = self.groups[domain]
        self.success_avg[domain] = mean if n == 0 else k * self.success_avg[domain] + (1.0 - k) * mean
        self.groups[domain] = n + 1
        self.mixed[domain] += mixed
        self._probs = None
        return mixed

    def probabilities(self) -> dict[str, float]:
        """Domain -> sampling probability (sums to 1; each >= floor x its configured share)."""
        if self._probs is None:
            f = self.cfg.floor
            learn = {d: self.base[d] * self.score[d] for d in self.domains}
            z = sum(learn.values())
            learn = {d: v / z for d, v in learn.items()} if z > 0 else dict(self.base)
            self._probs = {d: f * self.base[d] + (1.0 - f) * learn[d] for d in self.domains}
        return self._probs

    def success(self, domain: str) -> float:
        """A moving average of the domain's mean group reward (0 before its first group): the hook for a
        difficulty curriculum within the domain."""
        return self.success_avg[domain]

    def state_dict(self) -> dict:
        """JSON-able; floats round-trip exactly through json."""
        return {"version": 1, "domains": {d: {"score": self.score[d], "success": self.success_avg[d],
                                              "groups": self.groups[d], "mixed": self.mixed[d]}
                                          for d in self.domains}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; a domain new since starts at `prior`, one gone is dropped."""
        if state.get("version") != 1:
            raise CurriculumError(f"unsupported curriculum state version {state.get('version')!r} (expected 1)")
        for d in self.domains:
            s = state["domains"].get(d)
            if s is None:
                self.score[d], self.success_avg[d], self.groups[d], self.mixed[d] = self.cfg.prior, 0.0, 0, 0
            else:
                self.score[d], self.success_avg[d] = float(s["score"]), float(s["success"])
                self.groups[d], self.mixed[d] = int(s["groups"]), int(s["mixed"])
        self._probs = None
