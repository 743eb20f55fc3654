"""Policy losses of RL post-training as a registry: PPO-clip, GRPO, Dr.GRPO, DAPO, GSPO, CISPO, REINFORCE.

Every loss is `fn(batch: LossInputs, cfg: LossConfig) -> LossOutput` over one packed micro-batch of T tokens
(several samples laid end to end; `sample_index` says which sample each token belongs to). Pure PyTorch on
one device; the trainer does the parallel plumbing described here.

Per-token loss (0 on tokens with loss_mask 0, which get exactly zero gradient):
    l_t = w^IS_t * pg_t + kl_coef * KL_t - entropy_coef * H_t
pg_t is the loss's policy-gradient term (below), w^IS_t the stop-gradient old-vs-behaviour importance weight
(`is_correction`: none | tis | mis; token or sequence level), KL_t the per-token KL(policy || reference)
estimate (k1 | k2 | k3) and H_t the policy entropy.

Normalisation contract (invariant to packing and to the data-parallel size)
--------------------------------------------------------------------------
A loss returns  sum_t a_t * l_t / Z  where a_t is the aggregation weight of token t and Z the GLOBAL
normaliser, `batch.normaliser`, supplied from outside:

    aggregation           a_t        Z over the global batch                 the value is
    token-mean            1          number of loss tokens                   mean over all loss tokens (DAPO)
    seq-mean-token-mean   1 / n_s    number of samples                       mean over samples of token means
    seq-mean-token-sum    1          number of samples                       mean over samples of token sums
    constant              1          loss_constant * number of samples       Dr.GRPO: sum / (max_len * samples)

n_s is the number of loss tokens of the sample that token t belongs to, counted over the WHOLE sample (pass
`sample_num_tokens` when a sample is split over micro-batches or context-parallel ranks; otherwise it is
counted in the micro-batch), and "number of samples" counts samples with at least one loss token.

`normaliser(cfg, loss_mask, sample_index, sample_num_tokens)` returns what the given tokens contribute to Z.
Contributions add up over ANY partition of the global batch's tokens (a sample contributes sum_t 1/n_s = 1
however it is split). The trainer therefore:
  1. before the first forward pass of a step, sums `normaliser(...)` over its micro-batches and all-reduces
     the sum (SUM) over every rank that holds different tokens of the global batch (data-parallel, and
     context-parallel when cp > 1);
  2. sets `batch.normaliser = Z` on each micro-batch and back-propagates each micro-batch's loss as it is
     (no division by the number of micro-batches);
  3. reduces gradients over data-parallel ranks as a SUM. Megatron's DDP AVERAGES over dp by default: then
     multiply the loss by the dp size, or turn the averaging off.
Then the losses and gradients summed over micro-batches and ranks equal those of the whole global batch
in one piece. With `batch.normaliser = None` the loss computes Z from the micro-batch alone (one device,
micro-batch == batch). Tokens rejected by masked IS (MIS) stay in Z: rejecting removes their gradient
without up-weighting the others. GSPO's sequence ratio and sequence-level IS weights need each sample whole
in one micro-batch (packing never splits a sample; with cp > 1 they are not supported yet).

Metrics are 0-d detached tensors over THIS micro-batch's loss tokens (means, mins, maxes; `num_tokens`):
combine means across micro-batches weighted by `num_tokens`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.config import ConfigError
from megatron_rl.rl.config import (  # noqa: F401  (LOSSES and its helpers live with the configs that name them)
    AGGREGATIONS,
    LOSSES,
    LossConfig,
    LossDefaults,
    loss_defaults,
    register_loss,
)

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-20, 20] before exp(): no inf/NaN from a token whose log-prob collapsed."""


