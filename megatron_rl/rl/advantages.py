"""Advantage estimators as a registry: grpo (group-normalised; Dr.GRPO without std), rloo, reinforce++, gae, distill.

Every estimator is `fn(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput`. It runs on the
WHOLE global batch (rewards are small; run it on every rank or broadcast the result) before the batch is
split into micro-batches and data-parallel shards, so group and batch statistics are global.

Shapes: N samples, T tokens of the packed batch. Inputs always hold per-sample `rewards` [N] and
`group_ids` [N] (samples of one prompt share a group id). When `sample_index` [T] (values in [0, N)) and
`loss_mask` [T] are given, the output is per token [T] (a sample's advantage broadcast to its loss tokens,
0 elsewhere), ready for `LossInputs.advantages`; otherwise it is per sample [N]. gae, and reinforce++ with
KL-in-reward, are token-level and need the token inputs.

Token-level rewards (gae, reinforce++): r_t = token_rewards_t - kl_coef * kl_t on loss tokens, plus the
sample's reward on its LAST loss token. Only loss tokens are steps of the MDP: environment/observation tokens
between turns (loss_mask 0) are skipped, and a sample's tokens must appear in order in the packed batch.

On-policy distillation (distill): the student samples, a teacher scores every sampled token, and each loss
token's advantage is its reward -(log pi(x_t) - log pi_teacher(x_t)) (the per-token reverse KL to the teacher,
negated; no discounting: each token's own term, as in on-policy distillation), times distill_coef, plus
task_weight times the task advantage of `task_estimator` (grpo, rloo, reinforce++) from the rewards. The input
is `teacher_kl` [T] (`reverse_kl`); minimising the policy-gradient loss with it minimises KL(pi || teacher).

Degenerate groups (one sample, or all rewards equal) get advantage exactly 0, never NaN. A non-finite
reward raises ValueError naming the sample.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.rl.config import ADVANTAGES, AdvantageConfig  # noqa: F401  (the registry lives with its config)

TOKEN_FIELDS = ("loss_mask", "values", "token_rewards", "kl", "teacher_kl")
"""The per-token [T] fields of AdvantageInputs (need sample_index)."""


@dataclass
class AdvantageInputs:
    """Rewards of a global batch; per-token fields are [T] over the packed batch and optional."""

    rewards: Tensor
    """[N] total reward of each sample."""
    group_ids: Tensor
    """[N] integer group of each sample (the samples drawn for one prompt share one)."""
    sample_index: Tensor | None = None
    """[T] sample (0..N-1) of each token; given -> advantages are per token [T]."""
    loss_mask: Tensor | None = None
    """[T] 1 on trained (model-generated) tokens; needed with sample_index."""
    values: Tensor | None = None
    """[T] value-head predictions V(s_t) (gae)."""
    token_rewards: Tensor | None = None
    """[T] dense per-token rewards added to the outcome reward (gae, reinforce++); None = 0."""
    kl: Tensor | None = None
    """[T] per-token KL to the reference (`losses.kl_penalty`), for KL-in-reward with cfg.kl_coef > 0."""
    teacher_kl: Tensor | None = None
    """[T] log pi(x_t) - log pi_teacher(x_t) of each sampled token (`reverse_kl`), for distill."""

    def __post_init__(self) -> None:
        if self.rewards.dim() != 1 or self.group_ids.shape != self.rewards.shape:
            raise ValueError(f"AdvantageInputs.rewards and group_ids must both be [N], got "
                             f"{tuple(self.rewards.shape)} and {tuple(self.group_ids.shape)}")
        _check_finite(self.rewards, self.group_ids, "reward")
        if self.sample_index is None:
            for name in TOKEN_FIELDS:
                if getattr(self, name) is not None:
                    raise ValueError(f"AdvantageInputs.{name} is per token and needs sample_index [T] too")
            return
        self._check_tokens()

    def _check_tokens(self) -> None:
        t, n = self.sample_index.shape, self.rewards.numel()
        if self.loss_mask is None:
            raise ValueError("AdvantageInputs.sample_index needs loss_mask [T] too")
        for name in TOKEN_FIELDS:
            v = getattr(self, name)
            if v is not None and v.shape != t:
                raise ValueError(f"AdvantageInputs.{name} has shape {tuple(v.shape)}, expected [T] = {tuple(t)}")
        if t[0] and (self.sample_index.min() < 0 or self.sample_index.max() >= n):
            raise ValueError(f"AdvantageInputs.sample_index must index the {n} samples (0..{n - 1}), got "
                             f"values in [{int(self.sample_index.min())}, {int(self.sample_index.max())}]")
        mask = self.loss_mask.bool()
        for name in TOKEN_FIELDS[1:]:
            v = getattr(self, name)
            if v is not None:
                bad = mask & ~torch.isfinite(v)  # [T]
                if bad.any():
                    i = int(self.sample_index[bad][0])
                    raise ValueError(f"AdvantageInputs.{name} is not finite on a loss token of sample {i} "
                                     f"(group {int(self.group_ids[i])}); fix or drop that sample")


@dataclass
class AdvantageOutput:
    """What an estimator returns."""

    advantages: Tensor
    """[T] per token when the inputs had sample_index (0 off the loss mask), else [N] per sample; float32."""
    returns: Tensor | None = None
    """[T] value targets (gae: advantages + values) or discounted returns (token-level reinforce++); else None."""


AdvantageFn = Callable[[AdvantageInputs, AdvantageConfig], AdvantageOutput]


def _check_finite(rewards: Tensor, group_ids: Tensor, what: str) -> None:
    bad = ~torch.isfinite(rewards)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{what} of sample {i} (group {int(group_ids[i])}) is {float(rewards[i])}; rewards must "
                         "be finite: fix the reward function or drop that sample")


# ------------------------------------------------------------------------------------------ helpers
def _dense_ids(ids: Tensor) -> tuple[Tensor, int]:
    """Arbitrary ids [N] -> dense ids [N] in [0, G), and G."""
    uniq, dense = torch.unique(ids, return_inverse=True)
    return dense, uniq.numel()


def _group_stats(r: Tensor, group_ids: Tensor, unbiased: bool) -> tuple[Tensor, ...]:
    """Per-sample (broadcast) group mean, std, size and degenerate flag for rewards r [N] (float64)."""
    ids, g = _dense_ids(group_ids)  # [N]
    size = r.new_zeros(g).index_add(0, ids, torch.ones_like(r))  # [G]
    mean = r.new_zeros(g).index_add(0, ids, r) / size  # [G]
    sq = r.new_zeros(g).index_add(0, ids, (r - mean[ids]).square())  # [G]
    std = (sq / ((size - 1).clamp(min=1) if unbiased else size)).sqrt()  # [G]
    hi = r.new_full((g,), -torch.inf).scatter_reduce(0, ids, r, "amax")  # [G]
    lo = r.new_full((g,), torch.inf).scatter_reduce(0, ids, r, "amin")  # [G]
    degenerate = (size < 2) | (hi == lo)  # [G] one sample or all equal: advantage exactly 0
    return mean[ids], std[ids], size[ids], degenerate[ids]


def _per_token(adv: Tensor, inputs: AdvantageInputs) -> Tensor:
    """Per-sample adv [N] -> [T] broadcast to loss tokens (0 elsewhere) if the inputs are token-level."""
    if inputs.sample_index is None:
        return adv.float()
    return torch.where(inputs.loss_mask.bool(), adv[inputs.sample_index], 0.0).float()  # [T]


def _whiten(x: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over mask [T] (population std); exactly 0 when the masked values are all equal."""
    vals = x[mask]  # [M]
    if vals.numel() == 0 or bool(vals.max() == vals.min()):
        return torch.zeros_like(x)
    mean, std = vals.mean(), vals.std(correction=0)
    return torch.where(mask, (x - mean) / (std + eps), 0.0)


