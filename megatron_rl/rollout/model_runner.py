"""One forward of the trainer's own Megatron `GPTModel` over a packed mixed prefill/decode batch.

The runner drives the model's submodules in the order `GPTModel.forward` / `TransformerLayer.forward` use
them (embedding, then per layer: input norm, QKV projection [+ q/k norm], RoPE, attention, output
projection, residual, pre-MLP norm, MLP, residual; final norm, output layer) with the same parameters and
names as the trainer. Only the core attention (which has no parameters) is replaced: K/V of the new tokens
are written into the paged cache and each sequence attends to its own blocks: per layer one `index_select`
of the group's block tables gathers K/V, then `scaled_dot_product_attention` with `enable_gqa` (no head
repeat) and a visibility mask built once per step (all decode sequences in one call, each prefill chunk in
its own). RoPE's cos/sin are tabulated once for all positions and indexed once per step (Megatron's unfused
RoPE arithmetic on the same values, not cos/sin recomputed twice per layer). Tensor parallelism works
as in training: column/row-parallel linears communicate inside the Megatron modules; the vocab-parallel
logits of the sampled rows are all-gathered over the TP group passed in.

Supports the dense local (non-TE) spec with RoPE or learned positions, GQA, qk-norm and QKV bias, and
multi-latent attention over a cache of compressed latents (DeepSeek-V3, Kimi-K2: `mla_runner.py`); MoE MLPs
run through `layer.mlp` unchanged. Packed tokens use the [T, 1, H] layout (sequence-first, batch 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_rl.rollout.kv_cache import PagedKVCache


@dataclass
class AttnGroup:
    """Sequences attended to together: all decode sequences (one query each) form one group, each prefill
    chunk its own (its queries are consecutive in the packed batch)."""

    token_index: Tensor
    """[S] packed index of each decode query, or [2] (first, end) packed range of a prefill chunk."""
    decode: bool
    """One query per sequence (S sequences) or one sequence with Q consecutive queries."""
    tables: Tensor
    """[S * nb] block tables flattened, padded with block 0 (masked out)."""
    mask: Tensor
    """[S, 1, Q, nb*bs] True where the key position is visible to the query (causal and inside the cache)."""


@dataclass
class Batch:
    """Inputs of one engine step."""

    tokens: Tensor
    """[T] token ids, sequences packed one after the other."""
    positions: Tensor
    """[T] position of each token within its sequence."""
    slots: Tensor
    """[T] flat KV-cache slot of each token."""
    groups: list[AttnGroup]
    """Attention groups covering every token once."""
    sample_rows: Tensor
    """[R] packed indices whose logits are returned (the last token of sequences that sample)."""


def check_servable(model_cfg) -> None:
    """Refuse (ConfigError, before any rank starts) a model this engine cannot serve."""
    from megatron_rl.config import ConfigError

    if model_cfg.mla.enabled and model_cfg.transformer_impl != "local":
        raise ConfigError("model.mla with model.transformer_impl=transformer_engine: the rollout engine serves "
                          "multi-latent attention with the local layer spec only (not checked with TE's modules)")


class ModelRunner:
    """Runs a `GPTModel` (one pipeline stage holding the whole model) over paged batches."""

    def __init__(self, model, tp_group=None, cp_group=None):
        if getattr(model.config, "window_size", None):
            raise ValueError(f"rollout engine: sliding-window attention (window_size={model.config.window_size}) "
                             f"is not supported by the paged attention yet; serve a full-attention model")
        self.model = model.eval()
        self.tp_group = tp_group if tp_group is not None and dist.is_initialized() and tp_group.size() > 1 else None
        self.cp_group = cp_group
        self.layers = list(model.decoder.layers)
        attn = self.layers[0].self_attention
        self.heads = attn.num_attention_heads_per_partition
        self.kv_heads = attn.num_query_groups_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        self.scale = model.config.softmax_scale or self.head_dim ** -0.5
        self._freqs = None
        self._cos_sin: tuple[Tensor, Tensor] | None = None  # RoPE cos, sin [max, 1, 1, d] (`_rope`)
        self.mla = None
        if getattr(model.config, "multi_latent_attention", False):  # one cached latent row per token
            from megatron_rl.rollout.mla_runner import MLAAttention

            self.mla = MLAAttention(model, self.tp_group)
            self.kv_heads, self.head_dim = 1, self.mla.row
        self.replays: list = []
        """Routing replay hooks of the MoE routers when routes are recorded (`record_routes`)."""
        self.last_routes: Tensor | None = None
        """[T, L_moe, k] int16 experts of each packed token of the last forward (when recording)."""

    def record_routes(self, moe_layers: list[int]) -> None:
        """Record every token's experts per MoE layer in each forward (routing replay, models/routing_replay)."""
        from megatron_rl.models.routing_replay import attach

        self.replays = attach(self.model, moe_layers)
        if not self.replays:
            raise ValueError("routing replay: the model has no MoE layer to record (set model.moe.num_experts)")

    def make_cache(self, num_blocks: int, block_size: int, device=None) -> PagedKVCache:
        """The paged KV pool in the model's dtype, on `device` (the rank's: its GPU under NCCL; None: the
        model's device); the engine's batches follow it (`PagedKVCache.device`)."""
        ref = next(self.model.parameters())
        cache = PagedKVCache(len(self.layers), num_blocks, block_size, self.kv_heads, self.head_dim, ref.dtype,
                             device=ref.device if device is None else device, parts=1 if self.mla else 2)
        if self.replays:
            cache.enable_routes(len(self.replays), self.model.config.moe_router_topk)
        return cache

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor] | Tensor | None:
        """RoPE of the positions for every layer of a step: (cos, sin) [T, 1, 1, d] as Megatron's unfused RoPE
        forms them, `(cos(freqs) * mscale).to(dtype)` (YaRN's mscale, else 1), tabulated once for all
        positions instead of twice per layer and step; the frequencies [T, 1, 1, d] where Megatron's fused
        RoPE applies (`apply_rope_fusion`); None for learned positions."""
        if getattr(self.model, "rotary_pos_emb", None) is None:
            return None
        if self._freqs is None:
            from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
                _yarn_get_concentration_factor_from_config as yarn_mscale,
            )

            freqs = self.model.rotary_pos_emb(self.model.max_sequence_length)  # [max, 1, 1, d]
            self._freqs = freqs[0] if isinstance(freqs, tuple) else freqs  # YaRN: (freqs, mscale)
            mscale, dtype = yarn_mscale(self.model.config), next(self.model.parameters()).dtype
            self._cos_sin = ((torch.cos(self._freqs) * mscale).to(dtype), (torch.sin(self._freqs) * mscale).to(dtype))
        if self.model.config.apply_rope_fusion:
            return self._freqs[positions]
        return self._cos_sin[0][positions], self._cos_sin[1][positions]  # each [T, 1, 1, d]

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: PagedKVCache) -> Tensor:
        """fp32 logits [R, V] (full vocabulary) of `batch.sample_rows`.

        Torch-function modes (the CPU compat layer's CUDA->CPU remapping) are off inside: this path
        places nothing on CUDA, and the mode's Python hook on every op cost ~2x the step time on CPU.
        """
        from megatron_rl.compat.device_check import modes_off

        with modes_off():  # (kept on under the CPU device check, which follows placements through them)
            return self._forward(batch, cache)

    def _forward(self, batch: Batch, cache: PagedKVCache) -> Tensor:
        from megatron_rl.models.routing_replay import record, recorded

        m = self.model
        h = m.embedding(input_ids=batch.tokens[None], position_ids=batch.positions[None])  # [T, 1, H]
        freqs = self._rope(batch.positions)
        record(self.replays)
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, freqs, batch, cache)
        if self.replays:
            self.last_routes = recorded(self.replays)  # [T, L_moe, k]
        h = m.decoder.final_layernorm(h[batch.sample_rows])  # [R, 1, H]
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(h, weight=weight)  # [R, 1, V/tp]
        return self._gather_vocab(logits[:, 0].float())

    def _layer(self, i: int, layer, h: Tensor, freqs: Tensor | None, batch: Batch, cache: PagedKVCache) -> Tensor:
        """One TransformerLayer on packed hidden states [T, 1, H] -> [T, 1, H]."""
        attn = layer.self_attention
        if self.mla is not None:
            q, row = self.mla.query_and_row(attn, layer.input_layernorm(h), batch.positions)  # [T,np,dq] [T,1,r]
            cache.write(i, batch.slots, row, None)
            ctx = self._attention(i, q, batch, cache, attn)  # [T, np*v]
        else:
            q, k, v = attn.get_query_key_value_tensors(layer.input_layernorm(h), None)  # [T,1,np,d] [T,1,ng,d] x2
            if freqs is not None:
                q, k = self._apply_rope(q, freqs), self._apply_rope(k, freqs)
            cache.write(i, batch.slots, k[:, 0], v[:, 0])
            ctx = self._attention(i, q[:, 0], batch, cache)  # [T, np*d]
        out, bias = attn.linear_proj(ctx[:, None])  # [T, 1, H]
        h = h + (out if bias is None else out + bias)
        out, bias = layer.mlp(layer.pre_mlp_layernorm(h))  # [T, 1, H]
        return h + (out if bias is None else out + bias)

    def _apply_rope(self, t: Tensor, freqs: tuple[Tensor, Tensor] | Tensor) -> Tensor:
        """RoPE on t [T, 1, n, d]: Megatron's unfused arithmetic from the step's (cos, sin) (what
        `_apply_rotary_pos_emb_bshd` computes, the same ops on the same values), or Megatron's own function."""
        from megatron.core.models.common.embeddings.rope_utils import _rotate_half, apply_rotary_pos_emb

        if isinstance(freqs, tuple):
            cos, sin = freqs  # each [T, 1, 1, r]
            x, rest = t[..., :cos.shape[-1]], t[..., cos.shape[-1]:]  # rotated part, pass-through part
            x = x * cos + _rotate_half(x, self.model.config.rotary_interleaved) * sin
            return torch.cat((x, rest), dim=-1)
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config as yarn_mscale,
        )

        # YaRN scales cos/sin by its concentration factor, as Megatron's attention does (1.0 otherwise)
        return apply_rotary_pos_emb(t, freqs, config=self.model.config, cp_group=self.cp_group,
                                    mscale=yarn_mscale(self.model.config))

    def _attention(self, layer: int, q: Tensor, batch: Batch, cache: PagedKVCache, attn=None) -> Tensor:
        """Causal attention of packed queries q [T, np, d] over each sequence's cached K/V -> [T, np*dv]
        (`attn`: the MLA layer whose up projection turns cached latents into keys and values)."""
        if len(batch.groups) == 1 and not batch.groups[0].decode:  # one prefill chunk: nothing to scatter
            return self._group_attention(layer, q[None], batch.groups[0], cache, attn)[0].flatten(1)
        if len(batch.groups) == 1:  # decode only: query i is token i (build_batch packs them in order)
            return self._group_attention(layer, q[:, None], batch.groups[0], cache, attn)[:, 0].flatten(1)
        out = None
        for g in batch.groups:
            span = None if g.decode else slice(*g.token_index.tolist())
            part = self._group_attention(layer, q[g.token_index, None] if g.decode else q[None, span], g, cache, attn)
            part = part[:, 0] if g.decode else part[0]  # [S, np, dv] or [Q, np, dv]
            out = q.new_empty(q.shape[:2] + part.shape[-1:]) if out is None else out  # [T, np, dv]
            if g.decode:
                out.index_copy_(0, g.token_index, part)
            else:
                out[span] = part
        return out.flatten(1)

    def _group_attention(self, layer: int, q: Tensor, g: AttnGroup, cache: PagedKVCache, attn=None) -> Tensor:
        """q [S, Q, np, d] against the group's cached K/V -> [S, Q, np, dv] (SDPA, GQA without repeating K/V)."""
        s = q.shape[0]
        if self.mla is not None:
            rows = cache.kv[layer, 0].index_select(0, g.tables).view(s, -1, self.head_dim)  # [S, Lk, row]
            return self.mla.attend(attn, q, rows, g.mask)
        kv = cache.kv[layer].index_select(1, g.tables)  # [2, S*nb, bs, ng, d]
        kv = kv.view(2, s, -1, self.kv_heads, self.head_dim).transpose(2, 3)  # [2, S, ng, Lk, d]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kv[0], kv[1], attn_mask=g.mask, scale=self.scale,
                                             enable_gqa=self.heads != self.kv_heads)  # [S, np, Q, d]
        return out.transpose(1, 2)

    def _gather_vocab(self, logits: Tensor) -> Tensor:
        """This rank's vocab slice [R, V/tp] -> the full logits [R, V]."""
        if self.tp_group is None:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_group.size())]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


