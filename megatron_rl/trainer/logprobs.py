"""Per-token log-probs of given targets and per-token entropy from vocab-parallel logits, exact under TP.

    logprobs, entropy = token_logprobs_and_entropy(logits, targets, tp_group, temperature, chunk_size)

`logits` is [..., V/tp] (this rank's vocabulary slice, as Megatron's output layer leaves it with
parallel_output=True), or a pair (hidden [..., h], output weight [V/tp, h]) from which the logits are formed
chunk by chunk. With temperature tau the distribution is softmax(z / tau) over the FULL vocabulary:
the maximum and the sum of exponentials are all-reduced over `tp_group` (passed explicitly; None = one rank).

Memory: tokens are processed `chunk_size` at a time, so the fp32 copy of the logits (and their
exponentials) exists for one chunk only; the backward pass recomputes them per chunk from the saved input
and two fp32 numbers per token (log Z and E_p[z/tau]). No collective runs in the backward pass for the logits
input; for the hidden-state input the hidden gradient is all-reduced over TP (as a column-parallel layer does).

Gradients (z' = z / tau, p = softmax(z')):
    d log p_t / dz'_j = 1[j = t] - p_j          dH / dz'_j = -p_j (z'_j - E_p[z'])
This module is the boundary a fused (Triton) kernel will replace later; keep its signature.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _tp(group) -> tuple[int, int]:
    """(rank, size) of this process in the TP group; (0, 1) without one."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _chunk_stats(z: Tensor, targets: Tensor, vocab_start: int, group) -> tuple[Tensor, Tensor, Tensor]:
    """For fp32 scaled logits z [c, Vp] and global target ids [c]: (log Z [c], z'_target [c], E_p[z'] [c])."""
    vp = z.shape[-1]
    m = z.max(dim=-1).values  # [c] local max
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - m[:, None])  # [c, Vp]
    local = targets - vocab_start  # [c]
    mine = (local >= 0) & (local < vp)  # [c] this rank holds the target's logit
    z_t = torch.where(mine, z.gather(1, local.clamp(0, vp - 1)[:, None])[:, 0], 0.0)  # [c]
    sums = torch.stack([e.sum(-1), z_t, (e * z).sum(-1)])  # [3, c]
    if group is not None:
        dist.all_reduce(sums, group=group)
    s, z_t, ez = sums  # each [c]
    return m + torch.log(s), z_t, ez / s


def _chunk_grad(z: Tensor, targets: Tensor, vocab_start: int, log_z: Tensor, mean_z: Tensor,
                g_lp: Tensor, g_ent: Tensor | None, temperature: float) -> Tensor:
    """d(loss)/d(raw logits) [c, Vp] in fp32 for scaled logits z [c, Vp] and the outputs' grads [c]."""
    vp = z.shape[-1]
    p = torch.exp(z - log_z[:, None])  # [c, Vp]
    grad = -p * g_lp[:, None]  # [c, Vp]
    if g_ent is not None:
        grad -= p * (z - mean_z[:, None]) * g_ent[:, None]
    local = targets - vocab_start  # [c]
    mine = (local >= 0) & (local < vp)  # [c]
    rows = torch.nonzero(mine)[:, 0]  # [c']
    grad[rows, local[rows]] += g_lp[rows]
    return grad / temperature


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _chunks(n: int, chunk_size: int | None) -> list[tuple[int, int]]:
    step = n if not chunk_size or chunk_size >= n else chunk_size
    return [(s, min(s + step, n)) for s in range(0, n, max(step, 1))]


class _LogitsLogprobs(torch.autograd.Function):
    """(logits [N, Vp], targets [N]) -> (log p(target) [N], entropy [N]), fp32 (fp64 input: fp64), chunked."""

    @staticmethod
    def forward(ctx, logits, targets, group, temperature, chunk_size):
        rank, _ = _tp(group)
        vocab_start = rank * logits.shape[-1]
        n = logits.shape[0]
        acc = _acc(logits.dtype)
        log_z, mean_z, z_t = (logits.new_empty(n, dtype=acc) for _ in range(3))  # each [N]
        for s, e in _chunks(n, chunk_size):
            z = logits[s:e].to(acc) / temperature  # [c, Vp]
            log_z[s:e], z_t[s:e], mean_z[s:e] = _chunk_stats(z, targets[s:e], vocab_start, group)
        ctx.save_for_backward(logits, targets, log_z, mean_z)
        ctx.meta = (vocab_start, temperature, chunk_size)
        return z_t - log_z, log_z - mean_z

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, targets, log_z, mean_z = ctx.saved_tensors
        vocab_start, temperature, chunk_size = ctx.meta
        grad = torch.empty_like(logits)  # [N, Vp]
        g_lp = torch.zeros_like(log_z) if g_lp is None else g_lp.to(log_z.dtype)
        g_ent = None if g_ent is None else g_ent.to(log_z.dtype)
        for s, e in _chunks(logits.shape[0], chunk_size):
            z = logits[s:e].to(log_z.dtype) / temperature  # [c, Vp]
            grad[s:e] = _chunk_grad(z, targets[s:e], vocab_start, log_z[s:e], mean_z[s:e], g_lp[s:e],
                                    None if g_ent is None else g_ent[s:e], temperature).to(logits.dtype)
        return grad, None, None, None, None


