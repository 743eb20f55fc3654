"""Core attention of the local (non-TE) layer spec through torch's fused `scaled_dot_product_attention`.

Megatron-Core's local `DotProductAttention` is the unfused reference: it repeats K/V for GQA, materialises the
[b, n, s, s] scores (baddbmm into a global buffer), masks and softmaxes them in separate ops and keeps the
probabilities for the backward. On a packed micro-batch (the trainer's [1, S] bins of several samples, with a
block-causal mask) it does that for all S x S pairs although only the blocks on the diagonal are visible.
Profiled on SmolLM2-135M (fp32, S = 512, 1 thread) it was ~30% of the trainer step, HF's SDPA a few percent.

`SDPADotProductAttention` subclasses Megatron's module (same constructor, config checks, parameters and
state dict) and replaces only the arithmetic of the common case:
- a block-causal mask (what `trainer.packing.block_causal_mask` builds; recognised exactly, once per mask
  tensor, since every layer gets the same one): one causal SDPA per packed segment, so the work is the sum
  of the segments' squares, not S^2;
- any other boolean mask [b|1, 1, s, s] (True = masked): one SDPA with that mask;
- no mask: causal SDPA (attn_mask_type causal) or full attention (no_mask).
GQA runs without repeating K/V (`enable_gqa`). Anything else Megatron's local attention supports and this
path does not (query-key layer scaling, a softmax offset, sliding windows, attention bias, packed THD
params, fp16, dropout while training) goes to `DotProductAttention.forward` unchanged.
Masked scores are -inf here and -10000 in Megatron's softmax: both give probability 0 in fp32 (exp(-10000)
underflows), so the outputs agree to rounding (tests/models/test_sdpa_attention.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor


def block_causal_segments(mask: Tensor) -> list[tuple[int, int]] | None:
    """The (start, end) segments of a block-causal mask [1, 1, S, S] (True = masked), or None when `mask` is
    not exactly causal inside consecutive segments and masked across them."""
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1 or mask.dtype != torch.bool:
        return None
    allowed = ~mask[0, 0]  # [S, S]
    s = allowed.shape[0]
    if allowed.shape[1] != s or not bool(allowed.diagonal().all()):
        return None
    start = allowed.int().argmax(-1)  # [S] first visible key of each query: its segment's start
    pos = torch.arange(s, device=mask.device)
    expected = (start[:, None] == start[None, :]) & (pos[None, :] <= pos[:, None])  # [S, S]
    if not torch.equal(expected, allowed):
        return None
    starts = pos[start == pos].tolist()  # queries that start their own segment
    return list(zip(starts, starts[1:] + [s]))


class SDPADotProductAttention(DotProductAttention):
    """Megatron's local core attention with torch SDPA arithmetic (see the module docstring)."""

    def _fused_ok(self, query: Tensor, key: Tensor, attention_mask, attention_bias, packed_seq_params) -> bool:
        """Whether the SDPA arithmetic computes what DotProductAttention.forward would."""
        c = self.config
        window = getattr(self.scale_mask_softmax, "window_size", None)
        dropout = self.training and self.attention_dropout.p > 0
        mask_ok = (query.shape[0] == key.shape[0] if attention_mask is None  # Megatron's default causal: sq == sk
                   else attention_mask.dtype == torch.bool)
        return (mask_ok and attention_bias is None and packed_seq_params is None and self.softmax_offset is None
                and not c.apply_query_key_layer_scaling and not c.fp16 and window is None and not dropout)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        """query [s, b, np, d], key/value [s, b, ng, d] -> context [s, b, np*d]."""
        if not self._fused_ok(query, key, attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        gqa = q.shape[1] != k.shape[1]
        if attention_mask is None:
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=gqa)  # [b, np, s, d]
        else:
            segments = _block_causal(attention_mask)
            if segments is None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
                                                     enable_gqa=gqa)  # [b, np, s, d]
            else:
                out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e],
                                                                is_causal=True, scale=self.softmax_scale,
                                                                enable_gqa=gqa)
                                 for a, e in segments], dim=2)  # [b, np, s, d]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)  # [s, b, np*d]


_last: list = [None, None]
"""The last mask seen and its segments: every layer of a forward gets the same mask tensor."""


def _block_causal(mask: Tensor) -> list[tuple[int, int]] | None:
    if mask is not _last[0]:
        _last[:] = mask, block_causal_segments(mask)
    return _last[1]
