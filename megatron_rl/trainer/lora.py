"""LoRA adapters on Megatron-Core's tensor-parallel linears (attention qkv/proj, MLP fc1/fc2).

    apply_lora(model, LoRAConfig(enabled=True, rank=8, alpha=16))   # after the base weights are loaded

Each targeted ColumnParallelLinear / RowParallelLinear keeps its name and its base `weight` (frozen:
requires_grad False, optionally held in bf16) and gains two trainable parameters, `lora_A` [r, in] and
`lora_B` [out, r]; its output becomes  base(x) + scale * B (A dropout(x)),  scale = alpha / rank.
B starts at zero, so the adapted model's outputs at step 0 are the base model's.

Tensor parallelism, as Megatron shards the base weight:
- column-parallel (W split on the output dim): A replicated, B split on its output dim. h = A x is the same on
  every rank; it enters the TP region through `copy_to_tensor_model_parallel_region` (identity forward,
  all-reduce backward), so A's and x's gradients sum the contributions of every output slice.
- row-parallel (W split on the input dim): A split on its input dim, B replicated. h = A_t x_t is a partial sum
  that `reduce_from_tensor_model_parallel_region` all-reduces (identity backward), so B sees the full h.
The merged weight W + scale B A of a rank is then this rank's slice of the merged full weight with no
communication (column: B_t A; row: B A_t), which is what the engine sync sends (`merged_weight`).
Not covered: sequence parallelism, the Transformer-Engine spec, MoE experts (refused with the fix).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from megatron_rl.config import ConfigError

TARGETS = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
           "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}
"""Target name -> the suffix of the Megatron module it adapts (dense layers of the local spec)."""
ADAPTER_NAMES = ("lora_A", "lora_B")
BASE_DTYPES = ("same", "bf16")


@dataclass
class LoRAConfig:
    """Low-rank adapters trained instead of the full weights (off by default)."""

    enabled: bool = False
    """Train LoRA adapters on the targets; every other weight is frozen and only adapters are optimised and
    checkpointed (the base comes from model.init again on resume)."""
    rank: int = 8
    """Rank r of each adapter (A: [r, in], B: [out, r])."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / rank) * B @ A (as Hugging Face PEFT without rsLoRA)."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (0 = none; the engine's merged weights have none)."""
    targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])
    """Adapted projections among qkv, proj (attention) and fc1, fc2 (dense MLP)."""
    base_dtype: str = "same"
    """Dtype the frozen base weights are held in: same (the model's params_dtype) or bf16 (half the memory of
    fp32; the forward casts them up layer by layer)."""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"lora.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ConfigError(f"lora.targets {self.targets} must be a non-empty subset of {list(TARGETS)}")
        if self.base_dtype not in BASE_DTYPES:
            raise ConfigError(f"lora.base_dtype {self.base_dtype!r} is not one of {list(BASE_DTYPES)}")

    def check_model(self, model_cfg, parallel) -> None:
        """Refuse the layouts and models the adapters do not cover, naming the fix."""
        if not self.enabled:
            return
        if getattr(model_cfg, "transformer_impl", "local") != "local":
            raise ConfigError("lora.enabled needs model.transformer_impl=local (the adapters wrap Megatron's "
                              "ColumnParallelLinear/RowParallelLinear, not Transformer Engine's)")
        if parallel.sequence_parallel:
            raise ConfigError("lora.enabled with parallel.sequence_parallel=true is not supported; set it false")


class _LoRAMixin:
    """Forward of an adapted Megatron linear (mixed in ahead of its class; see apply_lora)."""

    lora_column: bool
    lora_scale: float
    lora_dropout: float

    def forward(self, input_, *args, **kwargs):
        out, bias = self._base_forward(input_, *args, **kwargs)
        return out + self._lora_delta(input_).to(out.dtype), bias

    def _base_forward(self, input_, *args, **kwargs):
        w = self._parameters["weight"]
        if w.dtype == input_.dtype:
            return super().forward(input_, *args, **kwargs)
        self._parameters["weight"] = w.to(input_.dtype)  # a bf16-held base, cast up for this forward only
        try:
            return super().forward(input_, *args, **kwargs)
        finally:
            self._parameters["weight"] = w

    def _lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.lora_dropout and self.training:
            x = torch.nn.functional.dropout(x, self.lora_dropout)
        h = torch.matmul(x.to(self.lora_A.dtype), self.lora_A.t())  # [s, b, r]
        tp = self.tp_group
        if tp is not None and tp.size() > 1:
            h = copy_to_tensor_model_parallel_region(h, group=tp) if self.lora_column else \
                reduce_from_tensor_model_parallel_region(h, group=tp)
        return self.lora_scale * torch.matmul(h, self.lora_B.t())  # [s, b, out(/tp)]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": 0, "bias": 0, "lora_B": 0} if self.lora_column else {"weight": 1, "lora_A": 1}
        sd = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                 sharded_offsets, tp_group=self.tp_group,
                                                 dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if self.lora_column and getattr(self.lora_B, "partition_stride", 1) == 2:  # GLU fc1: saved as [gate; up]
            key = f"{prefix}lora_B"  # (the MLP does the same to the weight)
            sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets,
                                                   (metadata or {}).get("singleton_local_shards", False))
        return sd


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (_LoRAMixin, cls), {})
    return _CLASSES[cls]


