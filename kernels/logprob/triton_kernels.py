"""Triton backend of the fused log-prob/entropy op (GPU; on CPU only under TRITON_INTERPRET=1).

Forward: a grid of (token block, vocab chunk) programs. Each program walks its vocab chunk in tiles of
BLOCK_V, computes the logits tile [BLOCK_T, BLOCK_V] with tl.dot over tiles of H, and keeps an online softmax
(running max m, sum-exp s, b = sum exp(z - m)(z - m), target logit). The host merges the per-chunk statistics
and reduces them over TP (`common.merge_splits` / `merge_tp`).

Backward: a grid of (token block, vocab tile) programs. Each recomputes its logits tile, forms
d loss / d logits from (lse, entropy, upstream grads), and adds dz @ W_tile into grad_h and dz.T @ h_tile into
grad_W with fp32 atomics, tile by tile over H. Atomics make the fp32 summation order (and thus the last bits)
non-deterministic on GPU, and their traffic (T*H*V/BLOCK_V + V*H*T/BLOCK_T adds) is the known cost of this
design; not yet profiled on a GPU.

The `[T, V]` logits are never stored: extra memory is O(T * V / chunk_vocab) for the statistics plus the fp32
gradient buffers.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from megatron_rl.kernels.logprob.common import VocabSlice

# GPU tile sizes (H100/H200 class); each is shrunk to the problem (>= 16, tl.dot's minimum).
BLOCK_T, BLOCK_V, BLOCK_H = 64, 128, 64


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read when the kernels below are defined


def interpreting() -> bool:
    """True when Triton runs these kernels with numpy on CPU tensors (TRITON_INTERPRET=1 at import time)."""
    return _INTERPRET


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_temp, stride_ht, stride_hh, stride_wv,
                 stride_wh, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Logits / temperature for rows x cols: [BLOCK_T, BLOCK_V] fp32 (0 where a row or column is out of range)."""
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)  # [BT, BV]
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)  # [BH]
        k_ok = ks < H
        h = tl.load(h_ptr + rows[:, None] * stride_ht + ks[None, :] * stride_hh,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BT, BH]
        w = tl.load(w_ptr + cols[None, :] * stride_wv + ks[:, None] * stride_wh,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BH, BV]  (W tile, transposed)
        if UPCAST:  # interpreter only: its bf16/fp16 tl.dot is wrong; upcasting is exact (products fit fp32)
            h, w = h.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)  # [BT, BV]
    return acc * inv_temp


@triton.jit
def _fwd_kernel(h_ptr, w_ptr, tgt_ptr, m_ptr, s_ptr, b_ptr, zt_ptr, T, H, V, vocab_start, inv_temp,
                stride_ht, stride_hh, stride_wv, stride_wh,
                CHUNK_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    row_ok = rows < T
    tloc = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - vocab_start  # [BT] local target id
    m = tl.full([BLOCK_T], -1e30, dtype=tl.float32)  # [BT] running max (finite: see common.NEG)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)  # [BT] sum exp(z - m)
    b = tl.zeros([BLOCK_T], dtype=tl.float32)  # [BT] sum exp(z - m) (z - m)
    zt = tl.zeros([BLOCK_T], dtype=tl.float32)  # [BT] target logit (0 if not in this chunk)
    for v0 in range(0, CHUNK_V, BLOCK_V):
        cols = pid_v * CHUNK_V + v0 + tl.arange(0, BLOCK_V)  # [BV]
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_temp, stride_ht, stride_hh,
                         stride_wv, stride_wh, BLOCK_T, BLOCK_V, BLOCK_H, PRECISION, UPCAST)  # [BT, BV]
        is_tgt = (cols[None, :] == tloc[:, None]) & col_ok[None, :]  # [BT, BV]
        zt += tl.sum(tl.where(is_tgt, z, 0.0), axis=1)
        z = tl.where(col_ok[None, :], z, float("-inf"))  # [BT, BV]
        m_new = tl.maximum(m, tl.max(z, axis=1))  # [BT]
        alpha = tl.exp(m - m_new)  # [BT]
        d = z - m_new[:, None]  # [BT, BV]
        e = tl.exp(d)  # [BT, BV]  (0 on masked columns)
        b = alpha * (b + (m - m_new) * s) + tl.sum(tl.where(col_ok[None, :], e * d, 0.0), axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
    out = pid_v * T + rows  # [BT] offsets into the [S, T] statistics
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(b_ptr + out, b, mask=row_ok)
    tl.store(zt_ptr + out, zt, mask=row_ok)


@triton.jit
def _bwd_kernel(h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, gh_ptr, gw_ptr,
                T, H, V, vocab_start, inv_temp, stride_ht, stride_hh, stride_wv, stride_wh,
                BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV]
    row_ok = rows < T
    col_ok = cols < V
    z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, inv_temp, stride_ht, stride_hh,
                     stride_wv, stride_wh, BLOCK_T, BLOCK_V, BLOCK_H, PRECISION, UPCAST)  # [BT, BV]
    tloc = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - vocab_start  # [BT]
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)  # [BT]
    ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)  # [BT]
    g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)  # [BT]
    g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)  # [BT]
    ok = row_ok[:, None] & col_ok[None, :]  # [BT, BV]
    p = tl.where(ok, tl.exp(z - lse[:, None]), 0.0)  # [BT, BV] softmax
    # d logp/dz = onehot - p ; d H/dz = -p (z - lse + H)
    dz = -p * (g_lp[:, None] + g_ent[:, None] * (z - lse[:, None] + ent[:, None]))  # [BT, BV]
    dz += tl.where((cols[None, :] == tloc[:, None]) & ok, g_lp[:, None], 0.0)
    dz = (dz * inv_temp).to(w_ptr.dtype.element_ty)  # [BT, BV] d loss / d (h @ W.T), in the input dtype
    if UPCAST:
        dz = dz.to(tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)  # [BH]
        k_ok = ks < H
        w = tl.load(w_ptr + cols[:, None] * stride_wv + ks[None, :] * stride_wh,
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BV, BH]
        h = tl.load(h_ptr + rows[:, None] * stride_ht + ks[None, :] * stride_hh,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BT, BH]
        if UPCAST:
            w, h = w.to(tl.float32), h.to(tl.float32)
        gh = tl.dot(dz, w, input_precision=PRECISION)  # [BT, BH]
        gw = tl.dot(tl.trans(dz), h, input_precision=PRECISION)  # [BV, BH]
        tl.atomic_add(gh_ptr + rows[:, None] * H + ks[None, :], gh, mask=row_ok[:, None] & k_ok[None, :])
        tl.atomic_add(gw_ptr + cols[:, None] * H + ks[None, :], gw, mask=col_ok[:, None] & k_ok[None, :])


