"""All parallel degrees in one validated dataclass.

Megatron-Core lays ranks out in the order tp-cp-ep-dp-pp: for the dense part of the model
world = tp * cp * dp * pp; for the expert (MoE) part world = etp * ep * expert_dp * pp. `dp` is derived
from the world size, never set by hand.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_rl import stages
from megatron_rl.config import ConfigError


@dataclass
class ParallelConfig:
    """Parallel layout of the trainer (and of the rollout engine, which reuses tp/ep)."""

    tp: int = 1
    """Tensor-parallel size: attention heads and MLP columns are split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: layers are split into this many stages."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None for the plain schedule; needs pp > 1."""
    cp: int = 1
    """Context-parallel size: each packed sequence is split over this many ranks (2*cp balanced chunks)."""
    ep: int = 1
    """Expert-parallel size: MoE experts are split over this many ranks."""
    etp: int | None = None
    """Expert tensor-parallel size (tensor split inside each expert); None means the same as tp."""
    sequence_parallel: bool = False
    """Split layer-norm/dropout activations along the sequence over the TP group; needs tp > 1."""
    first_stage_layers: int | None = None
    """Transformer layers on the first pipeline rank (over its vpp chunks: a multiple of vpp); None: an equal
    share. Megatron-Core's num_layers_in_first_pipeline_stage; needs pp > 1 (megatron_rl/stages.py)."""
    last_stage_layers: int | None = None
    """Transformer layers on the last pipeline rank (a multiple of vpp); None: an equal share.
    Megatron-Core's num_layers_in_last_pipeline_stage; needs pp > 1."""
    pipeline_layout: str | None = None
    """Explicit layers of every pipeline stage in Megatron-Core's syntax (pipeline_model_parallel_layout):
    pp * vpp stages split by '|' (virtual stage 0 of ranks 0..pp-1, then virtual stage 1, ...), 'E' embedding,
    't' layer, 'm' MTP layer, 'L' loss, '(tt|)*30' repeats; DeepSeek-V3 at pp 8 x vpp 4: 'Et|(tt|)*30mL'.
    None: even (or first/last_stage_layers, which it excludes); needs pp > 1."""
    dp: int | None = field(default=None, init=False)
    """Data-parallel size, derived from the world size by `resolve()` (never set in a config)."""

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the dense model: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    def validate(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp < 1:
            raise ConfigError(f"parallel.etp must be >= 1 or null, got {self.etp}")
        if self.vpp is not None:
            if self.vpp < 1:
                raise ConfigError(f"parallel.vpp must be >= 1 or null, got {self.vpp}")
            if self.pp == 1 and self.vpp > 1:
                raise ConfigError("parallel.vpp > 1 needs parallel.pp > 1 (interleaving splits pipeline stages)")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1 (it splits along the TP group)")
        self._validate_stages()

    @property
    def uneven_stages(self) -> bool:
        """Layers split by first/last counts or an explicit layout (not evenly)."""
        return (self.first_stage_layers, self.last_stage_layers, self.pipeline_layout) != (None, None, None)

    def _validate_stages(self) -> None:
        if not self.uneven_stages:
            return
        if self.pp == 1:
            raise ConfigError("parallel.first_stage_layers / last_stage_layers / pipeline_layout need "
                              "parallel.pp > 1 (they split layers over pipeline stages)")
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} must be >= 1 or null, got {getattr(self, name)}")
        if self.pipeline_layout is not None:
            if self.first_stage_layers is not None or self.last_stage_layers is not None:
                raise ConfigError("parallel.pipeline_layout places every layer; unset parallel.first_stage_layers "
                                  "and last_stage_layers")
            stages.check_layout(self.pipeline_layout, self.pp, self.vpp or 1)

    def chunk_layers(self, num_layers: int) -> list[list[int]]:
        """Transformer layers of each model chunk, [pipeline rank][virtual stage] (validated layouts only)."""
        return stages.chunk_layers(num_layers, self.pp, self.vpp or 1, self.first_stage_layers,
                                   self.last_stage_layers, self.pipeline_layout)

    def layer_offset(self, num_layers: int, pp_rank: int, vp_stage: int = 0) -> int:
        """Global index of the first transformer layer of chunk (pp_rank, vp_stage)."""
        return stages.layer_offset(self.chunk_layers(num_layers), pp_rank, vp_stage)

    def transformer_kwargs(self) -> dict:
        """TransformerConfig fields of the stage split (none for an even one)."""
        if self.pp == 1 or not self.uneven_stages:
            return {}
        return dict(num_layers_in_first_pipeline_stage=self.first_stage_layers,
                    num_layers_in_last_pipeline_stage=self.last_stage_layers,
                    pipeline_model_parallel_layout=self.pipeline_layout)

    def resolve(self, world_size: int) -> ParallelConfig:
        """A copy with `dp` derived from `world_size`; raises ConfigError naming the layout that cannot fit."""
        self.validate()
        if world_size % self.model_parallel_size:
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = "
                f"{self.model_parallel_size}; change parallel.tp/cp/pp or the number of ranks")
        expert_mp = self.expert_tp * self.ep * self.pp
        if world_size % expert_mp:
            raise ConfigError(
                f"world size {world_size} is not divisible by etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} = "
                f"{expert_mp}; change parallel.ep/etp/pp or the number of ranks")
        out = replace(self)
        out.dp = world_size // self.model_parallel_size
        return out

    def check_model(self, *, num_layers: int, num_attention_heads: int, num_query_groups: int | None = None,
                    num_experts: int | None = None, mtp_num_layers: int = 0) -> None:
        """Checks that depend on the model's shape: heads split by tp, layers over the pipeline stages (evenly by
        pp*vpp, or as first/last_stage_layers or pipeline_layout say: megatron_rl/stages.py), experts by ep."""
        if num_attention_heads % self.tp:
            raise ConfigError(
                f"model.num_attention_heads={num_attention_heads} is not divisible by parallel.tp={self.tp}")
        groups = num_query_groups or num_attention_heads
        if groups % self.tp:
            raise ConfigError(f"model.num_query_groups={groups} is not divisible by parallel.tp={self.tp}")
        stages.check(num_layers, mtp_num_layers, self.pp, self.vpp or 1, self.first_stage_layers,
                     self.last_stage_layers, self.pipeline_layout)
        if self.ep > 1 and not num_experts:
            raise ConfigError("parallel.ep > 1 needs a MoE model (model.moe.num_experts > 0)")
        if num_experts and num_experts % self.ep:
            raise ConfigError(f"model.moe.num_experts={num_experts} is not divisible by parallel.ep={self.ep}")

    def megatron_kwargs(self) -> dict:
        """Keyword arguments for `megatron.core.parallel_state.initialize_model_parallel`."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp if self.pp > 1 else None,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.expert_tp,
        )