def build_batch(plan: list, cache: PagedKVCache) -> Batch:
    """Pack a scheduler plan [(sequence, chunk)] into model inputs (the chunk's blocks already allocated), on
    the KV cache's device."""
    tokens, positions, slots, rows = [], [], [], []
    decode, prefill = [], []
    bs = cache.block_size
    for seq, chunk in plan:
        start, first = seq.num_computed, len(tokens)
        end = start + chunk
        tokens += seq.tokens[start:end]
        if chunk == 1:
            positions.append(start)
            slots.append(seq.table.blocks[start // bs] * bs + start % bs)
        else:
            positions += range(start, end)
            slots += cache.slots(seq.table, range(start, end))
        (decode if chunk == 1 else prefill).append((seq, first, start, chunk))
        if end == len(seq.tokens):
            rows.append(len(tokens) - 1)
    dev = cache.device
    groups = ([_decode_group(decode, bs, dev)] if decode else []) + [_prefill_group(e, bs, dev) for e in prefill]
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
    return Batch(as_long(tokens), as_long(positions), as_long(slots), groups, as_long(rows))


def _decode_group(entries: list, bs: int, dev: torch.device) -> AttnGroup:
    """One query per sequence: (sequence, packed index, position, 1) entries."""
    nb = max(len(e[0].table.blocks) for e in entries)
    tables = torch.tensor([e[0].table.blocks + [0] * (nb - len(e[0].table.blocks)) for e in entries],
                          device=dev)  # [S, nb]
    ctx_len = torch.tensor([e[2] + 1 for e in entries], device=dev)  # [S]
    mask = torch.arange(nb * bs, device=dev)[None, :] < ctx_len[:, None]  # [S, Lk]
    return AttnGroup(torch.tensor([e[1] for e in entries], device=dev), True, tables.flatten(), mask[:, None, None])


def _prefill_group(entry: tuple, bs: int, dev: torch.device) -> AttnGroup:
    """One sequence's chunk of queries at positions [start, start + chunk), packed from index `first`."""
    seq, first, start, chunk = entry
    nb = -(-(start + chunk) // bs)
    key_pos = torch.arange(nb * bs, device=dev)  # [Lk]
    q_pos = torch.arange(start, start + chunk, device=dev)  # [Q]
    mask = key_pos[None, :] <= q_pos[:, None]  # [Q, Lk]
    return AttnGroup(torch.tensor([first, first + chunk], device=dev), False,
                     torch.tensor(seq.table.blocks[:nb], device=dev), mask[None, None])
