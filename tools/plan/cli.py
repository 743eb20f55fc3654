"""`megatron-rl plan CONFIG --gpus N --gpu h100|h200|b200 [--layout ...] [--search] [--json]`.

Exit status: 0 the layout fits (or the search found layouts), 1 it does not fit (or none was found),
2 bad input (the message names the key).
"""
from __future__ import annotations

import argparse
import json
import sys

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.parallel import ParallelConfig
from megatron_rl.tools.plan.count import Arch
from megatron_rl.tools.plan.memory import TERMS, Plan, chunk_layers, plan_layout, resolve_layout
from megatron_rl.tools.plan.search import rollout_figures, search
from megatron_rl.tools.plan.spec import PlanConfig, gpu_spec, load_plan_config

LAYOUT_KEYS = ("tp", "pp", "vpp", "cp", "ep", "etp", "sp")
STAGE_KEYS = ("first_stage_layers", "last_stage_layers", "pipeline_layout")
"""The config's uneven stage split, kept unless --layout changes pp or vpp."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rl plan", description=(
        "Per-GPU memory (weights, gradients, optimizer, activations), step FLOPs/time, rollout KV cache and "
        "weight-sync bandwidth of a config's parallel layout; --search ranks the layouts that fit."))
    p.add_argument("config", help="plan config (configs/plan/deepseek_v3_671b.yaml) or run config "
                                  "(configs/demo_cpu.yaml)")
    p.add_argument("--gpus", type=int, help="trainer GPUs (default: cluster.gpus of the config)")
    p.add_argument("--gpu", help="GPU kind: h100, h200 or b200 (default: cluster.gpu)")
    p.add_argument("--layout", help="e.g. tp=2,pp=8,vpp=4,ep=64,cp=1,etp=1,sp=1 (sp: sequence parallel 0/1); "
                                    "degrees not given keep the config's parallel values")
    p.add_argument("--precision", choices=("bf16", "fp8"))
    p.add_argument("--recompute", choices=("none", "selective", "full"))
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--seq-length", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--margin", type=float, help="fraction of GPU memory kept free (default cluster.margin)")
    p.add_argument("--search", action="store_true", help="enumerate layouts that fit, fastest first")
    p.add_argument("--top", type=int, default=10, help="layouts shown by --search (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override of the config, e.g. --set rollout.batch=512 (repeatable)")
    return p


def parse_layout(text: str, base: ParallelConfig | None = None) -> ParallelConfig:
    """'tp=2,pp=8,vpp=4,ep=64' -> ParallelConfig: every degree given is kept; the others come from `base`
    (the config's parallel), except vpp when pp changes, the uneven stage split (STAGE_KEYS) when pp or vpp
    changes, and sequence parallel when tp changes (then on exactly when tp > 1)."""
    base = base or ParallelConfig()
    values: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, val = item.partition("=")
        if key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout: unknown key {key!r}; use {', '.join(LAYOUT_KEYS)} (dp is derived)")
        try:
            values[key] = int(val)
        except ValueError:
            raise ConfigError(f"--layout: {key}={val!r} is not an integer") from None
    sp = values.pop("sp", None)
    if sp not in (None, 0, 1):
        raise ConfigError(f"--layout: sp={sp} must be 0 or 1 (sequence parallel off/on)")
    kept = {k: getattr(base, k) for k in ("tp", "pp", "vpp", "cp", "ep", "etp", *STAGE_KEYS)}
    if "pp" in values and values["pp"] != base.pp:
        kept["vpp"] = None
    if any(k in values and values[k] != getattr(base, k) for k in ("pp", "vpp")):
        kept.update(dict.fromkeys(STAGE_KEYS))  # a stage split is for one pp x vpp
    par = from_dict(ParallelConfig, {**kept, **values}, prefix="parallel")
    if sp is not None:
        par.sequence_parallel = bool(sp)
    else:
        par.sequence_parallel = base.sequence_parallel if par.tp == base.tp else par.tp > 1
    return par


def apply_args(cfg: PlanConfig, args: argparse.Namespace) -> PlanConfig:
    if args.gpus is not None:
        if args.gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
        cfg.cluster.gpus = args.gpus
    if args.gpu is not None:
        gpu_spec(args.gpu, key="--gpu")
        cfg.cluster.gpu = args.gpu.lower()
    if args.layout:
        cfg.parallel = parse_layout(args.layout, cfg.parallel)
    for name in ("precision", "recompute", "micro_batch_size", "seq_length", "global_batch_size"):
        if getattr(args, name) is not None:
            setattr(cfg.train, name, getattr(args, name))
    if args.margin is not None:
        cfg.cluster.margin = args.margin
    from megatron_rl.config import validate

    validate(cfg)
    return cfg


def plan_dict(cfg: PlanConfig, arch: Arch, plan: Plan) -> dict:
    lay = plan.layout
    return {"layout": {"tp": lay.parallel.tp, "pp": lay.parallel.pp, "vpp": lay.vpp, "cp": lay.parallel.cp,
                       "ep": lay.parallel.ep, "etp": lay.etp, "sequence_parallel": lay.parallel.sequence_parallel,
                       "dp": lay.dp, "expert_dp": lay.expert_dp,
                       "microbatches": lay.microbatches, "recompute": lay.recompute,
                       "pipeline_layout": lay.parallel.pipeline_layout,
                       "first_stage_layers": lay.parallel.first_stage_layers,
                       "last_stage_layers": lay.parallel.last_stage_layers,
                       "chunk_layers": chunk_layers(lay.parallel, arch.model.num_layers,
                                                    arch.layer_kinds().count("mtp"))},
            "memory_gb": {k: round(v, 3) for k, v in plan.memory_gb.items()},
            "total_gb": round(plan.total_gb, 3), "usable_gb": round(plan.usable_gb, 3), "fits": plan.fits,
            "reason": plan.reason, "worst_pipeline_rank": plan.worst_rank, "step": plan.step,
            "trainer_accepts": plan.trainer_error is None, "trainer_error": plan.trainer_error}


def model_dict(cfg: PlanConfig, arch: Arch) -> dict:
    return {"name": cfg.name, "total_params": arch.total_params, "active_params": arch.active_params,
            "embedding_params": arch.embedding, "mtp_params": arch.mtp_params,
            "layers": arch.model.num_layers, "experts": arch.num_experts,
            "attention": "MLA" if arch.spec.mla else ("GQA" if arch.groups < arch.heads else "MHA")}


def format_plan(cfg: PlanConfig, arch: Arch, plan: Plan, rollout: dict) -> str:
    gpu, t, lay = gpu_spec(cfg.cluster.gpu), cfg.train, plan.layout
    moe = (f", MoE {arch.num_experts} experts top-{arch.model.moe.topk}" if arch.num_experts else "")
    lines = [
        f"plan {cfg.name}: {cfg.cluster.gpus} x {gpu.name}, {t.precision}, mbs {t.micro_batch_size} x seq "
        f"{t.seq_length}, global batch {t.global_batch_size}",
        f"model: {_n(arch.total_params)} params ({model_dict(cfg, arch)['attention']}{moe}), "
        f"{_n(arch.active_params)} active matmul params/token (+{_n(arch.embedding)} embedding lookup)"
        + (f", MTP {_n(arch.mtp_params)}" if arch.mtp_params else ""),
        f"layout: {lay.label()}" + (f" expert-dp={lay.expert_dp}" if arch.num_experts else "")
        + f", {lay.microbatches} micro-batches/step per dp rank",
        f"per-GPU memory (worst pipeline rank {plan.worst_rank}):"]
    lines += [f"  {k:<12}{plan.memory_gb[k]:8.2f} GB" for k in TERMS]
    lines.append(f"  {'total':<12}{plan.total_gb:8.2f} GB   {plan.reason}")
    if plan.trainer_error:
        lines.append(f"note: the trainer refuses this layout: {plan.trainer_error}")
    s = plan.step
    lines.append(f"step: {s['tokens']:.3g} tokens, {s['model_flops']:.3g} model FLOPs "
                 f"({s['hardware_flops']:.3g} with recompute), bubble {s['bubble']:.1%}, est. "
                 f"{s['step_seconds']:.1f} s/step, MFU {s['mfu']:.1%} (assumed matmul efficiency "
                 f"{cfg.cluster.matmul_efficiency:.0%})")
    r = cfg.rollout
    lines.append(f"rollout ({r.gpus} GPUs, tp {r.tp}, {r.batch} seqs x {r.context_length} ctx, {r.kv_cache_dtype} KV): "
                 f"weights {rollout['weights_gb']:.1f} GB + KV cache {rollout['kv_cache_gb']:.1f} GB per GPU "
                 f"({rollout['kv_bytes_per_token'] / 1e3:.1f} kB/token), "
                 f"{'fits' if rollout['fits'] else 'DOES NOT FIT'} in {rollout['usable_gb']:.1f} GB; "
                 f"max batch ~{int(rollout['max_batch'])}")
    lines.append(f"weight sync: {rollout['weight_sync_gb']:.1f} GB bf16 per step -> "
                 f"{rollout['weight_sync_gb_s']:.1f} GB/s aggregate within {r.weight_sync_seconds:g} s "
                 f"(~{rollout['per_trainer_gpu_gb_s']:.2f} GB/s per trainer GPU sending its own shard)")
    return "\n".join(lines)


def _n(count: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return f"{count:.0f}"


def _run(args: argparse.Namespace) -> int:
    cfg = apply_args(load_plan_config(args.config, args.set), args)
    arch = Arch(cfg.model, cfg.arch)
    if args.search:
        return _run_search(cfg, arch, args)
    plan = plan_layout(cfg, arch, resolve_layout(cfg, arch, cfg.parallel, cfg.train.recompute))
    rollout = rollout_figures(cfg, arch)
    wb = 1 if cfg.train.precision == "fp8" else 2
    rollout["per_trainer_gpu_gb_s"] = plan.memory_gb["weights"] * 2 / wb / cfg.rollout.weight_sync_seconds
    if args.json:
        print(json.dumps({"model": model_dict(cfg, arch), "plan": plan_dict(cfg, arch, plan),
                          "rollout": rollout, "gpu": cfg.cluster.gpu, "gpus": cfg.cluster.gpus}))
    else:
        print(format_plan(cfg, arch, plan, rollout))
    return 0 if plan.fits else 1


def _run_search(cfg: PlanConfig, arch: Arch, args: argparse.Namespace) -> int:
    plans, tried = search(cfg, arch, args.recompute)
    shown = plans[:args.top]
    if args.json:
        print(json.dumps({"model": model_dict(cfg, arch), "tried": tried, "fitting": len(plans),
                          "plans": [plan_dict(cfg, arch, p) for p in shown]}))
    else:
        gpu = gpu_spec(cfg.cluster.gpu)
        print(f"search {cfg.name}: {cfg.cluster.gpus} x {gpu.name}: {len(plans)} of {tried} layouts fit "
              f"({gpu.memory_gb:g} GB - {cfg.cluster.margin:.0%} margin); fastest first:")
        for p in shown:
            print(f"  {p.step['step_seconds']:8.2f} s/step  MFU {p.step['mfu']:5.1%}  {p.total_gb:6.1f} GB  "
                  f"{p.layout.label()}")
    return 0 if plans else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _run(args)
    except ConfigError as e:
        print(f"megatron-rl plan: {e}", file=sys.stderr)
        return 2