@dataclass
class LossInputs:
    """Per-token tensors of one packed micro-batch; every tensor is 1-D [T]."""

    logprobs: Tensor
    """[T] log-prob of each token under the current policy (carries the gradient)."""
    old_logprobs: Tensor
    """[T] log-prob under the proximal (old) policy of this step: the PPO ratio's denominator."""
    advantages: Tensor
    """[T] advantage of each token (a sample's advantage broadcast to its tokens)."""
    loss_mask: Tensor
    """[T] 1 (or True) on tokens the model generated and is trained on; 0 on prompt/observation/padding."""
    sample_index: Tensor
    """[T] integer id of the sample each token belongs to (any ids; equal id = same sample)."""
    behaviour_logprobs: Tensor | None = None
    """[T] log-prob under the rollout engine (behaviour policy); needed when is_correction != 'none'."""
    ref_logprobs: Tensor | None = None
    """[T] log-prob under the frozen reference policy; needed when kl_coef > 0."""
    entropy: Tensor | None = None
    """[T] entropy of the current policy at each position (with gradient); needed when entropy_coef > 0."""
    sample_num_tokens: Tensor | None = None
    """[T] loss tokens of each token's WHOLE sample (`sample_token_counts` on the full batch); None: counted here."""
    normaliser: Tensor | float | None = None
    """Global normaliser Z (see the module docstring); None computes it from this micro-batch alone."""

    def __post_init__(self) -> None:
        if self.logprobs.dim() != 1:
            raise ValueError(f"LossInputs.logprobs must be 1-D [T] (one packed micro-batch), "
                             f"got shape {tuple(self.logprobs.shape)}; flatten [B, S] inputs first")
        for name in ("old_logprobs", "advantages", "loss_mask", "sample_index", "behaviour_logprobs",
                     "ref_logprobs", "entropy", "sample_num_tokens"):
            value = getattr(self, name)
            if value is not None and value.shape != self.logprobs.shape:
                raise ValueError(f"LossInputs.{name} has shape {tuple(value.shape)}; every per-token tensor "
                                 f"must be [T] = {tuple(self.logprobs.shape)} like logprobs")


@dataclass
class LossOutput:
    """What a loss returns."""

    loss: Tensor
    """[] the micro-batch's share of the global loss: sum_t a_t * l_t / Z (back-propagate it as is)."""
    metrics: dict[str, Tensor]
    """Detached 0-d tensors: clip_fraction, approx_kl, ratio_*, is_weight_*, entropy_mean, num_tokens, ..."""


