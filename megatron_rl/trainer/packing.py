"""Sequence packing for the trainer: variable-length samples -> fixed token-budget micro-batches.

A sample of L tokens occupies L - 1 slots: inputs tokens[:-1], labels tokens[1:] (position i predicts token
i+1), and the per-token fields of the label side (loss mask, behaviour log-probs, advantages). Samples are
packed whole (never split) by first-fit-decreasing into bins of `max_tokens` slots; the bins are dealt to the
data-parallel ranks round-robin and every rank pads its list with empty micro-batches to the same count
(MoE all-to-alls and pipeline schedules need equal counts). Each micro-batch is [1, max_tokens], or [1, S] with S
its samples' slots rounded up to `trim_to` where the schedule takes any length (`pack(trim_to=...)`: the
trainer's at pp = cp = ep = 1, so trailing padding costs no compute):

    tokens, labels, position_ids (restart at 0 per sample), sample_index (-1 on padding)   long  [1, S]
    loss_mask, behaviour_logprobs, advantages                                              float [1, S]
    cu_seqlens  int32 [n+1]: sample boundaries (the trailing padding is one more segment)

    sample_num_tokens                                                                      float [1, S]
        loss tokens of each slot's WHOLE sample (0 on padding): seq-mean aggregation stays exact when a
        sample is split over context-parallel ranks, and weighs a split agent episode's rows (its
        segments) as one sample
    routed_experts (when the batch has them: routing replay)                        long  [1, S, L_moe, k]
        the rollout engine's experts of each INPUT token (tokens[:-1] side), -1 on padding / not recorded

Attention never crosses a boundary: `attention_inputs` gives a block-diagonal causal mask [1, 1, S, S]
(True = masked) for the local layer spec (its DotProductAttention applies an explicit mask instead of the
default causal one), or `PackedSeqParams` (THD, cu_seqlens) for Transformer Engine.

Context parallelism (cp > 1): every sample's slots are padded to a multiple of 2*cp (pads: loss_mask 0,
sample_index -1, inside the sample's segment, after its last token, so causal attention never lets a real
token see them; max_tokens must be a multiple of 2*cp) and each micro-batch is split by
`models.cp_attention.cp_split`: CP rank r keeps chunks r and 2cp-1-r of every segment, [1, S/cp] per field;
`cu_seqlens` stays GLOBAL (the full segment boundaries, as TE's THD CP expects) and `cp_size` records the
split. Such a micro-batch always runs as THD (`PackedSeqParams`): TE's attention on GPU, the local spec's
`CPDotProductAttention` on CPU; Megatron's THD RoPE gives each local chunk its position within its sample.

Bad input: a sample longer than the budget raises naming it (or is skipped and counted with
overlong='skip'); a sample without loss tokens is skipped and counted; a non-finite reward or a token id
outside [0, vocab) raises naming the sample.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from megatron_rl.config import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class PackingConfig:
    """How samples are packed into micro-batches."""

    max_tokens: int = 2048
    """Token budget (padded sequence length) of one micro-batch; a sample of L tokens needs L - 1."""
    overlong: Literal["error", "skip"] = "error"
    """A sample longer than max_tokens + 1: raise naming it, or skip it (logged and counted)."""

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"packing.max_tokens must be >= 1, got {self.max_tokens}")
        if self.overlong not in ("error", "skip"):
            raise ConfigError(f"packing.overlong={self.overlong!r} is not one of ['error', 'skip']")


@dataclass
class PackStats:
    """What packing did with a global batch."""

    samples: int = 0
    """Samples packed (all DP ranks)."""
    skipped_overlong: int = 0
    """Samples skipped because they exceed the budget (overlong='skip')."""
    skipped_empty: int = 0
    """Samples skipped because they have no loss token."""
    bins: int = 0
    """Non-empty micro-batches over all DP ranks."""
    microbatches_per_rank: int = 0
    """Micro-batches of every DP rank (empty ones included)."""
    fill: float = 0.0
    """Used slots / (bins * max_tokens)."""
    skipped_ids: list[str] = field(default_factory=list)
    """Episode ids of the skipped samples."""


def _name(cols, i: int) -> str:
    return f"sample {i} (episode {cols.episode_id[i]!r})" if hasattr(cols, "episode_id") else f"sample {i}"


def check_samples(cols, vocab_size: int, cfg: PackingConfig) -> tuple[np.ndarray, PackStats]:
    """Validate the batch (raises naming the sample); returns keep [N] bool and the skip counts."""
    stats, n = PackStats(), len(cols.offsets) - 1
    keep = np.ones(n, dtype=bool)
    bad = np.flatnonzero(~np.isfinite(np.asarray(cols.reward, dtype=np.float64)))  # [k]
    if bad.size:
        raise ValueError(f"{_name(cols, int(bad[0]))} has a non-finite reward {cols.reward[bad[0]]}; "
                         "fix the reward function (the trainer cannot learn from NaN)")
    for i in range(n):
        s, e = int(cols.offsets[i]), int(cols.offsets[i + 1])
        tok = cols.tokens[s:e]
        if tok.size and (tok.min() < 0 or tok.max() >= vocab_size):
            raise ValueError(f"{_name(cols, i)} has token ids in [{tok.min()}, {tok.max()}] outside the "
                             f"vocabulary [0, {vocab_size}); check the tokenizer against model.vocab_size")
        if e - s - 1 > cfg.max_tokens:
            if cfg.overlong == "error":
                raise ValueError(f"{_name(cols, i)} has {e - s} tokens, more than packing.max_tokens + 1 = "
                                 f"{cfg.max_tokens + 1}; raise max_tokens or set packing.overlong='skip'")
            keep[i], stats.skipped_overlong = False, stats.skipped_overlong + 1
        elif not cols.loss_mask[s + 1:e].any():
            keep[i], stats.skipped_empty = False, stats.skipped_empty + 1
    stats.skipped_ids = [str(getattr(cols, "episode_id", np.arange(n))[i]) for i in np.flatnonzero(~keep)]
    if stats.skipped_ids:
        logger.warning("packing: skipped %d overlong and %d empty-loss samples: %s", stats.skipped_overlong,
                       stats.skipped_empty, stats.skipped_ids[:8])
    return keep, stats


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Indices of `lengths` [N] (each <= capacity) grouped into bins of total <= capacity (FFD, stable)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        j = next((k for k, f in enumerate(free) if f >= lengths[i]), None)
        if j is None:
            bins.append([]), free.append(capacity)
            j = len(bins) - 1
        bins[j].append(i)
        free[j] -= int(lengths[i])
    return bins


def _segment_fields(cols, i: int, token_fields: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One sample's slots: inputs, labels and the label-side per-token fields (each [L-1])."""
    s, e = int(cols.offsets[i]), int(cols.offsets[i + 1])
    out = {"tokens": cols.tokens[s:e - 1], "labels": cols.tokens[s + 1:e], "loss_mask": cols.loss_mask[s + 1:e],
           "behaviour_logprobs": cols.logprobs[s + 1:e]}
    out.update({k: v[s + 1:e] for k, v in token_fields.items()})
    return out


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def episode_loss_tokens(cols, kept: np.ndarray) -> np.ndarray:
    """float64 [N]: the loss tokens of each row's whole episode over the `kept` rows: the row's own, or, for the
    rows of a split agent episode (`shards.SEGMENT_MARK`), all of theirs, so that seq-mean aggregation weighs
    that episode as one sample (0 on rows not kept)."""
    s, e = np.asarray(cols.offsets[:-1]), np.asarray(cols.offsets[1:])
    own = np.asarray([np.count_nonzero(cols.loss_mask[a + 1:b]) for a, b in zip(s, e)], np.float64)  # [N] label side
    episode = cols.episode_index() if hasattr(cols, "episode_index") else np.arange(len(own))  # [N]
    total = np.zeros(int(episode.max(initial=-1)) + 1)
    np.add.at(total, episode[kept], own[kept])
    out = np.zeros(len(own))
    out[kept] = total[episode[kept]]
    return out


