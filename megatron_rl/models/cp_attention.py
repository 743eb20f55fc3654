"""Context-parallel core attention for the local (non-TE) layer spec, and the load-balanced CP split.

Megatron-Core's local `DotProductAttention` refuses context parallelism ("only supported by
TEDotProductAttention"); on GPU the Transformer Engine spec handles CP natively (THD + cu_seqlens). This
module is the CPU (and test) counterpart, swapped into the local spec by `models.gpt.layer_spec` when cp > 1.

Load balancing (as Megatron/TE do for THD): every packed segment (sample) of length L, a multiple of 2*cp,
is cut into 2*cp equal chunks; CP rank r holds chunks r and 2*cp-1-r of EVERY segment, in segment order, so
each rank gets the same share of the causal work. `cp_chunk_indices` gives the global slots of rank r's
tokens; `cp_split` / `cp_merge` apply it to per-token tensors and undo it.

Attention: the local queries attend to the keys/values of ALL CP ranks. K and V are all-gathered in the CP
group (Megatron's autograd-aware gather: the backward pass reduce-scatters dK and dV back to their owners),
and the mask is built from the global slots of the local queries and of the gathered keys: key k is visible
to query q iff both lie in the same segment and k <= q (causal + block-diagonal). RoPE is applied before
this module by Megatron's THD path, which already uses each local chunk's position within its sample.
Memory is O(S/cp * S) per head (a reference implementation, not a ring/flash kernel). No parameters: the
checkpoint and the weights of the model are those of the plain local spec.
"""
from __future__ import annotations

import math

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor


# ------------------------------------------------------------------------------- chunk split / merge
def _segment_lengths(cu_seqlens: Tensor, cp: int) -> list[int]:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()  # [n]
    bad = [(i, n) for i, n in enumerate(lengths) if n % (2 * cp)]
    if bad:
        i, n = bad[0]
        raise ValueError(f"packed segment {i} has {n} slots, not a multiple of 2*cp = {2 * cp}; pad each sample "
                         f"to a multiple of 2*cp (packing.pack(..., cp_size={cp}) does)")
    return lengths


def cp_chunk_indices(cu_seqlens: Tensor, cp: int, rank: int) -> Tensor:
    """long [S/cp]: global slots held by CP rank `rank` (chunks rank and 2cp-1-rank of every segment)."""
    starts = cu_seqlens[:-1].tolist()
    parts = []
    for start, length in zip(starts, _segment_lengths(cu_seqlens, cp)):
        c = length // (2 * cp)  # chunk length
        parts += [torch.arange(start + rank * c, start + (rank + 1) * c),
                  torch.arange(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def cp_split(x: Tensor, cu_seqlens: Tensor, cp: int, rank: int, dim: int = -1) -> Tensor:
    """This rank's share of x along `dim` (the packed sequence dimension, length S) -> length S/cp."""
    return x.index_select(dim, cp_chunk_indices(cu_seqlens, cp, rank).to(x.device))


def cp_merge(parts: list[Tensor], cu_seqlens: Tensor, dim: int = -1) -> Tensor:
    """Inverse of cp_split: the cp ranks' shares (in rank order) -> the full sequence along `dim`."""
    cp = len(parts)
    index = torch.cat([cp_chunk_indices(cu_seqlens, cp, r) for r in range(cp)]).to(parts[0].device)  # [S]
    gathered = torch.cat(parts, dim=dim)
    out = torch.empty_like(gathered)
    return out.index_copy_(dim % gathered.dim(), index, gathered)


def cp_attention_mask(cu_seqlens: Tensor, cp: int, rank: int) -> Tensor:
    """bool [S/cp, S], True = masked: local queries of `rank` x keys gathered in CP-rank order."""
    q = cp_chunk_indices(cu_seqlens, cp, rank)  # [Sq] global slots of the queries
    k = torch.cat([cp_chunk_indices(cu_seqlens, cp, r) for r in range(cp)])  # [S] global slots of the keys
    bounds = cu_seqlens[1:].long()
    seg_q = torch.bucketize(q, bounds, right=True)  # [Sq]
    seg_k = torch.bucketize(k, bounds, right=True)  # [S]
    return ~((seg_q[:, None] == seg_k[None, :]) & (k[None, :] <= q[:, None]))


# ------------------------------------------------------------------------------------ the module
class CPDotProductAttention(MegatronModule):
    """Drop-in core attention (DotProductAttention's signature) with context parallelism over pg_collection.cp.

    Inputs: THD [t, n, d] (packed, `packed_seq_params.cu_seqlens_q` holds the GLOBAL segment boundaries) or
    SBHD [s, b, n, d] (no packing: the whole sequence is one segment, split like Megatron's
    get_batch_on_this_cp_rank). Output [t, n*d] or [s, b, n*d].
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group, tp = pg_collection.cp, pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)
        self._mask_key, self._mask = None, None

    def _cp_mask(self, cu_seqlens: Tensor, device) -> Tensor:
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        key = (tuple(cu_seqlens.tolist()), cp, rank)
        if key != self._mask_key:  # the same micro-batch goes through every layer: build it once
            self._mask_key, self._mask = key, cp_attention_mask(cu_seqlens.cpu(), cp, rank).to(device)
        return self._mask

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None) -> Tensor:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if attention_bias is not None:
            raise ValueError("CPDotProductAttention does not take an attention_bias")
        thd = query.dim() == 3
        if thd:  # [t, n, d] -> [t, 1, n, d]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        cp = self.cp_group.size()
        if packed_seq_params is not None:
            cu = packed_seq_params.cu_seqlens_q
        else:
            cu = torch.tensor([0, query.shape[0] * cp])  # one segment: the whole (split) sequence
        # [s/cp, b, g, d] -> [s, b, g, d] in CP-rank order; backward: reduce-scatter of dK, dV
        key = gather_from_sequence_parallel_region(key.contiguous(), True, group=self.cp_group)
        value = gather_from_sequence_parallel_region(value.contiguous(), True, group=self.cp_group)
        if self.heads > self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)  # [s, b, n, d]
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        scores = torch.einsum("qbnd,kbnd->bnqk", query, key) * self.softmax_scale  # [b, n, s/cp, s]
        scores = scores.masked_fill(self._cp_mask(cu, query.device), float("-inf"))
        probs = self.dropout(torch.softmax(scores.float(), dim=-1).to(query.dtype))  # [b, n, s/cp, s]
        out = torch.einsum("bnqk,kbnd->qbnd", probs, value)  # [s/cp, b, n, d]
        out = out.reshape(out.shape[0], out.shape[1], -1)  # [s/cp, b, n*d]
        return out[:, 0] if thd else out
