"""Configs of the RL policy loss (`LossConfig`) and the advantage estimator (`AdvantageConfig`).

Both name an entry of a registry defined here (`LOSSES`, `ADVANTAGES`; the built-ins register themselves in
`megatron_rl.rl.losses` and `megatron_rl.rl.advantages`, which the package `megatron_rl.rl` imports);
`validate()` raises `ConfigError` for an unknown name (listing the known ones) and for impossible values.
Loss fields left at None take the chosen loss's own default (e.g. DAPO's clip-higher eps_high=0.28);
`LossConfig.resolved()` returns the config with those filled in.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from megatron_rl.config import ConfigError
from megatron_rl.registry import Registry, RegistryError

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
IS_CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis")
IS_LEVELS: tuple[str, ...] = ("token", "sequence")

LOSSES: Registry[Callable] = Registry("loss", entry_point_group="megatron_rl.losses")
"""Policy losses: `fn(batch: LossInputs, cfg: LossConfig) -> LossOutput` (`megatron_rl.rl.losses`)."""
ADVANTAGES: Registry[Callable] = Registry("advantage estimator", entry_point_group="megatron_rl.advantages")
"""Advantage estimators: `fn(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput`."""


@dataclass(frozen=True)
class LossDefaults:
    """What a loss uses for LossConfig fields left at None, and which aggregations it accepts."""

    aggregation: str = "token-mean"
    """Aggregation used when LossConfig.aggregation is None."""
    aggregations: tuple[str, ...] = AGGREGATIONS
    """Aggregations this loss accepts (the others contradict its definition)."""
    eps_low: float = 0.2
    """Default lower clip epsilon."""
    eps_high: float = 0.2
    """Default upper clip epsilon."""


def register_loss(name: str, defaults: LossDefaults = LossDefaults()):
    """Decorator: register `fn(batch, cfg) -> LossOutput` under `name` with its `LossDefaults`."""
    def deco(fn: Callable) -> Callable:
        fn.loss_defaults = defaults  # type: ignore[attr-defined]
        return LOSSES.register(name, fn)
    return deco


def loss_defaults(name: str) -> LossDefaults:
    """The defaults of registered loss `name` (a plugin loss without any gets `LossDefaults()`)."""
    return getattr(LOSSES.get(name), "loss_defaults", LossDefaults())



@dataclass
class LossConfig:
    """The policy loss of the trainer; see `megatron_rl.rl.losses` for the normalisation contract."""

    name: str = "ppo"
    """Registered policy loss (LOSSES): ppo, grpo, dr_grpo, dapo, gspo, cispo, reinforce."""
    aggregation: Aggregation | None = None
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | constant (see losses.py); None = the loss's default."""
    loss_constant: float | None = None
    """aggregation 'constant' (Dr.GRPO): normaliser = loss_constant * samples; set it to max_new_tokens."""
    eps_low: float | None = None
    """Clip: ratio lower bound is 1 - eps_low; None = loss default (0.2; GSPO 3e-4; CISPO 1.0 = no lower bound)."""
    eps_high: float | None = None
    """Clip(-higher): ratio upper bound is 1 + eps_high; None = loss default (0.2; DAPO 0.28; GSPO 4e-4; CISPO 1.0)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for negative advantages the per-token loss is capped at -c * A; None = off."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference loss term (needs ref_logprobs when > 0); 0 = no KL term."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of KL(policy || reference) per token: k1 = log r, k2 = (log r)^2 / 2, k3 = r' - 1 - log r'."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss; needs entropy when > 0); 0 = off."""
    is_correction: Literal["none", "tis", "mis"] = "none"
    """Old-vs-behaviour (rollout engine) importance correction: none | tis (truncate at is_cap) | mis (mask)."""
    is_level: Literal["token", "sequence"] = "token"
    """Importance weight per token, or per sequence (product over the sample's loss tokens)."""
    is_cap: float = 2.0
    """TIS: importance weights are clamped to at most this value C."""
    is_low: float = 0.5
    """MIS: tokens (or sequences) whose importance weight is below this are dropped."""
    is_high: float = 2.0
    """MIS: tokens (or sequences) whose importance weight is above this are dropped."""

    def resolved(self, defaults=None) -> LossConfig:
        """This config with None fields filled from `defaults` (a LossDefaults; None: those of loss `name`)."""
        d = defaults if defaults is not None else loss_defaults(self.name)
        return dataclasses.replace(
            self,
            aggregation=self.aggregation if self.aggregation is not None else d.aggregation,
            eps_low=self.eps_low if self.eps_low is not None else d.eps_low,
            eps_high=self.eps_high if self.eps_high is not None else d.eps_high,
        )

    def validate(self) -> None:
        _check_name(LOSSES, "loss.name", self.name)
        r = self.resolved()
        _check_choice("loss.aggregation", r.aggregation, AGGREGATIONS)
        allowed = loss_defaults(self.name).aggregations
        if r.aggregation not in allowed:
            raise ConfigError(f"loss.aggregation={r.aggregation!r} contradicts loss {self.name!r}, which "
                              f"needs one of {list(allowed)}; remove the key to use the loss's default")
        _check_choice("loss.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _check_choice("loss.is_correction", self.is_correction, IS_CORRECTIONS)
        _check_choice("loss.is_level", self.is_level, IS_LEVELS)
        self._validate_numbers(r)

    def _validate_numbers(self, r: LossConfig) -> None:
        _check_range("loss.eps_low", r.eps_low, 0.0, 1.0)
        _check_range("loss.eps_high", r.eps_high, 0.0, math.inf)
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ConfigError(f"loss.dual_clip must be > 1 (or null to turn it off), got {self.dual_clip}")
        _check_range("loss.kl_coef", self.kl_coef, 0.0, math.inf)
        _check_range("loss.entropy_coef", self.entropy_coef, 0.0, math.inf)
        if r.aggregation == "constant" and not (self.loss_constant or 0) > 0:
            raise ConfigError(f"loss.loss_constant must be > 0 for aggregation 'constant', got "
                              f"{self.loss_constant}; set it to the rollout's max_new_tokens")
        if not self.is_cap > 0:
            raise ConfigError(f"loss.is_cap must be > 0, got {self.is_cap}")
        if not 0 <= self.is_low < self.is_high:
            raise ConfigError(f"loss.is_low/is_high must satisfy 0 <= is_low < is_high, got "
                              f"{self.is_low}/{self.is_high}")

    def build(self):
        """The loss as `fn(batch: LossInputs) -> LossOutput`, with this (validated) config bound."""
        self.validate()
        return functools.partial(LOSSES.get(self.name), cfg=self)


@dataclass
class AdvantageConfig:
    """The advantage estimator; runs on the whole global batch before it is split for the trainer."""

    name: str = "grpo"
    """Registered advantage estimator (ADVANTAGES): grpo, rloo, reinforce++, gae, distill (needs distill.teacher)."""
    scale_by_std: bool = True
    """grpo: divide by the group's reward std (GRPO); False subtracts the group mean only (Dr.GRPO)."""
    unbiased_std: bool = True
    """grpo: the group std uses Bessel's correction (n - 1), as DeepSeekMath's GRPO; False divides by n."""
    eps: float = 1e-6
    """Added to standard deviations before dividing (grpo, reinforce++, gae whitening)."""
    gamma: float = 1.0
    """Discount per loss token (gae, reinforce++)."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.0
    """KL-in-reward: per-token reward -= kl_coef * kl (reinforce++, gae; needs per-token kl when > 0)."""
    whiten: bool = False
    """gae: normalise advantages to mean 0, std 1 over the batch's loss tokens."""
    distill_coef: float = 1.0
    """distill: weight of the per-token reverse-KL reward -(log pi(x_t) - log pi_teacher(x_t)) of each sampled token."""
    task_weight: float = 0.0
    """distill: weight of the task advantage (of `task_estimator`, from the rewards) added to every loss token;
    0 = pure distillation."""
    task_estimator: str = "grpo"
    """distill: the estimator of the task rewards mixed in when task_weight > 0 (one needing no critic: grpo,
    rloo, reinforce++)."""

    def validate(self) -> None:
        _check_name(ADVANTAGES, "advantage.name", self.name)
        if not self.eps > 0:
            raise ConfigError(f"advantage.eps must be > 0 (it guards divisions), got {self.eps}")
        _check_range("advantage.gamma", self.gamma, 0.0, 1.0)
        _check_range("advantage.lam", self.lam, 0.0, 1.0)
        _check_range("advantage.kl_coef", self.kl_coef, 0.0, math.inf)
        _check_range("advantage.distill_coef", self.distill_coef, 0.0, math.inf)
        _check_range("advantage.task_weight", self.task_weight, 0.0, math.inf)
        _check_name(ADVANTAGES, "advantage.task_estimator", self.task_estimator)
        if self.task_estimator in ("distill", "gae"):
            raise ConfigError(f"advantage.task_estimator={self.task_estimator!r}: the task rewards' estimator must "
                              "need neither a teacher nor a critic; use grpo, rloo or reinforce++")
        if self.name == "distill" and self.distill_coef == 0 and self.task_weight == 0:
            raise ConfigError("advantage.name='distill' with distill_coef=0 and task_weight=0 trains on nothing; "
                              "set distill_coef > 0 (the teacher's signal)")

    def build(self):
        """The estimator as `fn(inputs: AdvantageInputs) -> AdvantageOutput`, with this config bound."""
        self.validate()
        return functools.partial(ADVANTAGES.get(self.name), cfg=self)


def _check_name(registry, key: str, name: str) -> None:
    try:
        registry.get(name)
    except RegistryError as e:
        raise ConfigError(f"{key}: {e}") from None


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {list(choices)}")


def _check_range(key: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:  # also rejects NaN
        raise ConfigError(f"{key} must be in [{lo}, {hi}], got {value}")