class _HiddenLogprobs(torch.autograd.Function):
    """(hidden [N, h], weight [Vp, h], targets [N]) -> (log p [N], entropy [N]); logits formed per chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, temperature, chunk_size):
        rank, _ = _tp(group)
        vocab_start = rank * weight.shape[0]
        n = hidden.shape[0]
        acc = _acc(hidden.dtype)
        log_z, mean_z, z_t = (hidden.new_empty(n, dtype=acc) for _ in range(3))  # each [N]
        for s, e in _chunks(n, chunk_size):
            z = (hidden[s:e] @ weight.t()).to(acc) / temperature  # [c, Vp]
            log_z[s:e], z_t[s:e], mean_z[s:e] = _chunk_stats(z, targets[s:e], vocab_start, group)
        ctx.save_for_backward(hidden, weight, targets, log_z, mean_z)
        ctx.meta = (vocab_start, temperature, chunk_size, group)
        return z_t - log_z, log_z - mean_z

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, log_z, mean_z = ctx.saved_tensors
        vocab_start, temperature, chunk_size, group = ctx.meta
        acc = log_z.dtype
        g_hidden, g_weight = torch.empty_like(hidden), torch.zeros_like(weight, dtype=acc)
        g_lp = torch.zeros_like(log_z) if g_lp is None else g_lp.to(acc)
        g_ent = None if g_ent is None else g_ent.to(acc)
        for s, e in _chunks(hidden.shape[0], chunk_size):
            z = (hidden[s:e] @ weight.t()).to(acc) / temperature  # [c, Vp]
            gz = _chunk_grad(z, targets[s:e], vocab_start, log_z[s:e], mean_z[s:e], g_lp[s:e],
                             None if g_ent is None else g_ent[s:e], temperature)  # [c, Vp] fp32 (fp64)
            g_hidden[s:e] = (gz @ weight.to(acc)).to(hidden.dtype)  # [c, h]
            g_weight += gz.t() @ hidden[s:e].to(acc)  # [Vp, h]
        if _tp(group)[1] > 1:
            dist.all_reduce(g_hidden, group=group)  # the hidden state feeds every rank's vocabulary slice
        return g_hidden, g_weight.to(weight.dtype), None, None, None, None


def token_logprobs_and_entropy(logits_or_hidden: Tensor | tuple[Tensor, Tensor], targets: Tensor, tp_group=None,
                               temperature: float = 1.0, chunk_size: int | None = None) -> tuple[Tensor, Tensor]:
    """log p(targets) and the entropy of softmax(logits / temperature) over the full (TP-split) vocabulary.

    logits_or_hidden: logits [..., V/tp], or (hidden [..., h], output weight [V/tp, h]).
    targets: [...] global token ids (each must lie in [0, V)). Returns two fp32 (fp64 for fp64 input) tensors
    shaped like targets,
    differentiable with respect to the logits (or hidden and weight). chunk_size: tokens per chunk (None/0 = all).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    group = tp_group if _tp(tp_group)[1] > 1 else None
    shape, flat_t = targets.shape, targets.reshape(-1).long()  # [N]
    if isinstance(logits_or_hidden, (tuple, list)):
        hidden, weight = logits_or_hidden
        lp, ent = _HiddenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, flat_t, group,
                                        float(temperature), chunk_size)
    else:
        logits = logits_or_hidden
        if logits.shape[:-1] != shape:
            raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(shape)} disagree on [...]")
        lp, ent = _LogitsLogprobs.apply(logits.reshape(-1, logits.shape[-1]), flat_t, group,
                                        float(temperature), chunk_size)
    return lp.view(shape), ent.view(shape)


def naive_logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Reference on full logits [..., V]: log_softmax gather and -sum p log p (for tests)."""
    logp = torch.log_softmax(logits.to(_acc(logits.dtype)) / temperature, dim=-1)  # [..., V]
    lp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]
    return lp, -(logp.exp() * logp).sum(-1)
