"""Per-GPU memory and step time of one layout.

Memory per GPU, for each pipeline rank (the plan reports the worst one):
- weights: bf16 (2 B/param; fp8 precision keeps the layers' weights in fp8, 1 B), dense part / tp,
  routed experts / (ep * etp); embedding on the first stage, output layer (or tied copy) on the last;
- gradients: fp32 main-grad buffers, 4 B/param (Megatron's default for bf16; not sharded: ZeRO-1);
- optimizer: fp32 master + Adam m, v = 12 B/param, divided by dp * cp for the dense part and by
  expert-dp = world / (etp * ep * pp) for the experts when the distributed optimizer is on;
- activations: bytes per token per layer a la Korthikanti et al. 2022 (sequence parallel divides the
  h-sized tensors by tp), flash attention (no s^2 scores), no dropout; times micro-batch tokens / cp, times
  the micro-batches in flight: 1F1B holds min(pp - rank, m) on a rank, the interleaved schedule holds
  2 * (pp - rank - 1) + (vpp - 1) * pp + 1 model chunks (Megatron's warm-up count), i.e. a factor
  1 + (pp - 1) / (pp * vpp) on the first stage; full recompute keeps only each layer's input plus one
  layer's working set; the last stage adds the logits (bf16 + fp32 copy).
Layers go to the pp * vpp model chunks as the trainer places them (megatron_rl/stages.py: evenly, or as
parallel.first_stage_layers / last_stage_layers / pipeline_layout say), the MTP modules on the last chunk; a
split the trainer refuses is planned at the layout its refusal proposes (as even as possible, first and last
chunk taking the shorter share): DeepSeek-V3 at pp 8 x vpp 4 is Megatron's "Et|(tt|)*30mL" either way.

Step time (a ranking heuristic, stated as such): hardware FLOPs / (gpus * peak * matmul_efficiency), times
the slowest pipeline stage's FLOPs over the mean, (1 + pipeline bubble (pp - 1) / (vpp * m)), and a
communication factor that grows with log2 of tp, cp and ep, jumps when a TP/CP or EP group leaves the
NVLink domain, and grows when cp leaves fewer than 2048 tokens per rank.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from megatron_rl import stages
from megatron_rl.config import ConfigError
from megatron_rl.parallel import ParallelConfig
from megatron_rl.tools.plan.count import Arch
from megatron_rl.tools.plan.spec import GPUSpec, PlanConfig, gpu_spec

GB = 1e9
TERMS = ("weights", "gradients", "optimizer", "activations", "overhead")


@dataclass
class Layout:
    """A resolved layout: the ParallelConfig plus the derived data-parallel sizes and micro-batch count."""

    parallel: ParallelConfig
    world: int
    dp: int
    expert_dp: int
    microbatches: int
    recompute: str

    @property
    def etp(self) -> int:
        return self.parallel.expert_tp

    @property
    def vpp(self) -> int:
        return self.parallel.vpp or 1

    def label(self) -> str:
        p = self.parallel
        moe = f"ep={p.ep} etp={self.etp} " if p.ep > 1 or p.etp is not None else ""
        sp = " sp" if p.sequence_parallel else ""
        stages = f" stages={p.pipeline_layout}" if p.pipeline_layout else ""
        if p.first_stage_layers or p.last_stage_layers:
            stages = f" first/last stage layers={p.first_stage_layers}/{p.last_stage_layers}"
        return (f"tp={p.tp}{sp} pp={p.pp} vpp={self.vpp}{stages} cp={p.cp} {moe}dp={self.dp} "
                f"recompute={self.recompute}")


@dataclass
class Plan:
    """The figures of one layout."""

    layout: Layout
    worst_rank: int
    memory_gb: dict[str, float]
    usable_gb: float
    capacity_gb: float
    fits: bool
    reason: str
    step: dict[str, float] = field(default_factory=dict)
    trainer_error: str | None = None
    """Why megatron-rl's trainer would refuse this layout for the model (None: it accepts it)."""

    @property
    def total_gb(self) -> float:
        return sum(self.memory_gb.values())