LossFn = Callable[[LossInputs, LossConfig], LossOutput]
Objective = Callable[[LossInputs, LossConfig, Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]


# ------------------------------------------------------------------------------------- segment helpers
def _dense_ids(sample_index: Tensor) -> tuple[Tensor, int]:
    """Arbitrary sample ids [T] -> dense ids [T] in [0, S), and S."""
    uniq, ids = torch.unique(sample_index, return_inverse=True)
    return ids, uniq.numel()


def _segment_sum(x: Tensor, ids: Tensor, n: int) -> Tensor:
    """Sum of x [T] per segment id [T] -> [n] (differentiable in x)."""
    return x.new_zeros(n).index_add(0, ids, x)


def sample_token_counts(loss_mask: Tensor, sample_index: Tensor) -> Tensor:
    """[T] number of loss tokens of each token's sample, counted in the given tokens (call on the full batch)."""
    ids, n = _dense_ids(sample_index)
    counts = _segment_sum(loss_mask.to(torch.float64), ids, n)  # [S]
    return counts[ids]  # [T]


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x [T] over mask [T]; 0 when the mask is empty. Detached."""
    x = torch.where(mask, x.detach(), 0.0)
    return x.sum() / mask.sum().clamp(min=1)


def _masked_stats(x: Tensor, mask: Tensor, prefix: str) -> dict[str, Tensor]:
    """{prefix_mean, prefix_min, prefix_max} of x [T] over mask [T] (0 when the mask is empty). Detached."""
    x, any_ = x.detach(), mask.any()
    lo = torch.where(mask, x, math.inf).amin() if x.numel() else x.new_zeros(())
    hi = torch.where(mask, x, -math.inf).amax() if x.numel() else x.new_zeros(())
    return {f"{prefix}_mean": _masked_mean(x, mask),
            f"{prefix}_min": torch.where(any_, lo, 0.0), f"{prefix}_max": torch.where(any_, hi, 0.0)}


# ------------------------------------------------------------------------------------- normalisation
def normaliser(cfg: LossConfig, loss_mask: Tensor, sample_index: Tensor,
               sample_num_tokens: Tensor | None = None) -> Tensor:
    """What these tokens contribute to the global normaliser Z (float64 0-d); SUM it over micro-batches and ranks.

    token-mean: loss tokens; seq-mean-*: samples (sum_t 1/n_s); constant: loss_constant * samples.
    """
    cfg = cfg.resolved()
    mask = loss_mask.bool()  # [T]
    if cfg.aggregation == "token-mean":
        return mask.sum(dtype=torch.float64)
    n = sample_num_tokens if sample_num_tokens is not None else sample_token_counts(mask, sample_index)  # [T]
    samples = (mask.to(torch.float64) / n.to(torch.float64).clamp(min=1)).sum()  # [] sum_t 1/n_s
    if cfg.aggregation != "constant":
        return samples
    if not (cfg.loss_constant or 0) > 0:
        raise ConfigError("loss.loss_constant must be > 0 for aggregation 'constant' (Dr.GRPO); "
                          "set it to the rollout's max_new_tokens")
    return samples * cfg.loss_constant


def _token_weights(batch: LossInputs, cfg: LossConfig, mask: Tensor) -> Tensor:
    """[T] aggregation weight a_t: 1/n_s for seq-mean-token-mean, else 1; 0 off the loss mask."""
    if cfg.aggregation != "seq-mean-token-mean":
        return mask.float()
    n = batch.sample_num_tokens
    n = n if n is not None else sample_token_counts(mask, batch.sample_index)  # [T]
    return mask.float() / n.float().clamp(min=1)


def _global_normaliser(batch: LossInputs, cfg: LossConfig, like: Tensor) -> Tensor:
    z = batch.normaliser
    if z is None:
        z = normaliser(cfg, batch.loss_mask, batch.sample_index, batch.sample_num_tokens)
    z = torch.as_tensor(z, dtype=like.dtype, device=like.device)
    return z.clamp(min=torch.finfo(like.dtype).tiny)  # Z = 0 only when there is no loss token: loss 0


# ------------------------------------------------------------------------------- KL, entropy, IS weights
def _log_ratio(a: Tensor, b: Tensor, mask: Tensor) -> Tensor:
    """[T] a - b on loss tokens, 0 elsewhere (no NaN from padding), clamped to +-LOG_RATIO_CLAMP."""
    return torch.where(mask, a.float() - b.float(), 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def kl_estimate(log_ratio: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log_ratio = log pi - log pi_ref [T] (samples from pi).

    k1 = log_ratio; k2 = log_ratio^2 / 2; k3 = exp(-log_ratio) - 1 + log_ratio (>= 0, unbiased, low variance).
    """
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; known: k1, k2, k3")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, estimator: str = "k1") -> Tensor:
    """[T] per-token KL(policy || reference) to SUBTRACT from rewards (times a coefficient); 0 off the mask.

    For KL-in-reward (REINFORCE++, PPO with GAE): pass it as `AdvantageInputs.kl`. No gradient.
    """
    mask = loss_mask.bool()
    with torch.no_grad():
        return torch.where(mask, kl_estimate(_log_ratio(logprobs, ref_logprobs, mask), estimator), 0.0)


def mismatch_kl(behaviour_logprobs: Tensor, logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """[T] per-token k3 estimate of KL(behaviour || trainer) on loss tokens (0 elsewhere): the rollout engine's
    log-probs of the sampled tokens against the trainer's log-probs of the same tokens. No gradient."""
    mask = loss_mask.bool()
    with torch.no_grad():
        return torch.where(mask, kl_estimate(_log_ratio(behaviour_logprobs, logprobs, mask), "k3"), 0.0)


def importance_weights(batch: LossInputs, cfg: LossConfig, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """[T] no-grad weights of rho = pi_old/pi_behaviour: TIS min(rho, is_cap); MIS rho in [is_low, is_high] else 0."""
    if cfg.is_correction == "none":
        return torch.ones_like(mask, dtype=torch.float32), {}
    if batch.behaviour_logprobs is None:
        raise ValueError(f"loss.is_correction={cfg.is_correction!r} needs LossInputs.behaviour_logprobs (the "
                         "rollout engine's log-probs from the shard); pass them or set is_correction='none'")
    with torch.no_grad():
        log_rho = _log_ratio(batch.old_logprobs, batch.behaviour_logprobs, mask)  # [T] log pi_old/pi_behaviour
        metrics = {"behaviour_kl": _masked_mean(kl_estimate(-log_rho, "k3"), mask)}
        if cfg.is_level == "sequence":
            ids, n = _dense_ids(batch.sample_index)
            log_rho = _segment_sum(log_rho, ids, n)[ids]  # [T] log of the product over the sample
        if cfg.is_correction == "tis":
            weight = torch.exp(log_rho.clamp(max=math.log(cfg.is_cap)))  # [T]
            metrics["is_truncated_fraction"] = _masked_mean((log_rho > math.log(cfg.is_cap)).float(), mask)
        else:
            keep = (torch.exp(log_rho) >= cfg.is_low) & (log_rho <= math.log(cfg.is_high))  # [T]
            weight = torch.where(keep, torch.exp(log_rho.clamp(max=math.log(cfg.is_high))), 0.0)
            metrics["is_masked_fraction"] = _masked_mean((~keep).float(), mask)
    return weight, {**metrics, **_masked_stats(weight, mask, "is_weight")}


def _regularisers(batch: LossInputs, cfg: LossConfig, mask: Tensor, metrics: dict) -> Tensor:
    """[T] kl_coef * KL_t - entropy_coef * H_t (adds ref_kl / entropy_mean to metrics when available)."""
    extra = torch.zeros_like(mask, dtype=torch.float32)
    if cfg.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs LossInputs.ref_logprobs (reference-model log-probs); "
                         "pass them or set kl_coef=0 (or use KL-in-reward via kl_penalty)")
    if batch.ref_logprobs is not None:
        kl = kl_estimate(_log_ratio(batch.logprobs, batch.ref_logprobs, mask), cfg.kl_estimator)  # [T]
        metrics["ref_kl"] = _masked_mean(kl, mask)
        extra = extra + cfg.kl_coef * kl if cfg.kl_coef > 0 else extra
    if cfg.entropy_coef > 0 and batch.entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs LossInputs.entropy; pass it or set entropy_coef=0")
    if batch.entropy is not None:
        entropy = torch.where(mask, batch.entropy.float(), 0.0)  # [T]
        metrics["entropy_mean"] = _masked_mean(entropy, mask)
        extra = extra - cfg.entropy_coef * entropy if cfg.entropy_coef > 0 else extra
    return extra


# --------------------------------------------------------------------------------- shared driver
def _policy_loss(batch: LossInputs, cfg: LossConfig, defaults: LossDefaults, objective: Objective) -> LossOutput:
    """l_t = w^IS_t * pg_t + regularisers, aggregated as sum_t a_t l_t / Z (see the module docstring)."""
    cfg = cfg.resolved(defaults)
    if cfg.aggregation not in defaults.aggregations:
        raise ConfigError(f"loss.aggregation={cfg.aggregation!r} is not accepted by this loss; it needs one "
                          f"of {list(defaults.aggregations)}")
    mask = batch.loss_mask.bool()  # [T]
    log_ratio = _log_ratio(batch.logprobs, batch.old_logprobs, mask)  # [T] log pi/pi_old
    pg, metrics = objective(batch, cfg, log_ratio, mask)  # [T]
    is_weight, is_metrics = importance_weights(batch, cfg, mask)  # [T], no gradient
    per_token = torch.where(mask, pg * is_weight + _regularisers(batch, cfg, mask, metrics), 0.0)  # [T]
    weights = _token_weights(batch, cfg, mask)  # [T]
    loss = (per_token * weights).sum() / _global_normaliser(batch, cfg, per_token)  # []
    ratio = torch.exp(log_ratio)  # [T]
    metrics.update(is_metrics, **_masked_stats(ratio, mask, "ratio"),
                   approx_kl=_masked_mean(ratio - 1.0 - log_ratio, mask), num_tokens=mask.sum().float())
    return LossOutput(loss=loss, metrics=metrics)


def _advantages(batch: LossInputs, mask: Tensor) -> Tensor:
    return torch.where(mask, batch.advantages.float(), 0.0)  # [T]


def _clip_surrogate(ratio: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig) -> tuple[Tensor, dict]:
    """[T] PPO clipped surrogate max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), dual-clipped at -A c for A < 0."""
    unclipped = -adv * ratio  # [T]
    clipped = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)  # [T]
    is_clipped = clipped > unclipped  # [T] clip region: the constant branch wins, zero gradient
    loss = torch.where(is_clipped, clipped, unclipped)
    metrics = {"clip_fraction": _masked_mean(is_clipped.float(), mask)}
    if cfg.dual_clip is not None:
        cap = -adv * cfg.dual_clip  # [T]
        capped = (adv < 0) & (loss > cap)  # [T] dual-clip region: zero gradient
        loss = torch.where(capped, cap, loss)
        metrics["dual_clip_fraction"] = _masked_mean(capped.float(), mask)
    return loss, metrics


# ------------------------------------------------------------------------------------- objectives
def _ppo_objective(batch: LossInputs, cfg: LossConfig, log_ratio: Tensor, mask: Tensor):
    return _clip_surrogate(torch.exp(log_ratio), _advantages(batch, mask), mask, cfg)


def _gspo_objective(batch: LossInputs, cfg: LossConfig, log_ratio: Tensor, mask: Tensor):
    """GSPO-token form: value s_i = exp(mean_t log r_t) per sample, gradient s_i * grad log pi_t per token."""
    ids, n = _dense_ids(batch.sample_index)
    counts = _segment_sum(mask.float(), ids, n).clamp(min=1)  # [S]
    seq_log_ratio = (_segment_sum(log_ratio, ids, n) / counts)[ids]  # [T] the sample's mean log-ratio
    token_log_ratio = seq_log_ratio.detach() + log_ratio - log_ratio.detach()  # [T]
    loss, metrics = _clip_surrogate(torch.exp(token_log_ratio), _advantages(batch, mask), mask, cfg)
    metrics.update(_masked_stats(torch.exp(seq_log_ratio), mask, "seq_ratio"))
    return loss, metrics


def _cispo_objective(batch: LossInputs, cfg: LossConfig, log_ratio: Tensor, mask: Tensor):
    """-sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi: clipped tokens keep their gradient, only capped."""
    ratio = torch.exp(log_ratio).detach()  # [T]
    weight = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)  # [T] stop-gradient
    logp = torch.where(mask, batch.logprobs.float(), 0.0)  # [T]
    loss = -weight * _advantages(batch, mask) * logp
    return loss, {"clip_fraction": _masked_mean((weight != ratio).float(), mask)}


