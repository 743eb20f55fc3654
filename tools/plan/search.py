"""Layout search, the rollout engine's memory (KV cache) and the weight-sync bandwidth.

Search enumerates tp (powers of two up to a node, dividing the heads / query groups), pp (dividing the
GPUs, at most the layer count), vpp (powers of two, pp * vpp <= layers), cp (powers of two up to a node),
ep (powers of two dividing the experts), etp in {1, tp}, and recompute in {none, selective, full} unless
pinned; dp follows from the GPU count. Where pp * vpp does not divide the layers, the candidate carries the
uneven parallel.pipeline_layout the trainer proposes (megatron_rl/stages.py). Layouts that do not resolve
(divisibility, batch), that the trainer refuses for the model (`ModelConfig.check_parallel`: heads by tp,
layers over the stages, experts by ep) or that do not fit are dropped; the rest are sorted by estimated step
time, then by memory.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator

from megatron_rl import stages
from megatron_rl.config import ConfigError
from megatron_rl.parallel import ParallelConfig
from megatron_rl.tools.plan.count import Arch
from megatron_rl.tools.plan.memory import GB, Plan, plan_layout, resolve_layout, trainer_error
from megatron_rl.tools.plan.spec import PlanConfig, gpu_spec

RECOMPUTE = ("none", "selective", "full")


def _pow2(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def candidate_layouts(cfg: PlanConfig, arch: Arch) -> Iterator[ParallelConfig]:
    world, node = cfg.cluster.gpus, cfg.cluster.gpus_per_node
    n_slots = len(arch.layer_kinds())
    tps = [t for t in _pow2(node) if world % t == 0 and arch.heads % t == 0
           and (arch.spec.mla is not None or arch.groups % t == 0)]
    pps = [p for p in range(1, n_slots + 1) if world % p == 0]
    cps = [c for c in _pow2(node) if world % c == 0]
    eps = [e for e in _pow2(arch.num_experts) if arch.num_experts % e == 0] if arch.num_experts else [1]
    for tp, pp, cp, ep in itertools.product(tps, pps, cps, eps):
        if world % (tp * pp * cp) or world % (ep * pp):
            continue
        vpps = [v for v in _pow2(n_slots // pp) if pp > 1] or [1]
        for vpp, etp in itertools.product(vpps, sorted({1, tp})):
            if world % (etp * ep * pp) or (arch.num_experts and arch.moe_ffn % etp):
                continue
            yield ParallelConfig(tp=tp, pp=pp, vpp=vpp if vpp > 1 else None, cp=cp, ep=ep,
                                 etp=etp if arch.num_experts else None, sequence_parallel=tp > 1,
                                 pipeline_layout=_layout(cfg, pp, vpp))


def _layout(cfg: PlanConfig, pp: int, vpp: int) -> str | None:
    """None where the layers split evenly over pp * vpp chunks, else the uneven layout the trainer's refusal
    proposes (megatron_rl/stages.py), so that the candidate is one the trainer builds."""
    layers, mtp = cfg.model.num_layers, cfg.arch.mtp_layers or cfg.model.mtp_num_layers
    if pp == 1 or layers % (pp * vpp) == 0:
        return None
    return stages.propose(layers, mtp, pp, vpp)


def search(cfg: PlanConfig, arch: Arch, recompute: str | None = None) -> tuple[list[Plan], int]:
    """(fitting plans sorted by step time then memory, number of layouts tried)."""
    gpu = gpu_spec(cfg.cluster.gpu)
    plans, tried = [], 0
    for par in candidate_layouts(cfg, arch):
        if trainer_error(cfg, par) is not None:
            continue
        for rc in (recompute,) if recompute else RECOMPUTE:
            try:
                lay = resolve_layout(cfg, arch, par, rc)
            except ConfigError:
                continue
            tried += 1
            plan = plan_layout(cfg, arch, lay, gpu)
            if plan.fits:
                plans.append(plan)
    plans.sort(key=lambda pl: (pl.step["step_seconds"], pl.total_gb))
    return plans, tried


def rollout_figures(cfg: PlanConfig, arch: Arch) -> dict[str, float]:
    """Per-GPU memory of one rollout-engine instance (bf16 weights + KV cache) and the weight-sync bandwidth."""
    r, gpu = cfg.rollout, gpu_spec(cfg.cluster.gpu)
    kinds = [k for k in arch.layer_kinds() if k != "mtp"]
    experts = sum(arch.layers[k].experts for k in kinds)
    dense = arch.total_params - experts
    weights = 2 * (dense / r.tp + experts / r.gpus)
    elem = 1 if r.kv_cache_dtype == "fp8" else 2
    kv_token = arch.kv_cache_bytes_per_token(elem)
    kv_split = 1 if arch.spec.mla else min(r.tp, arch.groups)     # MLA's latent is replicated over TP
    seqs_per_replica = -(-r.batch // (r.gpus // r.tp))
    kv = seqs_per_replica * r.context_length * kv_token / kv_split
    usable = gpu.memory_gb * (1 - cfg.cluster.margin) - cfg.cluster.overhead_gb
    sync_bytes = 2 * arch.total_params
    return {"weights_gb": weights / GB, "kv_cache_gb": kv / GB, "kv_bytes_per_token": float(kv_token),
            "fits": float((weights + kv) / GB <= usable), "usable_gb": usable,
            "max_batch": float(max(0.0, (usable * GB - weights) / (r.context_length * kv_token / kv_split))
                               * (r.gpus // r.tp)),
            "weight_sync_gb": sync_bytes / GB,
            "weight_sync_gb_s": sync_bytes / GB / r.weight_sync_seconds}
