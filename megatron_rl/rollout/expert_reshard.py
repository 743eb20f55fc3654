"""Routed experts from the trainer's expert tensor parallelism (etp) to the engine's (etp = its tp).

    ex = ExpertReshard(ctx, engine_tp_rank, engine_tp_size)      # when the trainer's etp != tp
    experts, rest = ex.split(named)                              # the routed experts' TP-sharded tensors
    for name, t in ex.exchange(experts, engine_params): ...      # collective over the world

Megatron-Core slices each routed expert's projections over the expert-TP group (`etp` ranks) and the rest
of the layer over the TP group (`tp` ranks); the engine slices both over its TP group. A trainer rank's
expert slice is therefore not any engine rank's, and the ranks that hold a given expert need not share a TP
rank with the engine ranks that need it. So: each expert tensor is first all-gathered over the trainer's
expert-TP group into the unsharded tensor (the gated first projection, stored per rank as [gate_r; up_r],
is un-interleaved into [gate; up]), broadcast by its first owner over the world (bucketed), and each engine
rank cuts its own TP slice, [gate_t; up_t] for the gated projection. The expert tensors cross the world
once at their full size (tp times the engine's share): exact, not the cheapest route.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.rollout.weights import broadcast_known, metadata


def is_expert_sharded(name: str, t: Tensor) -> bool:
    """A routed expert's tensor sliced over the expert-TP group: under a MoE layer's `experts` (not its
    `shared_experts`, sliced over TP) and marked `tensor_model_parallel` (Megatron's `allreduce=False` mark of
    expert parameters is only set at EP > 1)."""
    return ".mlp.experts." in name and bool(getattr(t, "tensor_model_parallel", False))


def _gated(name: str, glu: bool) -> bool:
    """The first projection of a gated (swiglu) expert: its rows are [gate; up], each sliced on its own."""
    return glu and ".mlp.experts." in name and ".linear_fc1." in name


def unshard(shards: list[Tensor], dim: int, gated: bool) -> Tensor:
    """The unsharded tensor from its expert-TP slices (in rank order) along `dim`."""
    if not gated:
        return torch.cat(shards, dim=dim)
    halves = [s.chunk(2, dim=dim) for s in shards]  # etp x ([gate_r], [up_r])
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)  # [gate; up]


def shard(full: Tensor, dim: int, rank: int, size: int, gated: bool) -> Tensor:
    """This TP rank's slice of the unsharded `full` along `dim` (the gated projection: [gate_t; up_t])."""
    if not gated:
        return full.chunk(size, dim=dim)[rank].contiguous()
    gate, up = full.chunk(2, dim=dim)
    return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)


class ExpertReshard:
    """Reshards the routed experts' TP slices from the trainer's etp to the engine's tp; see the module doc."""

    def __init__(self, ctx, tp_rank: int, tp_size: int, glu: bool, bucket_bytes: int = 64 << 20):
        self.expt_tp = ctx.pgs.expt_tp
        """The trainer's expert-TP group (the ranks holding slices of the same experts)."""
        self.world = ctx.world
        """Every rank of the job: each routed expert is broadcast over it from its first owner."""
        self.tp_rank, self.tp_size, self.glu = tp_rank, tp_size, glu
        self.bucket_bytes, self.device = bucket_bytes, ctx.device
        self.scratch: dict = {}
        """Flat bucket buffers reused across syncs."""

    def split(self, named: Iterable[tuple[str, Tensor]]) -> tuple[list, list]:
        """(the routed experts' sliced tensors, everything else), both as (name, tensor) lists."""
        experts, rest = [], []
        for name, t in named:
            (experts if is_expert_sharded(name, t) else rest).append((name, t))
        return experts, rest

    def exchange(self, experts: list[tuple[str, Tensor]], engine_params: dict[str, Tensor]
                 ) -> Iterator[tuple[str, Tensor]]:
        """Every routed expert tensor of the model, as this engine rank's TP slice (collective: every rank)."""
        full = {name: self._unshard(name, t) for name, t in experts}  # this rank's experts, unsharded
        metas: list = [None] * dist.get_world_size(self.world)
        dist.all_gather_object(metas, metadata(full), group=self.world)  # [world] (name, full shape, dtype) lists
        owner: dict[str, int] = {}
        for r, meta in enumerate(metas):
            for name, _, _ in meta:
                owner.setdefault(name, r)
        me = dist.get_rank(self.world)
        for r, meta in enumerate(metas):
            sub = [m for m in meta if owner[m[0]] == r]
            src = dist.get_global_rank(self.world, r)
            for name, t in broadcast_known(sub, full if r == me else None, src, self.world, self.bucket_bytes,
                                           self.scratch, device=self.device):
                p = engine_params.get(name)
                dim = getattr(p, "partition_dim", 0)
                yield name, shard(t, dim, self.tp_rank, self.tp_size, _gated(name, self.glu))

    def _unshard(self, name: str, t: Tensor) -> Tensor:
        """All-gather `t` over the expert-TP group into the unsharded tensor (collective over that group)."""
        size, dim = self.expt_tp.size(), t.partition_dim
        t = t.detach().contiguous()
        if size == 1:
            return t
        shards = [torch.empty_like(t) for _ in range(size)]  # etp x [slice]
        dist.all_gather(shards, t, group=self.expt_tp)
        return unshard(shards, dim, _gated(name, self.glu))