def _reinforce_objective(batch: LossInputs, cfg: LossConfig, log_ratio: Tensor, mask: Tensor):
    """-A * log pi (vanilla policy gradient; gradient equals PPO's at ratio 1)."""
    logp = torch.where(mask, batch.logprobs.float(), 0.0)  # [T]
    return -_advantages(batch, mask) * logp, {"clip_fraction": torch.zeros((), device=logp.device)}


# ------------------------------------------------------------------------------------- the registry
@register_loss("ppo")
def ppo_loss(batch: LossInputs, cfg: LossConfig) -> LossOutput:
    """PPO-clip (Schulman et al. 2017), optional dual clip (Ye et al. 2020); token-mean by default."""
    return _policy_loss(batch, cfg, ppo_loss.loss_defaults, _ppo_objective)


@register_loss("grpo", LossDefaults(aggregation="seq-mean-token-mean"))
def grpo_loss(batch: LossInputs, cfg: LossConfig) -> LossOutput:
    """GRPO (Shao et al. 2024): PPO-clip on group-normalised advantages, KL-to-reference as a loss term
    (kl_coef, k3), mean over samples of per-sample token means."""
    return _policy_loss(batch, cfg, grpo_loss.loss_defaults, _ppo_objective)


@register_loss("dr_grpo", LossDefaults(aggregation="constant", aggregations=("constant",)))
def dr_grpo_loss(batch: LossInputs, cfg: LossConfig) -> LossOutput:
    """Dr.GRPO (Liu et al. 2025): GRPO without length normalisation: token sum / (loss_constant * samples).
    Pair it with AdvantageConfig(name='grpo', scale_by_std=False)."""
    return _policy_loss(batch, cfg, dr_grpo_loss.loss_defaults, _ppo_objective)


