"""Planner inputs: the `PlanConfig` YAML schema, the planner-only `ArchSpec`, and the GPU table.

A plan config (`configs/plan/llama3_8b.yaml`, `configs/plan/deepseek_v3_671b.yaml`, ...) has these top-level sections,
all loaded strictly with `megatron_rl.config.from_dict` (unknown keys rejected with their dotted name):

    name:     a label for the printout
    model:    our `ModelConfig`, exactly the `model:` section of a run config (kept strict and unchanged)
    arch:     `ArchSpec`, what ModelConfig does not describe: MLA, first-k dense layers, MTP, head dim
    parallel: `ParallelConfig` (tp, pp, vpp, cp, ep, etp, sequence_parallel); dp is derived from the GPUs
    train:    `PlanTrainConfig`: micro/global batch, sequence length, precision, recompute, optimizer
    rollout:  `RolloutPlanConfig`: rollout-engine shape for the KV-cache and weight-sync figures
    cluster:  `ClusterConfig`: GPU count and kind, memory margin, assumed matmul efficiency

A run config (sections launch/parallel/model/optim/data/train, e.g. `configs/demo_cpu.yaml`) is accepted too:
it is loaded as a `RunConfig` and mapped onto a PlanConfig (GPUs = launch.nproc_per_node, global batch =
micro_batch_size * num_microbatches * dp, optimizer sharding from optim.distributed_optimizer).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_rl.config import ConfigError, apply_overrides, from_dict, read_yaml_mapping
from megatron_rl.models.gpt import ModelConfig
from megatron_rl.parallel import ParallelConfig


@dataclass(frozen=True)
class GPUSpec:
    """One row of the GPU table (figures per GPU, dense, no sparsity)."""

    name: str
    memory_gb: float
    bf16_tflops: float
    fp8_tflops: float
    hbm_tb_s: float
    nvlink_gb_s: float
    source: str


# Per-GPU figures; "datasheet" = NVIDIA's product datasheets (H100 SXM5, H200 SXM, HGX/DGX B200), dense
# (non-sparse) tensor-core throughput. GB = 1e9 bytes, as the datasheets count.
GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("H100 SXM 80 GB", 80, 989, 1979, 3.35, 900, "datasheet"),
    "h200": GPUSpec("H200 SXM 141 GB", 141, 989, 1979, 4.8, 900, "datasheet"),
    "b200": GPUSpec("B200 192 GB", 192, 2250, 4500, 8.0, 1800, "datasheet"),
}


def gpu_spec(name: str, key: str = "cluster.gpu") -> GPUSpec:
    if name.lower() not in GPUS:
        raise ConfigError(f"{key}: unknown GPU {name!r}; choose one of {', '.join(GPUS)} "
                          "(the table is GPUS in tools/plan/spec.py)")
    return GPUS[name.lower()]


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): low-rank query and key/value projections."""

    q_lora_rank: int | None = 1536
    """Rank of the query down-projection; None projects queries directly from the hidden state."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent (what the KV cache stores)."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dimensions that carry RoPE (the key part is shared by all heads)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dimensions without RoPE."""
    v_head_dim: int = 128
    """Per-head value dimension."""

    def validate(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"arch.mla.{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ConfigError(f"arch.mla.q_lora_rank must be >= 1 or null, got {self.q_lora_rank}")


@dataclass
class ArchSpec:
    """Planner-only architecture details beyond `ModelConfig` (which stays what the trainer builds)."""

    kv_channels: int | None = None
    """Attention head dimension (prefer model.head_dim, which the trainer builds); None means model.head_dim,
    else hidden_size / num_attention_heads (ignored with MLA)."""
    mla: MLAConfig | None = None
    """Multi-head latent attention instead of (grouped-query) attention; None for GQA/MHA."""
    first_k_dense_layers: int = 0
    """In a MoE model, the first k layers use a dense MLP of model.ffn_hidden_size instead of experts."""
    mtp_layers: int = 0
    """Multi-token-prediction modules (DeepSeek-V3: 1); each is one extra layer + a 2h->h projection."""
    router_bias: bool = False
    """MoE router has a per-expert bias (DeepSeek-V3's aux-loss-free balancing)."""

    def validate(self) -> None:
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ConfigError(f"arch.kv_channels must be >= 1 or null, got {self.kv_channels}")
        if self.first_k_dense_layers < 0 or self.mtp_layers < 0:
            raise ConfigError("arch.first_k_dense_layers and arch.mtp_layers must be >= 0")


@dataclass
class PlanTrainConfig:
    """The training step being planned."""

    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    seq_length: int = 4096
    """Tokens per (packed) sequence."""
    global_batch_size: int = 1024
    """Sequences per optimizer step over all data-parallel ranks."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """bf16, or fp8 (fp8 weights in the layers via fp8 param-gather, fp8 GEMM peak; activations as bf16)."""
    recompute: Literal["none", "selective", "full"] = "selective"
    """Activation recompute: none; selective (norms, MLP activation, MLA up-projections); full (per layer)."""
    distributed_optimizer: bool = True
    """Shard fp32 master weights and Adam moments over data-parallel ranks (over expert-DP for experts)."""
    moe_imbalance: float = 1.0
    """Routed tokens on the busiest expert rank / the mean (1.0 = perfectly balanced routing)."""

    def validate(self) -> None:
        for name in ("micro_batch_size", "seq_length", "global_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.moe_imbalance < 1.0:
            raise ConfigError(f"train.moe_imbalance must be >= 1.0, got {self.moe_imbalance}")


@dataclass
class RolloutPlanConfig:
    """One rollout-engine instance (for the KV cache) and the weight sync into it."""

    gpus: int = 8
    """GPUs per engine instance; routed experts are spread over all of them."""
    tp: int = 8
    """Tensor-parallel size of attention; gpus / tp attention data-parallel replicas split the batch."""
    batch: int = 256
    """Sequences decoded concurrently by one instance."""
    context_length: int = 8192
    """Prompt + response tokens per sequence held in the KV cache."""
    kv_cache_dtype: Literal["bf16", "fp8"] = "bf16"
    """KV-cache element type."""
    weight_sync_seconds: float = 30.0
    """Time budget per step to move the new bf16 weights from the trainer to the engines."""

    def validate(self) -> None:
        if self.gpus < 1 or self.tp < 1 or self.gpus % self.tp:
            raise ConfigError(f"rollout.tp={self.tp} must divide rollout.gpus={self.gpus} (both >= 1)")
        if self.batch < 1 or self.context_length < 1 or self.weight_sync_seconds <= 0:
            raise ConfigError("rollout.batch, rollout.context_length and rollout.weight_sync_seconds must be > 0")


@dataclass
class ClusterConfig:
    """The machines."""

    gpus: int = 8
    """Trainer GPUs (the world size)."""
    gpu: str = "h100"
    """GPU kind: a key of the GPU table (h100, h200, b200)."""
    gpus_per_node: int = 8
    """GPUs joined by NVLink; TP/CP/EP groups larger than this cross the network."""
    margin: float = 0.1
    """Fraction of GPU memory kept free (allocator fragmentation, spikes)."""
    overhead_gb: float = 3.0
    """Fixed per-GPU memory outside the model: CUDA context, NCCL buffers, workspaces."""
    matmul_efficiency: float = 0.5
    """Assumed fraction of dense peak the matmuls reach, before pipeline-bubble and communication losses."""

    def validate(self) -> None:
        gpu_spec(self.gpu)
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"cluster.gpus and cluster.gpus_per_node must be >= 1, got {self.gpus}, "
                              f"{self.gpus_per_node}")
        if not 0 <= self.margin < 1 or not 0 < self.matmul_efficiency <= 1:
            raise ConfigError("cluster.margin must be in [0, 1) and cluster.matmul_efficiency in (0, 1]")


@dataclass
class PlanConfig:
    """Everything `megatron-rl plan` needs (see the module docstring for the file layout)."""

    name: str = "plan"
    """Label for the printout."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model, as in a run config's `model:` section."""
    arch: ArchSpec = field(default_factory=ArchSpec)
    """Planner-only architecture details."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the trainer."""
    train: PlanTrainConfig = field(default_factory=PlanTrainConfig)
    """The training step."""
    rollout: RolloutPlanConfig = field(default_factory=RolloutPlanConfig)
    """The rollout engine."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The machines."""

    def validate(self) -> None:
        moe = self.model.moe
        hd, kv = self.model.head_dim, self.arch.kv_channels
        if hd is not None and kv is not None and hd != kv:
            raise ConfigError(f"arch.kv_channels={kv} contradicts model.head_dim={hd}; keep model.head_dim only")
        if self.arch.first_k_dense_layers and not moe.num_experts:
            raise ConfigError("arch.first_k_dense_layers needs a MoE model (model.moe.num_experts > 0)")
        if self.arch.first_k_dense_layers > self.model.num_layers:
            raise ConfigError(f"arch.first_k_dense_layers={self.arch.first_k_dense_layers} exceeds "
                              f"model.num_layers={self.model.num_layers}")


RUN_CONFIG_ONLY_KEYS = ("launch", "optim", "data", "seed", "output_dir")


def load_plan_config(path: str | Path, overrides: list[str] | None = None) -> PlanConfig:
    """A PlanConfig from a plan config file, or mapped from a run config file (see module docstring)."""
    data = apply_overrides(read_yaml_mapping(path), overrides or [])
    if any(k in data for k in RUN_CONFIG_ONLY_KEYS):
        return _from_run_config(data)
    return from_dict(PlanConfig, data)


def _from_run_config(data: dict) -> PlanConfig:
    from megatron_rl.run_config import RunConfig

    run = from_dict(RunConfig, data)
    world = run.launch.nproc_per_node
    dp = run.parallel.resolve(world).dp
    t = run.train
    train = PlanTrainConfig(micro_batch_size=t.micro_batch_size, seq_length=t.seq_length,
                            global_batch_size=t.micro_batch_size * t.num_microbatches * dp,
                            recompute="none", distributed_optimizer=run.optim.distributed_optimizer)
    return PlanConfig(name=run.name, model=run.model, parallel=run.parallel, train=train,
                      cluster=ClusterConfig(gpus=world))
