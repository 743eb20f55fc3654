"""One forward of the trainer's own Megatron `GPTModel` over a packed mixed prefill/decode batch.

The runner drives the model's submodules in the order `GPTModel.forward` / `TransformerLayer.forward` use
them (embedding, then per layer: input norm, QKV projection [+ q/k norm], RoPE, attention, output
projection, residual, pre-MLP norm, MLP, residual; final norm, output layer) with the same parameters and
names as the trainer. Only the core attention (which has no parameters) is replaced: K/V of the new tokens
are written into the paged cache and each sequence attends to its own blocks. Tensor parallelism works
as in training: column/row-parallel linears communicate inside the Megatron modules; the vocab-parallel
logits of the sampled rows are all-gathered over the TP group passed in.

Supports the dense local (non-TE) spec with RoPE or learned positions, GQA, qk-norm and QKV bias; MoE MLPs
run through `layer.mlp` unchanged. Packed tokens use the [T, 1, H] layout (sequence-first, batch 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.rollout.kv_cache import PagedKVCache


@dataclass
class AttnGroup:
    """Sequences attended to together (decode sequences form one group, each prefill chunk its own)."""

    token_index: Tensor
    """[S, Q] packed index of each sequence's query tokens; T (a zero pad row) where padded."""
    q_pos: Tensor
    """[S, Q] absolute position of each query token (0 where padded)."""
    tables: Tensor
    """[S, nb] block tables, padded with block 0 (masked by ctx_len)."""
    ctx_len: Tensor
    """[S] tokens in the cache for each sequence after this step's writes."""


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


class ModelRunner:
    """Runs a `GPTModel` (one pipeline stage holding the whole model) over paged batches."""

    def __init__(self, model, tp_group=None, cp_group=None):
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

    def make_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        dtype = next(self.model.parameters()).dtype
        return PagedKVCache(len(self.layers), num_blocks, block_size, self.kv_heads, self.head_dim, dtype)

    def _rope(self, positions: Tensor) -> Tensor | None:
        """RoPE frequencies [T, 1, 1, d] of the positions, or None for learned positions."""
        if getattr(self.model, "rotary_pos_emb", None) is None:
            return None
        if self._freqs is None:
            self._freqs = self.model.rotary_pos_emb(self.model.max_sequence_length)  # [max, 1, 1, d]
        return self._freqs[positions]

    @torch.inference_mode()
    def forward(self, batch: Batch, cache: PagedKVCache) -> Tensor:
        """fp32 logits [R, V] (full vocabulary) of `batch.sample_rows`.

        Torch-function modes (the CPU compat layer's CUDA->CPU remapping) are off inside: this path
        places nothing on CUDA, and the mode's Python hook on every op cost ~2x the step time on CPU.
        """
        with torch._C.DisableTorchFunction():
            return self._forward(batch, cache)

    def _forward(self, batch: Batch, cache: PagedKVCache) -> Tensor:
        m = self.model
        h = m.embedding(input_ids=batch.tokens[None], position_ids=batch.positions[None])  # [T, 1, H]
        freqs = self._rope(batch.positions)
        for i, layer in enumerate(self.layers):
            h = self._layer(i, layer, h, freqs, batch, cache)
        h = m.decoder.final_layernorm(h[batch.sample_rows])  # [R, 1, H]
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(h, weight=weight)  # [R, 1, V/tp]
        return self._gather_vocab(logits[:, 0].float())

    def _layer(self, i: int, layer, h: Tensor, freqs: Tensor | None, batch: Batch, cache: PagedKVCache) -> Tensor:
        """One TransformerLayer on packed hidden states [T, 1, H] -> [T, 1, H]."""
        attn = layer.self_attention
        q, k, v = attn.get_query_key_value_tensors(layer.input_layernorm(h), None)  # [T,1,np,d] [T,1,ng,d] x2
        if freqs is not None:
            q, k = self._apply_rope(q, freqs), self._apply_rope(k, freqs)
        cache.write(i, batch.slots, k[:, 0], v[:, 0])
        ctx = self._attention(i, q[:, 0], batch, cache)  # [T, np*d]
        out, bias = attn.linear_proj(ctx[:, None])  # [T, 1, H]
        h = h + (out if bias is None else out + bias)
        out, bias = layer.mlp(layer.pre_mlp_layernorm(h))  # [T, 1, H]
        return h + (out if bias is None else out + bias)

    def _apply_rope(self, t: Tensor, freqs: Tensor) -> Tensor:
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        return apply_rotary_pos_emb(t, freqs, config=self.model.config, cp_group=self.cp_group)

    def _attention(self, layer: int, q: Tensor, batch: Batch, cache: PagedKVCache) -> Tensor:
        """Causal attention of packed queries q [T, np, d] over each sequence's cached K/V -> [T, np*d]."""
        t = q.shape[0]
        q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])  # [T+1, np, d]
        out = q.new_zeros(t + 1, self.heads, self.head_dim)  # [T+1, np, d]
        for g in batch.groups:
            out[g.token_index] = self._group_attention(layer, q_pad[g.token_index], g, cache)
        return out[:t].flatten(1)

    def _group_attention(self, layer: int, q: Tensor, g: AttnGroup, cache: PagedKVCache) -> Tensor:
        """q [S, Q, np, d] against the group's cached K/V -> [S, Q, np, d]."""
        k, v = cache.gather(layer, g.tables)  # [S, Lk, ng, d] each
        rep = self.heads // self.kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)  # [S, Lk, np, d]
        scores = torch.einsum("sqhd,skhd->shqk", q.float(), k.float()) * self.scale  # [S, np, Q, Lk]
        key_pos = torch.arange(k.shape[1])  # [Lk]
        visible = (key_pos[None, None, :] <= g.q_pos[:, :, None]) & (key_pos < g.ctx_len[:, None, None])  # [S,Q,Lk]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [S, np, Q, Lk]
        return torch.einsum("shqk,skhd->sqhd", probs, v)  # [S, Q, np, d]

    def _gather_vocab(self, logits: Tensor) -> Tensor:
        """This rank's vocab slice [R, V/tp] -> the full logits [R, V]."""
        if self.tp_group is None:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.tp_group.size())]
        dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)