@register_loss("dapo", LossDefaults(aggregations=("token-mean",), eps_high=0.28))
def dapo_loss(batch: LossInputs, cfg: LossConfig) -> LossOutput:
    """DAPO (Yu et al. 2025): PPO-clip with clip-higher (eps_low 0.2, eps_high 0.28), token-mean over the batch."""
    return _policy_loss(batch, cfg, dapo_loss.loss_defaults, _ppo_objective)


@register_loss("gspo", LossDefaults(aggregation="seq-mean-token-mean", aggregations=("seq-mean-token-mean",),
                                    eps_low=3e-4, eps_high=4e-4))
def gspo_loss(batch: LossInputs, cfg: LossConfig) -> LossOutput:
    """GSPO (Zheng et al. 2025): sequence ratio s_i = exp(mean per-sample log-ratio), clipped; mean over samples."""
    return _policy_loss(batch, cfg, gspo_loss.loss_defaults, _gspo_objective)


@register_loss("cispo", LossDefaults(eps_low=1.0, eps_high=1.0))
def cispo_loss(batch: LossInputs, cfg: LossConfig) -> LossOutput:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r)) * A * log pi, token-mean; by default no lower bound, weight <= 2."""
    return _policy_loss(batch, cfg, cispo_loss.loss_defaults, _cispo_objective)


@register_loss("reinforce")
def reinforce_loss(batch: LossInputs, cfg: LossConfig) -> LossOutput:
    """REINFORCE / RLOO-style vanilla policy gradient -A * log pi (advantages from rloo, reinforce++, grpo)."""
    return _policy_loss(batch, cfg, reinforce_loss.loss_defaults, _reinforce_objective)
