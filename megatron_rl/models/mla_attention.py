"""Megatron-Core's local DotProductAttention for multi-latent attention (local, non-TE layer spec).

Megatron-Core 0.16's MLASelfAttention builds its core attention with `k_channels` (qk_head_dim +
qk_pos_emb_head_dim) and `v_channels` (v_head_dim), which only TE's attention accepts; the local
`DotProductAttention` computes with any query/key and value head sizes (it reshapes with -1) but sizes its
output from `kv_channels`. This subclass takes the two sizes and sizes the output by `v_channels`; the
attention itself (scores, mask, softmax, dropout) is Megatron's, unchanged. No parameters of its own.
"""
from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    """DotProductAttention with MLA's query/key (`k_channels`) and value (`v_channels`) head sizes."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        self.k_channels = k_channels