def build_batch(plan: list, cache: PagedKVCache) -> Batch:
    """Pack a scheduler plan [(sequence, chunk)] into model inputs (the chunk's blocks already allocated)."""
    tokens, positions, slots, rows = [], [], [], []
    decode, prefill = [], []
    for seq, chunk in plan:
        start, first = seq.num_computed, len(tokens)
        span = range(start, start + chunk)
        tokens += seq.tokens[start:start + chunk]
        positions += list(span)
        slots += cache.slots(seq.table, span)
        entry = (seq, first, start, chunk)
        (decode if chunk == 1 else prefill).append(entry)
        if start + chunk == len(seq.tokens):
            rows.append(len(tokens) - 1)
    groups = ([_group(decode, len(tokens))] if decode else []) + [_group([e], len(tokens)) for e in prefill]
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Batch(as_long(tokens), as_long(positions), as_long(slots), groups, as_long(rows))


def _group(entries: list, pad: int) -> AttnGroup:
    """An AttnGroup of (sequence, first packed index, start position, chunk) entries."""
    q = max(e[3] for e in entries)
    nb = max(len(e[0].table.blocks) for e in entries)
    token_index = torch.full((len(entries), q), pad, dtype=torch.long)  # [S, Q]
    q_pos = torch.zeros(len(entries), q, dtype=torch.long)  # [S, Q]
    tables = torch.zeros(len(entries), nb, dtype=torch.long)  # [S, nb]
    for s, (seq, first, start, chunk) in enumerate(entries):
        token_index[s, :chunk] = torch.arange(first, first + chunk)
        q_pos[s, :chunk] = torch.arange(start, start + chunk)
        tables[s, :len(seq.table.blocks)] = torch.tensor(seq.table.blocks)
    ctx_len = torch.tensor([start + chunk for _, _, start, chunk in entries])  # [S]
    return AttnGroup(token_index, q_pos, tables, ctx_len)