def _block(default: int, dim: int) -> int:
    """Tile size: the default, shrunk to the next power of two >= dim, at least 16."""
    return max(16, min(default, triton.next_power_of_2(dim)))


def _precision(dtype: torch.dtype) -> str:
    """fp32 dots in full precision unless torch allows TF32 for matmuls (torch's own default is off)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _kernel_flags(dtype: torch.dtype) -> dict:
    """Constexpr flags shared by both kernels."""
    return dict(PRECISION=_precision(dtype), UPCAST=interpreting() and dtype != torch.float32)


def _check_device(hidden: torch.Tensor) -> None:
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"impl='triton' supports fp32/bf16/fp16 inputs, got {hidden.dtype}; use impl='torch'")
    if not hidden.is_cuda and not interpreting():
        raise RuntimeError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported "
                           "(CPU interpreter, for tests); use impl='torch' on CPU")


def forward_stats(hidden, weight, targets, vocab: VocabSlice, inv_temp: float, chunk_tokens: int,
                  chunk_vocab: int) -> tuple[torch.Tensor, ...]:
    """Local statistics (m, s, b, zt), each fp32 [S, T], S = ceil(valid vocab / chunk_vocab).

    `chunk_tokens` is unused: token blocks are BLOCK_T and nothing per token-chunk is stored.
    """
    _check_device(hidden)
    T, H = hidden.shape
    targets = targets.contiguous()  # [T]
    bt, bh = _block(BLOCK_T, T), _block(BLOCK_H, H)
    bv = _block(BLOCK_V, min(chunk_vocab, vocab.valid))
    chunk = triton.cdiv(chunk_vocab, bv) * bv  # a whole number of vocab tiles
    n_split = max(1, triton.cdiv(vocab.valid, chunk))
    stats = torch.empty((4, n_split, T), dtype=torch.float32, device=hidden.device)  # [4, S, T]
    grid = (triton.cdiv(T, bt), n_split)
    _fwd_kernel[grid](hidden, weight, targets, stats[0], stats[1], stats[2], stats[3], T, H, vocab.valid,
                      vocab.start, inv_temp, hidden.stride(0), hidden.stride(1), weight.stride(0),
                      weight.stride(1), CHUNK_V=chunk, BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh,
                      **_kernel_flags(hidden.dtype))
    return stats[0], stats[1], stats[2], stats[3]


def backward_grads(hidden, weight, targets, lse, ent, g_lp, g_ent, vocab: VocabSlice, inv_temp: float,
                   chunk_tokens: int, chunk_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_hidden [T, H], grad_weight [V_local, H]) fp32 from this rank's slice; chunk sizes unused."""
    _check_device(hidden)
    T, H = hidden.shape
    grad_h = torch.zeros((T, H), dtype=torch.float32, device=hidden.device)  # [T, H]
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # [V_local, H]
    if vocab.valid == 0:
        return grad_h, grad_w
    targets = targets.contiguous()  # [T]
    bt, bv, bh = _block(BLOCK_T, T), _block(BLOCK_V, vocab.valid), _block(BLOCK_H, H)
    grid = (triton.cdiv(T, bt), triton.cdiv(vocab.valid, bv))
    _bwd_kernel[grid](hidden, weight, targets, lse, ent, g_lp, g_ent, grad_h, grad_w, T, H, vocab.valid,
                      vocab.start, inv_temp, hidden.stride(0), hidden.stride(1), weight.stride(0),
                      weight.stride(1), BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, **_kernel_flags(hidden.dtype))
    return grad_h, grad_w


class TritonBackend:
    """The Triton backend (see `common.Backend`)."""

    forward_stats = staticmethod(forward_stats)
    backward_grads = staticmethod(backward_grads)