def _layout(inputs: AdvantageInputs) -> tuple[Tensor, Tensor, Tensor, int]:
    """Where loss tokens go in a padded [N, L] matrix: mask [T], rows [M], cols [M] (order within sample), L."""
    mask = inputs.loss_mask.bool()  # [T]
    rows = inputs.sample_index[mask].long()  # [M]
    n = inputs.rewards.numel()
    counts = torch.bincount(rows, minlength=n)  # [N]
    starts = torch.cumsum(counts, 0) - counts  # [N]
    order = torch.argsort(rows, stable=True)  # [M] tokens grouped by sample, packed order kept
    cols = torch.empty_like(rows)
    cols[order] = torch.arange(rows.numel(), device=rows.device) - starts[rows[order]]
    return mask, rows, cols, int(counts.max()) if n else 0


def _reverse_discounted_sum(x: Tensor, discount: float) -> Tensor:
    """y[:, j] = x[:, j] + discount * y[:, j+1] over [N, L] (trailing padding must be 0)."""
    out, acc = torch.empty_like(x), x.new_zeros(x.shape[0])
    for j in range(x.shape[1] - 1, -1, -1):
        acc = x[:, j] + discount * acc
        out[:, j] = acc
    return out


def _token_rewards(inputs: AdvantageInputs, cfg: AdvantageConfig, mask: Tensor) -> Tensor:
    """[T] float64: token_rewards - kl_coef * kl on loss tokens, plus each sample's reward on its last loss token."""
    r = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    if inputs.token_rewards is not None:
        r += torch.where(mask, inputs.token_rewards.double(), 0.0)
    if cfg.kl_coef > 0:
        if inputs.kl is None:
            raise ValueError("advantage.kl_coef > 0 needs AdvantageInputs.kl (losses.kl_penalty of the policy and "
                             "reference log-probs); pass it or set kl_coef=0")
        r -= cfg.kl_coef * torch.where(mask, inputs.kl.double(), 0.0)
    pos = torch.arange(mask.numel(), device=mask.device)[mask]  # [M]
    last = pos.new_full((inputs.rewards.numel(),), -1)  # [N] last loss token of each sample, -1 if none
    last = last.scatter_reduce(0, inputs.sample_index[mask].long(), pos, "amax")
    has = last >= 0  # [N] samples with at least one loss token
    r[last[has]] += inputs.rewards.double()[has]
    return r


