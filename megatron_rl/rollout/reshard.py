"""The engine's own layout (tensor parallel only) and the weight sync into it from any trainer layout.

    par, pgs = engine_layout(ctx)                  # collective: every rank, once, at set-up
    engine = RolloutEngine.build(model_cfg, engine_cfg, par, pgs)
    sync = WeightSync(ctx, pgs)
    sync(engine, version, policy.global_named_tensors())   # collective: every rank, after each update

Every rank's engine holds the whole model (every layer, every expert) sliced over the trainer's TP group,
as a serving stack does; pipeline, context and expert parallelism are the trainer's alone. The sync
gathers, for each TP rank t, the tensors of every rank with TP rank t (pipeline stages, virtual chunks,
expert-parallel ranks) under their global names (trainer/global_names.py): each tensor is broadcast by
its first owner over the group of ranks with TP rank t: small ones in flat buckets, large ones (>=
`direct_bytes`) on their own straight into the engine's tensor, all in flight at once while the source
copies its own into its engine. When the trainer has PP = EP = 1 every rank already holds every tensor of
its TP slice and the sync is a local copy. Routed experts sliced over an expert-TP group other than the TP
group (etp != tp) are resharded by rollout/expert_reshard.py. Either way the engine checks that every one
of its parameters was written (by name and shape) and raises naming the missing.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.config import ConfigError
from megatron_rl.parallel import ParallelConfig
from megatron_rl.rollout.weights import DTYPES, broadcast_known, metadata


def check_engine_layout(parallel: ParallelConfig, model_cfg) -> None:
    """Refuse (ConfigError, before any rank starts) a trainer layout whose weights the sync cannot reshard."""
    moe = model_cfg.moe
    if moe.num_experts and moe.grouped_gemm and parallel.ep > 1:
        raise ConfigError(f"model.moe.grouped_gemm with parallel.ep={parallel.ep}: the weight sync numbers the "
                          f"experts of SequentialMLP (local_experts.N) globally, not grouped-GEMM weights; set "
                          f"model.moe.grouped_gemm=false or parallel.ep=1")


def engine_parallel(parallel: ParallelConfig) -> ParallelConfig:
    """The engine's layout for a trainer's: its TP (and sequence parallelism), nothing else."""
    return ParallelConfig(tp=parallel.tp, sequence_parallel=parallel.sequence_parallel)


def _direct(parallel: ParallelConfig) -> bool:
    """Every trainer rank holds every tensor of its TP slice (no stages, no expert split)."""
    return parallel.pp == 1 and parallel.ep == 1


def _same_experts(parallel: ParallelConfig) -> bool:
    """The trainer slices experts as the engine does (etp = tp); else rollout/expert_reshard.py reshards them."""
    return parallel.expert_tp == parallel.tp


def engine_layout(ctx) -> tuple[ParallelConfig, object]:
    """(the engine's ParallelConfig, its ProcessGroupCollection); collective over the world when the trainer has
    PP, CP or EP > 1 or etp != tp (the engine then gets single-rank pipeline/context/expert groups, its TP
    group as the expert-TP group, and a `dp` group of the ranks sharing its TP rank, over which the sync
    gathers)."""
    par = ctx.parallel
    if _direct(par) and par.cp == 1 and _same_experts(par):
        return engine_parallel(par), ctx.pgs
    from megatron.core.process_groups_config import ProcessGroupCollection

    group = ctx.world  # the ranks are numbered globally below: the job's world, not a subgroup
    world = dist.get_world_size(group)
    tp_of: list = [None] * world
    dist.all_gather_object(tp_of, dist.get_process_group_ranks(ctx.pgs.tp), group=group)  # [world] TP groups
    tp_rank = [tp_of[r].index(r) for r in range(world)]
    alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])
    peers, _ = dist.new_subgroups_by_enumeration(
        [[r for r in range(world) if tp_rank[r] == t] for t in range(par.tp)])
    tp = ctx.pgs.tp
    pgs = ProcessGroupCollection(
        tp=tp, pp=alone, mp=tp, embd=alone, pos_embd=alone, cp=alone, tp_cp=tp, ep=alone,
        expt_tp=tp, tp_ep=tp, tp_ep_pp=tp, dp=peers, dp_cp=peers, expt_dp=peers, tp_dp_cp=group)
    return engine_parallel(par), pgs


class WeightSync:
    """Copies the trainer's weights (global names, this rank's TP slice) into the engine; see the module doc."""

    def __init__(self, ctx, engine_pgs, bucket_bytes: int = 64 << 20, direct_bytes: int = 1 << 20):
        self.direct = _direct(ctx.parallel)
        self.direct_bytes = direct_bytes
        """Tensors of at least this size are broadcast on their own into the engine's tensor (no bucket copy)."""
        self.peers = None if self.direct else engine_pgs.dp
        self.bucket_bytes = bucket_bytes
        self.scratch: dict = {}
        """Flat bucket buffers reused by every sync (rollout/weights.py `broadcast_known`)."""
        self.device = ctx.device
        """Where received tensors land (the backend's device: NCCL needs the rank's GPU)."""
        self.ctx = ctx
        self.reshard_experts = not _same_experts(ctx.parallel)
        """The trainer's etp != tp: the routed experts go through rollout/expert_reshard.py."""
        self.experts = None
        """Its ExpertReshard (built at the first sync: it needs the engine model's gated-unit flag)."""

    def __call__(self, engine, version: int, named: Iterable[tuple[str, Tensor]]) -> int:
        """Load `named` (every rank's own) into `engine` as `version`; returns the tensors written."""
        model = engine.model
        dest = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        experts: Iterable = ()
        if self.reshard_experts:
            if self.experts is None:
                from megatron_rl.rollout.expert_reshard import ExpertReshard

                tp = self.ctx.pgs.tp
                self.experts = ExpertReshard(self.ctx, tp.rank(), tp.size(), model.config.gated_linear_unit,
                                             self.bucket_bytes)
            mine, named = self.experts.split(named)
            experts = self.experts.exchange(mine, dest)
        rest = named if self.direct else self.gather(named, dest)
        return engine.update_weights(version, itertools.chain(experts, rest), policy="continue", complete=True)

    def gather(self, named: Iterable[tuple[str, Tensor]], dest: dict[str, Tensor] | None = None
               ) -> Iterator[tuple[str, Tensor]]:
        """Every tensor of the ranks sharing this rank's TP rank, each from its first owner (collective).
        Tensors of at least `direct_bytes` are broadcast on their own, straight into `dest[name]` (the engine's
        tensor of that name, when its shape and dtype match) with no staging copy; smaller ones in buckets."""
        mine, dest = dict(named), dest or {}
        metas: list = [None] * self.peers.size()
        dist.all_gather_object(metas, metadata(mine), group=self.peers)  # [peers] (name, shape, dtype) lists
        owner: dict[str, int] = {}
        for i, meta in enumerate(metas):
            for name, _, _ in meta:
                owner.setdefault(name, i)
        me = self.peers.rank()
        for i, meta in enumerate(metas):
            src = dist.get_global_rank(self.peers, i)
            sub = [m for m in meta if owner[m[0]] == i]
            big = [m for m in sub if _nbytes(m) >= self.direct_bytes]
            yield from self._direct_many(big, mine if i == me else None, dest, src)
            yield from broadcast_known([m for m in sub if _nbytes(m) < self.direct_bytes], mine if i == me else None,
                                       src, self.peers, self.bucket_bytes, self.scratch, device=self.device)

    def _direct_many(self, big: list, mine: dict | None, dest: dict, src: int) -> Iterator[tuple[str, Tensor]]:
        """`big`'s tensors broadcast from `src` one collective each, all in flight at once: a receiver receives
        into `dest[name]` when it fits (else a new tensor, which the engine's load then rejects by shape); the
        source sends its own and, while they go, copies them into its `dest` (its own engine)."""
        works, out = [], []
        for name, shape, dtype in big:
            target = dest.get(name)
            fits = target is not None and tuple(target.shape) == shape and str(target.dtype) == dtype and \
                target.is_contiguous()
            if mine is not None:
                t = mine[name].detach().contiguous()
                out.append((name, t, target if fits else None))
            else:
                t = target if fits else torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
                out.append((name, t, None))
            works.append(dist.broadcast(t, src=src, group=self.peers, async_op=True))
        for _, t, target in out:  # the source's local copies overlap its sends
            if target is not None:
                target.copy_(t)
        for w in works:
            w.wait()
        for name, t, target in out:
            yield name, t if target is None else target


def _nbytes(meta: tuple) -> int:
    n = DTYPES[meta[2]].itemsize
    for s in meta[1]:
        n *= s
    return n