# ------------------------------------------------------------------------------------------ layout
def resolve_layout(cfg: PlanConfig, arch: Arch, parallel: ParallelConfig, recompute: str) -> Layout:
    """Check `parallel` against the GPUs, the model and the batch; raise ConfigError naming the key."""
    world, p = cfg.cluster.gpus, parallel
    p.validate()
    if arch.heads % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} does not divide model.num_attention_heads={arch.heads}")
    if arch.spec.mla is None and arch.groups % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} does not divide model.num_query_groups={arch.groups}")
    if p.ep > 1 and not arch.num_experts:
        raise ConfigError(f"parallel.ep={p.ep} needs a MoE model (model.moe.num_experts > 0)")
    if arch.num_experts and arch.num_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} does not divide model.moe.num_experts={arch.num_experts}")
    if arch.num_experts and arch.moe_ffn % p.expert_tp:
        raise ConfigError(f"parallel.etp={p.expert_tp} does not divide model.moe.ffn_hidden_size={arch.moe_ffn}")
    p = parallel.resolve(world)
    chunks = p.pp * (p.vpp or 1)
    if chunks > len(arch.layer_kinds()):
        raise ConfigError(f"parallel.pp*vpp = {chunks} exceeds the {len(arch.layer_kinds())} layers (+ MTP)")
    t = cfg.train
    if t.seq_length % (2 * p.cp if p.cp > 1 else 1):
        raise ConfigError(f"train.seq_length={t.seq_length} is not divisible by 2 * parallel.cp = {2 * p.cp}")
    if t.global_batch_size % (t.micro_batch_size * p.dp):
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                          f"train.micro_batch_size * dp = {t.micro_batch_size} * {p.dp}")
    m = t.global_batch_size // (t.micro_batch_size * p.dp)
    return Layout(p, world, p.dp, world // (p.expert_tp * p.ep * p.pp), m, recompute)


def trainer_error(cfg: PlanConfig, parallel: ParallelConfig) -> str | None:
    """The trainer's own check of a layout against the model (`ModelConfig.check_parallel`: heads and query
    groups by tp, layers over the pipeline stages, experts by ep), as a message; None when it accepts it."""
    model = cfg.model
    if cfg.arch.mtp_layers and not model.mtp_num_layers:  # the plan's MTP depth (arch.mtp_layers) is the model's
        model = dataclasses.replace(model, mtp_num_layers=cfg.arch.mtp_layers)
    try:
        model.check_parallel(parallel)
    except ConfigError as e:
        return str(e)
    return None


def chunk_layers(parallel: ParallelConfig, num_layers: int, mtp: int) -> list[list[int]]:
    """Transformer layers per chunk [pp rank][virtual stage] as the trainer builds them; for a split it refuses,
    the split its refusal proposes."""
    pp, vpp = parallel.pp, parallel.vpp or 1
    try:
        stages.check(num_layers, mtp, pp, vpp, parallel.first_stage_layers, parallel.last_stage_layers,
                     parallel.pipeline_layout)
    except ConfigError:
        return stages.chunk_layers(num_layers, pp, vpp, layout=stages.propose(num_layers, mtp, pp, vpp))
    return parallel.chunk_layers(num_layers)


def rank_chunks(kinds: tuple[str, ...], parallel: ParallelConfig) -> list[list[tuple[str, ...]]]:
    """For each pipeline rank, its model chunks (virtual stage v of every rank before v + 1), each a tuple of
    kinds; the MTP modules (kinds 'mtp', last) on the last chunk."""
    pp, vpp = parallel.pp, parallel.vpp or 1
    mtp = kinds.count("mtp")
    counts, start, chunks = chunk_layers(parallel, len(kinds) - mtp, mtp), 0, {}
    for v in range(vpp):
        for r in range(pp):
            chunks[r, v] = kinds[start:start + counts[r][v]]
            start += counts[r][v]
    chunks[pp - 1, vpp - 1] += kinds[start:]
    return [[chunks[r, v] for v in range(vpp)] for r in range(pp)]


# ---------------------------------------------------------------------------------- activations
def layer_activation_bytes(arch: Arch, kind: str, lay: Layout, imbalance: float, keep: str) -> float:
    """Activation bytes per token of the micro-batch that one layer saves for backward on one rank.

    `keep` is "none" (everything), "selective" (Megatron's `--recompute-modules core_attn layernorm
    mla_up_proj moe_act`: norm outputs, MLA up-projections and the experts' activation recomputed) or
    "full" (only the layer input)."""
    p = lay.parallel
    tp, sp = p.tp, (p.tp if p.sequence_parallel else 1)
    h = arch.h
    if keep == "full":
        return 2 * h / sp
    full = keep == "none"
    act = 2 * h / sp + (2 * h / sp if full else 0) + _attention_act(arch, tp, full)
    inner = "moe" if kind == "moe" or (kind == "mtp" and arch.num_experts) else "dense"
    act += 2 * h / sp + (2 * h / sp if full else 0)                       # MLP norm input / output
    if inner == "dense":
        act += _mlp_act(arch, arch.ffn, tp)
    else:
        act += _moe_act(arch, lay, sp, imbalance, full)
    if kind == "mtp":
        act += 3 * 2 * h / sp                                              # two norms + eh_proj input
    return act


def _attention_act(arch: Arch, tp: int, full: bool) -> float:
    a, mla = arch.heads, arch.spec.mla
    if mla is None:
        qkv = 2 * (a + 2 * arch.groups) * arch.head_dim / tp
        return qkv + 2 * a * arch.head_dim / tp + 4 * a / tp                # Q,K,V + O + softmax lse
    latent = 2 * ((mla.q_lora_rank or 0) + mla.kv_lora_rank + mla.qk_rope_head_dim)  # full on each rank
    latent_norm = 2 * ((mla.q_lora_rank or 0) + mla.kv_lora_rank) if full else 0
    qkv = 2 * a * (2 * arch.qk_dim + mla.v_head_dim) / tp if full else 0     # up-projections
    return latent + latent_norm + qkv + 2 * a * mla.v_head_dim / tp + 4 * a / tp


def _mlp_act(arch: Arch, ffn: int, tp: int) -> float:
    """fc1 output (SwiGLU: gate + up) and activation output (fc2 input); no Megatron module recomputes it."""
    return 2 * (arch.mlp_mult - 1) * ffn / tp + 2 * ffn / tp


def _moe_act(arch: Arch, lay: Layout, sp: int, imbalance: float, full: bool) -> float:
    moe, h, etp = arch.model.moe, arch.h, lay.etp
    copies = moe.topk * imbalance / sp                      # routed token copies per local token of this rank
    router = 8 * arch.num_experts / sp                      # fp32 logits + probabilities
    # fc1 input (gathered over etp), fc1 output, activation output; the routing probabilities are applied
    # inside the activation (Megatron's grouped MLP), so the un-permute/combine saves nothing.
    routed = copies * (2 * h * etp + 2 * (arch.mlp_mult - 1) * arch.moe_ffn + (2 * arch.moe_ffn if full else 0))
    shared = _mlp_act(arch, moe.shared_expert_ffn_hidden_size, lay.parallel.tp) \
        if moe.shared_expert_ffn_hidden_size else 0.0
    return router + routed + shared


def inflight_chunks(rank: int, lay: Layout) -> list[int]:
    """Model-chunk index (0..vpp-1) of each micro-batch whose activations a rank holds at its peak."""
    pp, v, m = lay.parallel.pp, lay.vpp, lay.microbatches
    if v == 1:
        return [0] * min(pp - rank, m)
    n = min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v)
    return [(k % (pp * v)) // pp for k in range(n)]


# ------------------------------------------------------------------------------------ memory terms
def rank_memory(cfg: PlanConfig, arch: Arch, lay: Layout, rank: int, chunks) -> dict[str, float]:
    """Bytes of each memory term on pipeline rank `rank` holding model chunks `chunks`."""
    p, pp = lay.parallel, lay.parallel.pp
    kinds = [k for c in chunks for k in c]
    layer_p = [arch.layers[k] for k in kinds]
    dense = sum(lp.tp_split / p.tp + lp.replicated for lp in layer_p)
    experts = sum(lp.experts for lp in layer_p) / (p.ep * lay.etp)
    edge = (arch.embedding / p.tp if rank == 0 else 0)
    if rank == pp - 1:
        edge += arch.norm + (arch.embedding / p.tp if (not arch.model.tie_embeddings or pp > 1) else 0)
    wbytes = 1 if cfg.train.precision == "fp8" else 2
    weights = (dense + experts) * wbytes + edge * 2
    grads = 4 * (dense + experts + edge)
    if cfg.train.distributed_optimizer:
        optim = 12 * ((dense + edge) / (lay.dp * p.cp) + experts / lay.expert_dp)
    else:
        optim = 12 * (dense + edge + experts)
    act = _rank_activations(cfg, arch, lay, rank, chunks)
    return {"weights": weights, "gradients": grads, "optimizer": optim, "activations": act,
            "overhead": cfg.cluster.overhead_gb * GB}


def _rank_activations(cfg: PlanConfig, arch: Arch, lay: Layout, rank: int, chunks) -> float:
    t, p = cfg.train, lay.parallel
    tokens = t.micro_batch_size * t.seq_length / p.cp
    keep = lay.recompute
    per_chunk = [sum(layer_activation_bytes(arch, k, lay, t.moe_imbalance, keep) for k in c) for c in chunks]
    total = sum(per_chunk[c] for c in inflight_chunks(rank, lay)) * tokens
    kinds = {k for c in chunks for k in c}
    if keep == "full" and kinds:      # one layer's working set while it is recomputed
        total += max(layer_activation_bytes(arch, k, lay, t.moe_imbalance, "none") for k in kinds) * tokens
    if rank == p.pp - 1:              # logits: bf16 + fp32 copy for the log-softmax, main head + MTP heads
        total += 6 * arch.model.vocab_size / p.tp * tokens * (1 + arch.spec.mtp_layers)
    if rank == 0:                     # embedding output of the micro-batches in flight
        first = sum(1 for c in inflight_chunks(rank, lay) if c == 0)
        total += 2 * arch.h / (p.tp if p.sequence_parallel else 1) * tokens * first
    return total


def plan_layout(cfg: PlanConfig, arch: Arch, lay: Layout, gpu: GPUSpec | None = None) -> Plan:
    """Memory of the worst pipeline rank, the fit verdict with its reason, and the step estimate."""
    gpu = gpu or gpu_spec(cfg.cluster.gpu)
    per_rank = rank_chunks(arch.layer_kinds(), lay.parallel)
    mems = [rank_memory(cfg, arch, lay, r, chunks) for r, chunks in enumerate(per_rank)]
    worst = max(range(len(mems)), key=lambda r: sum(mems[r].values()))
    mem_gb = {k: v / GB for k, v in mems[worst].items()}
    usable = gpu.memory_gb * (1 - cfg.cluster.margin)
    total = sum(mem_gb.values())
    fits = total <= usable
    big = max((k for k in TERMS if k != "overhead"), key=lambda k: mem_gb[k])
    reason = (f"fits: {total:.1f} GB of {usable:.1f} GB usable" if fits else
              f"does not fit: {total:.1f} GB > {usable:.1f} GB usable ({gpu.memory_gb:g} GB - "
              f"{cfg.cluster.margin:.0%} margin) on pipeline rank {worst}; largest term: {big} "
              f"{mem_gb[big]:.1f} GB{_hint(big)}")
    plan = Plan(lay, worst, mem_gb, usable, gpu.memory_gb, fits, reason)
    plan.step = step_estimate(cfg, arch, lay, gpu)
    plan.trainer_error = trainer_error(cfg, lay.parallel)
    return plan


def _hint(term: str) -> str:
    return {"activations": " (try recompute=full, a larger tp/cp/pp, or a smaller micro-batch)",
            "weights": " (try a larger tp/pp/ep)", "gradients": " (try a larger tp/pp/ep)",
            "optimizer": " (try the distributed optimizer or a larger dp / expert-dp)"}[term]


# --------------------------------------------------------------------------------------- step time
def step_estimate(cfg: PlanConfig, arch: Arch, lay: Layout, gpu: GPUSpec) -> dict[str, float]:
    """FLOPs per step and a time estimate (heuristic; used to rank layouts)."""
    t, c, p = cfg.train, cfg.cluster, lay.parallel
    tokens = t.global_batch_size * t.seq_length
    n_mat = arch.train_matmul_params()
    attn = arch.attention_flops_per_token(t.seq_length)
    model_flops = (6.0 * n_mat + attn) * tokens
    extra = {"none": 0.0, "full": (2.0 * n_mat + attn / 3),
             "selective": 2.0 * sum(arch.layers[k].selective_recompute for k in arch.layer_kinds())}
    hw_flops = model_flops + extra[lay.recompute] * tokens
    peak = (gpu.fp8_tflops if t.precision == "fp8" else gpu.bf16_tflops) * 1e12
    compute_s = hw_flops / (lay.world * peak * c.matmul_efficiency)
    bubble = (p.pp - 1) / (lay.vpp * lay.microbatches)
    imbalance = stage_imbalance(arch, lay, t.seq_length)
    step_s = compute_s * imbalance * (1 + bubble) * _comm_factor(cfg, arch, lay)
    return {"tokens": float(tokens), "model_flops": model_flops, "hardware_flops": hw_flops,
            "bubble": bubble, "stage_imbalance": imbalance, "step_seconds": step_s,
            "mfu": model_flops / (step_s * lay.world * gpu.bf16_tflops * 1e12),
            "tokens_per_gpu_per_s": tokens / step_s / lay.world}


def stage_imbalance(arch: Arch, lay: Layout, seq_length: int) -> float:
    """Slowest pipeline stage's FLOPs / the mean (the output layer and MTP weigh on the last stage)."""
    pp = lay.parallel.pp
    attn = 3.0 * seq_length * arch.heads * (arch.qk_dim + arch.v_dim)
    per_rank = [sum(6.0 * arch.layers[k].active + attn for c in chunks for k in c)
                for chunks in rank_chunks(arch.layer_kinds(), lay.parallel)]
    per_rank[-1] += 6.0 * arch.embedding
    return max(per_rank) / (sum(per_rank) / pp)


def _comm_factor(cfg: PlanConfig, arch: Arch, lay: Layout) -> float:
    p, node = lay.parallel, cfg.cluster.gpus_per_node
    f = 1 + 0.04 * math.log2(p.tp) + 0.03 * math.log2(p.cp)
    local = cfg.train.seq_length // p.cp
    if local < 2048:
        f += 0.1 * math.log2(2048 / local)           # short per-rank chunks: small, inefficient GEMMs
    if p.tp * p.cp > node:
        f += 0.5                                     # TP/CP collectives over the inter-node network
    if arch.num_experts:
        f += 0.02 * math.log2(p.ep * lay.etp)
        if p.ep * lay.etp > node:                    # expert all-to-all leaves NVLink
            f += 0.1 * math.log2(p.ep * lay.etp / node)
    if lay.recompute == "full":
        f += 0.02
    return f