def build_microbatch(cols, sample_ids: list[int], max_tokens: int, token_fields: dict[str, np.ndarray] | None = None,
                     pad_to: int = 1, num_tokens: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """The [1, max_tokens] micro-batch holding samples `sample_ids` end to end (padding after them); each
    sample's segment is padded to a multiple of `pad_to` (2*cp under context parallelism); `num_tokens` [N]:
    each sample's `sample_num_tokens` (default: its own loss tokens; `episode_loss_tokens`)."""
    S, token_fields = max_tokens, token_fields or {}
    names = ("tokens", "labels", "loss_mask", "behaviour_logprobs", *token_fields)
    ints = {"tokens", "labels", "position_ids", "sample_index"}
    mb = {k: torch.zeros(S, dtype=torch.long if k in ints else torch.float32) for k in names}  # each [S]
    mb["position_ids"], mb["sample_index"] = torch.arange(S), torch.full((S,), -1, dtype=torch.long)
    mb["sample_num_tokens"] = torch.zeros(S)
    bounds, pos = [0], 0
    for i in sample_ids:
        seg = _segment_fields(cols, i, token_fields)
        n, padded = len(seg["tokens"]), _padded(len(seg["tokens"]), pad_to)
        for k in names:
            mb[k][pos:pos + n] = torch.from_numpy(np.asarray(seg[k], dtype=np.int64 if k in ints else np.float64))
        mb["position_ids"][pos:pos + padded] = torch.arange(padded)
        mb["sample_index"][pos:pos + n] = i
        own = np.count_nonzero(seg["loss_mask"])
        mb["sample_num_tokens"][pos:pos + n] = float(own if num_tokens is None else num_tokens[i])
        pos += padded
        bounds.append(pos)
    mb["position_ids"][pos:] = torch.arange(S - pos)
    routes = getattr(cols, "routed_experts", None)
    if routes is not None:
        mb["routed_experts"] = _routes(cols, routes, sample_ids, S, pad_to)
    if pos < S:
        bounds.append(S)  # trailing padding is its own segment
    out = {k: v.unsqueeze(0) for k, v in mb.items()}  # each [1, S]
    out["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)  # [n+1]
    return out


def _routes(cols, routes: np.ndarray, sample_ids: list[int], S: int, pad_to: int) -> torch.Tensor:
    """[S, L_moe, k] long: each sample's input-token routes at its slots, -1 elsewhere."""
    out = torch.full((S, *routes.shape[1:]), -1, dtype=torch.long)
    pos = 0
    for i in sample_ids:
        s, e = int(cols.offsets[i]), int(cols.offsets[i + 1])
        out[pos:pos + e - 1 - s] = torch.from_numpy(routes[s:e - 1].astype(np.int64))
        pos += _padded(e - 1 - s, pad_to)
    return out


def check_cp(max_tokens: int, cp_size: int) -> None:
    """Raise unless a micro-batch of `max_tokens` slots splits evenly into 2*cp chunks per sample."""
    if cp_size > 1 and max_tokens % (2 * cp_size):
        raise ConfigError(f"packing.max_tokens={max_tokens} must be a multiple of 2*parallel.cp = {2 * cp_size} "
                          f"(context parallelism splits every sample into 2*cp chunks); round it up")


def pack(cols, keep: np.ndarray, cfg: PackingConfig, dp_rank: int, dp_size: int,
         token_fields: dict[str, np.ndarray] | None = None, stats: PackStats | None = None, multiple_of: int = 1,
         cp_rank: int = 0, cp_size: int = 1, trim_to: int = 0) -> tuple[list[dict[str, torch.Tensor]], PackStats]:
    """This DP rank's micro-batches of the kept samples (same count on every rank, a multiple of
    `multiple_of`: the interleaved pipeline schedule needs a multiple of pp) and the packing stats.
    With cp_size > 1 each micro-batch is this CP rank's share [1, max_tokens / cp] (module docstring).
    `trim_to` > 0: each micro-batch ends after its samples, rounded up to a multiple of `trim_to` (at most
    max_tokens), instead of always [1, max_tokens]: the trailing padding would cost compute in every layer
    (only for a schedule that takes micro-batches of different lengths: no pipeline, no CP split)."""
    check_cp(cfg.max_tokens, cp_size)
    if trim_to and cp_size > 1:
        raise ValueError("pack: trim_to needs cp_size 1 (a CP split cuts every micro-batch of max_tokens slots)")
    stats, pad_to = stats or PackStats(), 2 * cp_size if cp_size > 1 else 1
    kept = np.flatnonzero(keep)  # [K] global sample ids
    slots = np.diff(np.asarray(cols.offsets))[kept] - 1  # [K]
    padded = -(-slots // pad_to) * pad_to  # [K] <= max_tokens when max_tokens is a multiple of pad_to
    bins = [[int(kept[j]) for j in b] for b in first_fit_decreasing(padded, cfg.max_tokens)]
    per_rank = max(1, -(-len(bins) // dp_size))
    per_rank = -(-per_rank // multiple_of) * multiple_of
    mine = bins[dp_rank::dp_size]
    mine += [[] for _ in range(per_rank - len(mine))]
    stats.samples, stats.bins, stats.microbatches_per_rank = len(kept), len(bins), per_rank
    stats.fill = float(slots.sum()) / max(len(bins) * cfg.max_tokens, 1)
    counts = episode_loss_tokens(cols, kept)
    by_id = dict(zip(kept.tolist(), padded.tolist()))
    lengths = [min(cfg.max_tokens, max(1, -(-sum(by_id[i] for i in b) // trim_to)) * trim_to) if trim_to
               else cfg.max_tokens for b in mine]  # slots of each micro-batch
    mbs = [build_microbatch(cols, b, n, token_fields, pad_to, counts) for b, n in zip(mine, lengths)]
    return ([split_microbatch(mb, cp_rank, cp_size) for mb in mbs] if cp_size > 1 else mbs), stats


def split_microbatch(mb: dict[str, torch.Tensor], cp_rank: int, cp_size: int) -> dict:
    """CP rank `cp_rank`'s share of a full micro-batch: every [1, S] field -> [1, S/cp]; cu_seqlens stays
    global (segments must be multiples of 2*cp); adds 'cp_size'."""
    from megatron_rl.models.cp_attention import cp_split

    cu = mb["cu_seqlens"]
    out = {k: (v if k == "cu_seqlens" else cp_split(v, cu, cp_size, cp_rank, dim=1 if k == "routed_experts" else -1))
           for k, v in mb.items()}  # routed_experts [1, S, L_moe, k]: split along the sequence too
    out["cp_size"] = cp_size
    return out


def block_causal_mask(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[1, 1, S, S] bool, True = masked: causal inside each segment of cu_seqlens [n+1], nothing across."""
    seg = torch.bucketize(torch.arange(seq_len), cu_seqlens[1:].long(), right=True)  # [S] segment of each slot
    same = seg[:, None] == seg[None, :]  # [S, S]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()  # [S, S]
    return ~(same & causal)[None, None]


def attention_inputs(batch: dict, transformer_impl: str):
    """(attention_mask, packed_seq_params) for a micro-batch: a block-causal mask for the local spec,
    THD PackedSeqParams for Transformer Engine or for a context-parallel split (both specs), (None, None)
    for an unpacked batch (plain causal)."""
    cu = batch.get("cu_seqlens")
    if cu is None:
        return batch.get("attention_mask"), None
    seq_len = batch["tokens"].shape[-1]
    if transformer_impl != "transformer_engine" and batch.get("cp_size", 1) == 1:
        return block_causal_mask(cu, seq_len).to(batch["tokens"].device), None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu.to(device=batch["tokens"].device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return None, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
