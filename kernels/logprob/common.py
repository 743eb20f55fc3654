"""Backend-independent parts of the fused log-prob/entropy op: softmax statistics, their merge across vocab
splits and tensor-parallel ranks, and the `torch.autograd.Function` that both backends plug into.

Softmax statistics of one token over a set of vocab entries with logits z (already divided by temperature):
    m   = max z                         (any upper bound works; merges rescale)
    s   = sum exp(z - m)
    b   = sum exp(z - m) * (z - m)
    zt  = z[target] if the target is in the set, else 0
Over the whole vocab: lse = m + log s, logprob = zt - lse, entropy = log s - b / s.
Keeping b relative to m (instead of sum p*z) avoids cancellation between large logits and lse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

# A finite "minus infinity" for running maxima: exp(NEG - m) == 0 and (NEG - m) * 0 == 0, no NaNs from inf*0.
NEG = -1e30


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of logits, statistics and gradient accumulators: fp64 for fp64 inputs (gradcheck), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class VocabSlice:
    """This rank's part of the vocab: rows [start, start + valid) of the global vocab are real entries."""

    start: int
    """Global id of this rank's first weight row."""
    valid: int
    """Number of leading local rows that are real vocab entries (rows past it are padding, masked out)."""


class Backend(Protocol):
    """What a backend provides: local softmax statistics and local gradients, both without [T, V] tensors."""

    def forward_stats(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      vocab: VocabSlice, inv_temp: float, chunk_tokens: int, chunk_vocab: int
                      ) -> tuple[torch.Tensor, ...]:
        """Return (m, s, b, zt), each acc_dtype [S, T]: statistics of S disjoint vocab splits of this rank."""

    def backward_grads(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       lse: torch.Tensor, ent: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor,
                       vocab: VocabSlice, inv_temp: float, chunk_tokens: int, chunk_vocab: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (grad_hidden [T, H], grad_weight [V_local, H]) in acc_dtype, from this rank's vocab slice only."""


def rescale(m: torch.Tensor, s: torch.Tensor, b: torch.Tensor, m_new: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-express (s, b) taken relative to max m as relative to m_new >= m (all shapes equal)."""
    alpha = torch.exp(m - m_new)  # [..., T]
    return s * alpha, alpha * (b + (m - m_new) * s)


def merge_splits(m: torch.Tensor, s: torch.Tensor, b: torch.Tensor, zt: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    """Merge statistics of S disjoint vocab splits, [S, T] each, into one set, [T] each."""
    m_all = m.max(dim=0).values  # [T]
    s, b = rescale(m, s, b, m_all[None])  # [S, T]
    return m_all, s.sum(0), b.sum(0), zt.sum(0)


def merge_tp(m: torch.Tensor, s: torch.Tensor, b: torch.Tensor, zt: torch.Tensor, group
             ) -> tuple[torch.Tensor, ...]:
    """All-reduce one rank's statistics ([T] each) over the tensor-parallel `group` (identity when None)."""
    if group is None or dist.get_world_size(group) == 1:
        return m, s, b, zt
    m_all = m.clone()  # [T]
    dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
    s, b = rescale(m, s, b, m_all)  # [T]
    packed = torch.stack([s, b, zt])  # [3, T]
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return m_all, packed[0], packed[1], packed[2]


class LogprobEntropyFunction(torch.autograd.Function):
    """(hidden [T, H], weight [V_local, H], targets [T]) -> (logprob [T], entropy [T]) in acc_dtype.

    The backend computes local statistics/gradients; this class does the TP reductions. Under TP the
    grad of `hidden` is all-reduced over `group` here, so callers must NOT wrap `hidden` in Megatron's
    copy_to_tensor_model_parallel_region as well (that would all-reduce twice).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, backend, group, temperature, vocab, chunk_tokens, chunk_vocab,
                keep_bytes=0):
        inv_temp = 1.0 / temperature
        size = hidden.shape[0] * vocab.valid * torch.finfo(acc_dtype(hidden.dtype)).bits // 8
        ctx.kept = [] if getattr(backend, "keeps_logits", False) and size <= keep_bytes else None
        extra = {} if ctx.kept is None else {"keep": ctx.kept}  # the logits chunks, for the backward
        stats = backend.forward_stats(hidden, weight, targets, vocab, inv_temp, chunk_tokens, chunk_vocab, **extra)
        m, s, b, zt = merge_tp(*merge_splits(*stats), group)  # [T] each
        lse = m + torch.log(s)  # [T]
        logprob = zt - lse  # [T]
        entropy = torch.log(s) - b / s  # [T]
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.args = (backend, group, vocab, inv_temp, chunk_tokens, chunk_vocab)
        return logprob, entropy

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        backend, group, vocab, inv_temp, chunk_tokens, chunk_vocab = ctx.args
        extra = {} if ctx.kept is None else {"kept": ctx.kept}
        ctx.kept = None  # used up (overwritten): a second backward recomputes
        grad_h, grad_w = backend.backward_grads(
            hidden, weight, targets, lse, entropy, g_lp.to(lse.dtype).contiguous(), g_ent.to(lse.dtype).contiguous(),
            vocab, inv_temp, chunk_tokens, chunk_vocab, **extra)  # [T, H], [V_local, H] acc_dtype
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=group)  # each rank saw a vocab slice
        grad_h = grad_h.to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None
