"""Multi-latent attention (DeepSeek-V3, Kimi-K2) in the rollout engine, over a paged cache of latents.

Per token the cache holds one row: the normalised kv latent (kv_lora_rank) and the RoPE'd shared key part
(qk_pos_emb_head_dim), written once (`PagedKVCache(parts=1)`). Attention up-projects the cached latents of
each sequence with the layer's own `linear_kv_up_proj` (this rank's heads) into per-head keys (+ the shared
RoPE key) and values, then runs SDPA with the layer's softmax scale (YaRN's mscale included). Queries and the
latent come from the layer's own modules in the order MLASelfAttention uses them; RoPE is Megatron's
`apply_rotary_pos_emb` with the model config (MLA de-interleaves the RoPE dims) and the layer's rotary
module (plain or YaRN). No weight absorption: every step re-projects the cached latents (simple, O(context)).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class MLAAttention:
    """The MLA pieces of ModelRunner: query/latent projections, cache rows, attention over the latents."""

    def __init__(self, model, tp_group):
        cfg = model.config
        self.cfg, self.tp_group = cfg, tp_group
        attn = model.decoder.layers[0].self_attention
        self.heads = attn.num_attention_heads_per_partition
        self.latent, self.rope_dim = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
        self.row = self.latent + self.rope_dim  # cached values per token
        self.scale = attn.softmax_scale
        self.max_len = model.max_sequence_length
        self._freqs = None

    def rope(self, attn, positions: Tensor) -> tuple[Tensor, float]:
        """(RoPE frequencies [T, 1, 1, d_rope] of `positions`, YaRN's mscale or 1.0), from the layer's module."""
        if self._freqs is None:  # every layer's rotary module is built from the same config
            out = attn.rotary_pos_emb(self.max_len)
            self._freqs = out if isinstance(out, tuple) else (out, 1.0)  # YaRN: (freqs, mscale)
        return self._freqs[0][positions], self._freqs[1]

    def query_and_row(self, attn, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, 1, H] (after the input norm) -> queries [T, np, qk + rope] and cache rows [T, 1, row]."""
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        q = self._query(attn, x).view(x.shape[0], 1, self.heads, -1)  # [T, 1, np, qk + rope]
        kv = self._gathered(attn.linear_kv_down_proj(x)[0], self.row)  # [T, 1, row]
        latent, k_pe = kv.split([self.latent, self.rope_dim], dim=-1)
        q_nope, q_pe = q.split([self.cfg.qk_head_dim, self.rope_dim], dim=-1)
        freqs, mscale = self.rope(attn, positions)  # [T, 1, 1, rope]
        q_pe = apply_rotary_pos_emb(q_pe, freqs, config=self.cfg, mscale=mscale)
        k_pe = apply_rotary_pos_emb(k_pe[:, :, None], freqs, config=self.cfg, mscale=mscale)[:, :, 0]
        row = torch.cat([attn.kv_layernorm(latent), k_pe], dim=-1)  # [T, 1, row]
        return torch.cat([q_nope, q_pe], dim=-1)[:, 0], row

    def _query(self, attn, x: Tensor) -> Tensor:
        if self.cfg.q_lora_rank is None:
            return attn.linear_q_proj(x)[0]
        q = self._gathered(attn.linear_q_down_proj(x)[0], self.cfg.q_lora_rank)
        return attn.linear_q_up_proj(attn.q_layernorm(q))[0]

    def _gathered(self, t: Tensor, width: int) -> Tensor:
        """A down projection's output at full width (column-parallel ones are split over TP ranks)."""
        if t.shape[-1] == width:
            return t
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(t, group=self.tp_group)

    def attend(self, attn, q: Tensor, rows: Tensor, mask: Tensor) -> Tensor:
        """q [S, Q, np, dq] over cached rows [S, Lk, row] -> [S, Q, np, v] (causal/padding `mask`)."""
        s, lk = rows.shape[:2]
        latent, k_pe = rows.split([self.latent, self.rope_dim], dim=-1)
        kv = attn.linear_kv_up_proj(latent)[0].view(s, lk, self.heads, -1)  # [S, Lk, np, qk + v]
        k_nope, v = kv.split([self.cfg.qk_head_dim, self.cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, self.heads, -1)], dim=-1)  # [S, Lk, np, dq]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=self.scale)  # [S, np, Q, v]
        return out.transpose(1, 2)