def targets_of(model: torch.nn.Module, cfg: LoRAConfig) -> dict[str, torch.nn.Module]:
    """{module name: Megatron linear} of the targets in `model` (a GPTModel chunk)."""
    suffixes = tuple("." + TARGETS[t] for t in cfg.targets)
    return {n: m for n, m in model.named_modules() if n.endswith(suffixes) and ".experts." not in n}


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, seed: int = 0) -> list[str]:
    """Freeze every parameter of `model`, then adapt the targets in place; returns the adapted module names.
    A is drawn from a generator seeded by `seed` and the module's global name (Kaiming-uniform, as PEFT), at its
    full shape, each rank keeping its slice: every TP layout starts from the same adapters."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    for p in model.parameters():
        p.requires_grad_(False)
    found = targets_of(model, cfg)
    if not found:
        raise ConfigError(f"lora.targets {cfg.targets}: no such module in the model (MoE experts are not adapted)")
    for name, mod in found.items():
        if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            raise ConfigError(f"lora: {name} is a {type(mod).__name__}, not a Megatron ColumnParallelLinear or "
                              "RowParallelLinear; use model.transformer_impl=local")
        _adapt(mod, isinstance(mod, ColumnParallelLinear), cfg, _global_name(model, name), seed)
    return list(found)


def _global_name(model, name: str) -> str:
    from megatron_rl.trainer.global_names import global_names

    return global_names(model, [name + ".weight"])[name + ".weight"].removesuffix(".weight")


def _adapt(mod, column: bool, cfg: LoRAConfig, global_name: str, seed: int) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    w = mod.weight  # [out/tp, in] (column) or [out, in/tp] (row)
    tp = mod.tp_group.size() if mod.tp_group is not None else 1
    rank = mod.tp_group.rank() if mod.tp_group is not None else 0
    out_full, in_full = (w.shape[0] * tp, w.shape[1]) if column else (w.shape[0], w.shape[1] * tp)
    gen = torch.Generator().manual_seed(_name_seed(seed, global_name))
    a_full = torch.empty(cfg.rank, in_full, dtype=torch.float32)
    bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)) of PEFT's nn.Linear A
    a_full.uniform_(-bound, bound, generator=gen)
    a = a_full if column else a_full.chunk(tp, dim=1)[rank]
    b = torch.zeros(w.shape[0] if column else out_full, cfg.rank)
    mod.lora_A = torch.nn.Parameter(a.to(w.dtype).contiguous())
    mod.lora_B = torch.nn.Parameter(b.to(w.dtype))
    split, dim = (mod.lora_B, 0) if column else (mod.lora_A, 1)
    # a GLU fc1 holds [gate_t; up_t] on each rank (stride 2): B's rows are the weight's rows
    set_tensor_model_parallel_attributes(split, True, dim, getattr(w, "partition_stride", 1) if column else 1)
    other = mod.lora_A if column else mod.lora_B
    set_tensor_model_parallel_attributes(other, False, -1, 1)
    mod.lora_column, mod.lora_scale, mod.lora_dropout = column, cfg.scale, cfg.dropout
    if cfg.base_dtype == "bf16":
        w.data = w.data.to(torch.bfloat16)
    mod.__class__ = _lora_class(type(mod))


def _name_seed(seed: int, name: str) -> int:
    import hashlib

    digest = hashlib.sha256(f"lora/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def is_adapter(name: str) -> bool:
    """`name` is a LoRA adapter parameter (or a key of one)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def is_adapted(module: torch.nn.Module) -> bool:
    return isinstance(module, _LoRAMixin)


@torch.no_grad()
def merged_weight(mod) -> torch.Tensor:
    """This rank's slice of W + scale * B @ A, in the dtype of the adapters (the model's params_dtype)."""
    dtype = mod.lora_A.dtype
    return mod.weight.to(dtype) + mod.lora_scale * (mod.lora_B @ mod.lora_A)


def engine_weights(module: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterable[tuple[str, torch.Tensor]]:
    """`named` (a chunk's weights by local name) as an engine takes them: adapted weights merged, no adapters.
    Unchanged for a model without adapters."""
    adapted = {n + ".weight": m for n, m in module.named_modules() if is_adapted(m)}
    for name, t in named:
        if is_adapter(name):
            continue
        yield name, merged_weight(adapted[name]) if name in adapted else t


def adapter_bytes(module: torch.nn.Module) -> int:
    """Bytes of this rank's adapter parameters."""
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if is_adapter(n))
