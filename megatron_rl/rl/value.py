"""The critic's loss: clipped value regression on the response (loss-mask) tokens, and its diagnostics.

    out = value_loss(values, old_values, returns, loss_mask, clip=0.2, normaliser=z)   # all [T]

Per loss token t (PPO's value clipping, as in OpenAI baselines / OpenRLHF):
    l_t = 0.5 * max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2)
with V the critic's current prediction, V_old its prediction before the update (the one GAE used) and R the
GAE returns (value targets). clip None or 0 turns the clipped branch off (plain 0.5 * (V - R)^2). The loss is
sum_t l_t / Z with Z the loss tokens of the WHOLE global batch (token-mean; pass Z summed over micro-batches
and data-parallel ranks), so micro-batch losses add up to the global mean. Tokens off the loss mask (prompt,
environment observations between turns) contribute nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ValueLossOutput:
    """The summed-over-tokens value loss of some tokens divided by the global normaliser, and token sums."""

    loss: Tensor
    """[] sum_t l_t / Z (differentiable in the current values)."""
    metrics: dict[str, Tensor]
    """Detached SUMS over these loss tokens: value_loss_sum (of l_t), value_clip_sum (clipped tokens), tokens."""


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, clip: float | None,
               normaliser: float) -> ValueLossOutput:
    """Clipped value loss of tokens [T] (see the module docstring); `normaliser`: the global loss-token count."""
    mask = loss_mask.bool()  # [T]
    v = values.float()  # [T]
    target = torch.where(mask, returns.float(), 0.0)  # [T]
    plain = (v - target).square()  # [T]
    if clip:
        old = old_values.float().detach()  # [T]
        clipped_v = old + (v - old).clamp(-clip, clip)  # [T]
        clipped = (clipped_v - target).square()  # [T]
        per_token = 0.5 * torch.maximum(plain, clipped)  # [T]
        is_clipped = mask & (clipped > plain)  # [T] the clipped branch wins: its gradient is 0 there
    else:
        per_token, is_clipped = 0.5 * plain, torch.zeros_like(mask)
    per_token = torch.where(mask, per_token, 0.0)  # [T]
    z = max(float(normaliser), 1.0)
    return ValueLossOutput(per_token.sum() / z, {"value_loss_sum": per_token.detach().sum(),
                                                 "value_clip_sum": is_clipped.sum().float(),
                                                 "tokens": mask.sum().float()})


def explained_variance(values: Tensor, returns: Tensor, loss_mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the loss tokens [T] (1: perfect critic, 0: no better than the mean,
    < 0: worse); 0.0 when the returns have no variance (nothing to explain)."""
    mask = loss_mask.bool()
    r, v = returns.double()[mask], values.double()[mask]  # [M]
    if r.numel() < 2:
        return 0.0
    var = r.var(correction=0)
    if not float(var) > 0:
        return 0.0
    return float(1.0 - (r - v).var(correction=0) / var)