def reverse_kl(logprobs: Tensor, teacher_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """[T] float32 log pi(x_t) - log pi_teacher(x_t) on loss tokens (0 elsewhere, no NaN from padding), the
    single-sample estimate of KL(pi || teacher) at each sampled token; no gradient. Inputs are [T]."""
    mask = loss_mask.bool()  # [T]
    with torch.no_grad():
        return torch.where(mask, logprobs.float() - teacher_logprobs.float(), 0.0)  # [T]


def _require_tokens(inputs: AdvantageInputs, name: str, *fields: str) -> None:
    for f in ("sample_index", *fields):
        if getattr(inputs, f) is None:
            raise ValueError(f"advantage estimator {name!r} needs AdvantageInputs.{f} (per-token [T])")


# ---------------------------------------------------------------------------------------- estimators
@ADVANTAGES.register("grpo")
def grpo_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    """(r - mean_group) / (std_group + eps); scale_by_std=False gives Dr.GRPO's r - mean_group."""
    r = inputs.rewards.double()  # [N]
    mean, std, _, degenerate = _group_stats(r, inputs.group_ids, cfg.unbiased_std)
    adv = (r - mean) / (std + cfg.eps) if cfg.scale_by_std else r - mean  # [N]
    return AdvantageOutput(_per_token(torch.where(degenerate, 0.0, adv), inputs))


@ADVANTAGES.register("rloo")
def rloo_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    """Leave-one-out: r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_group) (Ahmadian et al. 2024)."""
    r = inputs.rewards.double()  # [N]
    mean, _, size, degenerate = _group_stats(r, inputs.group_ids, True)
    adv = size / (size - 1).clamp(min=1) * (r - mean)  # [N]
    return AdvantageOutput(_per_token(torch.where(degenerate, 0.0, adv), inputs))


@ADVANTAGES.register("reinforce++")
def reinforce_pp_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++ (Hu 2025): discounted returns of token rewards (with KL-in-reward), whitened over the batch.

    Token-level: returns over loss tokens, whitened over all loss tokens of the batch (token-weighted);
    sample-level (no sample_index; kl_coef must be 0): rewards whitened over the batch's samples.
    """
    if inputs.sample_index is None:
        if cfg.kl_coef > 0:
            _require_tokens(inputs, "reinforce++ with kl_coef > 0", "kl")
        return AdvantageOutput(_whiten(inputs.rewards.double(), torch.ones_like(inputs.rewards, dtype=torch.bool),
                                       cfg.eps).float())
    mask, rows, cols, length = _layout(inputs)
    token_rewards = _token_rewards(inputs, cfg, mask)  # [T]
    padded = token_rewards.new_zeros(inputs.rewards.numel(), length)  # [N, L]
    padded[rows, cols] = token_rewards[mask]
    returns = torch.zeros_like(token_rewards)  # [T]
    returns[mask] = _reverse_discounted_sum(padded, cfg.gamma)[rows, cols]
    return AdvantageOutput(_whiten(returns, mask, cfg.eps).float(), returns.float())


@ADVANTAGES.register("gae")
def gae_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    """GAE (Schulman et al. 2016) over loss tokens: delta_t = r_t + gamma V_{t+1} - V_t (V after the last = 0),
    A_t = delta_t + gamma lam A_{t+1}; returns A_t + V_t (value targets); `whiten` normalises A."""
    _require_tokens(inputs, "gae", "values")
    mask, rows, cols, length = _layout(inputs)
    n, token_rewards = inputs.rewards.numel(), _token_rewards(inputs, cfg, mask)  # [T]
    values = token_rewards.new_zeros(n, length + 1)  # [N, L+1], a zero column after the last token
    values[rows, cols] = inputs.values.double()[mask]
    rewards = token_rewards.new_zeros(n, length)  # [N, L]
    rewards[rows, cols] = token_rewards[mask]
    delta = rewards + cfg.gamma * values[:, 1:] - values[:, :-1]  # [N, L], 0 on padding
    adv_padded = _reverse_discounted_sum(delta, cfg.gamma * cfg.lam)  # [N, L]
    adv = torch.zeros_like(token_rewards)  # [T]
    adv[mask] = adv_padded[rows, cols]
    returns = torch.where(mask, adv + inputs.values.double(), 0.0)  # [T]
    adv = _whiten(adv, mask, cfg.eps) if cfg.whiten else adv
    return AdvantageOutput(adv.float(), returns.float())


@ADVANTAGES.register("distill")
def distill_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageOutput:
    """On-policy distillation: A_t = -distill_coef * teacher_kl_t + task_weight * A^task_t on loss tokens, 0
    elsewhere; A^task from cfg.task_estimator on the same inputs (its per-token broadcast of the rewards)."""
    _require_tokens(inputs, "distill", "teacher_kl")
    mask = inputs.loss_mask.bool()  # [T]
    adv = torch.where(mask, -cfg.distill_coef * inputs.teacher_kl.double(), 0.0)  # [T]
    if cfg.task_weight > 0:
        task = ADVANTAGES.get(cfg.task_estimator)(inputs, cfg).advantages  # [T], 0 off the mask
        adv = adv + cfg.task_weight * task.double()
    return AdvantageOutput(adv.float())
