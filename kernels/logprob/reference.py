"""PyTorch backend of the fused log-prob/entropy op: exact, chunked over tokens and vocab.

Peak extra memory is a few `[chunk_tokens, chunk_vocab]` fp32 buffers plus the fp32 weight gradient; the
`[T, V]` logits never exist, unless the caller asks to keep them for the backward within a byte budget
(`keep_logits_bytes`: one logits matmul less per step, where memory allows). Runs on any device; it is the
oracle for the Triton kernels.
"""
from __future__ import annotations

import torch

from megatron_rl.kernels.logprob.common import NEG, LogprobEntropyFunction, VocabSlice, acc_dtype, merge_splits


def _scaled(h_c: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """h_c [Tc, H] / temperature, so that logits come out of the matmul already scaled (one pass less)."""
    return h_c * inv_temp if inv_temp != 1.0 else h_c


def _logits(h_s: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """h_s [Tc, H] (already / temperature) @ w_v [Vc, H].T -> logits / temperature [Tc, Vc], acc_dtype."""
    return (h_s @ w_v.T).to(acc_dtype(h_s.dtype))  # [Tc, Vc] a fresh buffer


def _local_targets(targets: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets (already local ids) [Tc] -> (hit [Tc] bool: in [v0, v1), column in the chunk [Tc])."""
    hit = (targets >= v0) & (targets < v1)  # [Tc]
    return hit, torch.where(hit, targets - v0, 0)  # [Tc], [Tc]


def _chunk_stats(z: torch.Tensor, tloc: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, ...]:
    """Statistics (m, s, b, zt), [Tc] each, of one logits chunk z [Tc, Vc] (z is overwritten)."""
    hit, col = _local_targets(tloc, v0, v1)  # [Tc], [Tc]
    zt = torch.where(hit, z.gather(1, col[:, None]).squeeze(1), 0.0)  # [Tc]
    m = z.max(dim=1).values  # [Tc]
    d = z.sub_(m[:, None])  # [Tc, Vc]  z - m
    e = torch.exp(d)  # [Tc, Vc]
    s = e.sum(1)  # [Tc]
    b = d.mul_(e).sum(1)  # [Tc]  sum e * (z - m)
    return m, s, b, zt


def forward_stats(hidden, weight, targets, vocab: VocabSlice, inv_temp: float, chunk_tokens: int,
                  chunk_vocab: int, keep: list | None = None) -> tuple[torch.Tensor, ...]:
    """Local softmax statistics (m, s, b, zt), each acc_dtype [1, T], computed chunk by chunk; `keep`: a list
    that receives a copy of every logits chunk, in loop order, for `backward_grads(kept=...)`."""
    T, dtype = hidden.shape[0], acc_dtype(hidden.dtype)
    m = torch.full((T,), NEG, dtype=dtype, device=hidden.device)  # [T]
    s, b, zt = (torch.zeros(T, dtype=dtype, device=hidden.device) for _ in range(3))  # [T] each
    tloc_all = targets - vocab.start  # [T] local target ids (out of slice: <0 or >= valid)
    for t0 in range(0, T, chunk_tokens):
        sl = slice(t0, min(t0 + chunk_tokens, T))
        h_s = _scaled(hidden[sl], inv_temp)  # [Tc, H]
        for v0 in range(0, vocab.valid, chunk_vocab):
            v1 = min(v0 + chunk_vocab, vocab.valid)
            z = _logits(h_s, weight[v0:v1])  # [Tc, Vc]
            if keep is not None:
                keep.append(z.clone())  # _chunk_stats overwrites z
            parts = [torch.stack(x) for x in zip((m[sl], s[sl], b[sl], zt[sl]),
                                                 _chunk_stats(z, tloc_all[sl], v0, v1))]  # [2, Tc] each
            m[sl], s[sl], b[sl], zt[sl] = merge_splits(*parts)
    return m[None], s[None], b[None], zt[None]


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out (acc_dtype) += a @ b, in place when dtypes allow."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out.add_(a @ b)


def _grad_logits(z, lse, ent, g_lp, g_ent, tloc, v0, v1, inv_temp) -> torch.Tensor:
    """d loss / d (h @ W.T) for one chunk, from logits/temp z [Tc, Vc] (overwritten) and per-token [Tc] terms.

    d logp / dz = onehot - p,  d H / dz = -p (log p + H) = -p (z - lse + H); times 1/temp for z = logits/temp.
    Per-token factors are folded into [Tc] vectors first so the [Tc, Vc] work is 5 passes.
    """
    p = torch.sub(z, lse[:, None]).exp_()  # [Tc, Vc] softmax
    a = g_ent * -inv_temp  # [Tc]
    c = (g_lp + g_ent * (ent - lse)) * -inv_temp  # [Tc]
    dz = z.mul_(a[:, None]).add_(c[:, None]).mul_(p)  # [Tc, Vc] -p (g_lp + g_ent (z - lse + H)) / temp
    hit, col = _local_targets(tloc, v0, v1)  # [Tc], [Tc]
    rows = hit.nonzero().squeeze(1)  # [n_hit]
    dz.index_put_((rows, col[rows]), g_lp[rows] * inv_temp, accumulate=True)
    return dz


def backward_grads(hidden, weight, targets, lse, ent, g_lp, g_ent, vocab: VocabSlice, inv_temp: float,
                   chunk_tokens: int, chunk_vocab: int, kept: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden [T, H], grad_weight [V_local, H]) in acc_dtype from this rank's slice, recomputing logits
    (or taking, and overwriting, the forward's chunks `kept`)."""
    T, dtype = hidden.shape[0], acc_dtype(hidden.dtype)
    grad_h = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)  # [T, H]
    grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device)  # [V_local, H]
    tloc_all = targets - vocab.start  # [T]
    for t0 in range(0, T, chunk_tokens):
        sl = slice(t0, min(t0 + chunk_tokens, T))
        h_c = hidden[sl]  # [Tc, H]
        h_s = _scaled(h_c, inv_temp)  # [Tc, H]
        for v0 in range(0, vocab.valid, chunk_vocab):
            v1 = min(v0 + chunk_vocab, vocab.valid)
            w_v = weight[v0:v1]  # [Vc, H]
            z = kept.pop(0) if kept else _logits(h_s, w_v)  # [Tc, Vc]
            dz = _grad_logits(z, lse[sl], ent[sl], g_lp[sl], g_ent[sl], tloc_all[sl], v0, v1, inv_temp)
            dz = dz.to(hidden.dtype)  # [Tc, Vc]
            _accumulate(grad_h[sl], dz, w_v)  # [Tc, H]
            _accumulate(grad_w[v0:v1], dz.T, h_c)  # [Vc, H]
    return grad_h, grad_w


class TorchBackend:
    """The chunked PyTorch backend (see `common.Backend`)."""

    keeps_logits = True
    """forward_stats/backward_grads can hand the logits chunks over instead of recomputing them."""
    forward_stats = staticmethod(forward_stats)
    backward_grads = staticmethod(backward_grads)


def torch_logprob_entropy(hidden, weight, targets, group=None, temperature=1.0, vocab=None,
                          chunk_tokens=512, chunk_vocab=4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked reference without argument checks (use `kernels.logprob.fused_logprob_entropy`)."""
    vocab = vocab or VocabSlice(0, weight.shape[0])
    return LogprobEntropyFunction.apply(hidden, weight, targets, TorchBackend, group, temperature, vocab,
                                        chunk_tokens, chunk_vocab)


def naive_logprob_entropy(hidden, weight, targets, temperature=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-logits baseline (TP=1): materialises [T, V]; for benchmarks and small checks only."""
    logp_all = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)  # [T, V]
    logprob = logp_all.gather(1, targets[:, None]).squeeze(1)  # [T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [T]
    return logprob, entropy
