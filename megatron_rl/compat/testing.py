"""Layout-independent weights for parity tests: a TP/PP/EP-sharded model equals the one-process one.

Every parameter is drawn from a generator seeded by a hash of its *global* name (the name it has in the
unsharded one-process model), at its *global* shape; each rank then keeps its tensor-parallel slice.
Global names undo pipeline/virtual-pipeline layer offsets (``TransformerLayer.layer_number``), expert
parallel offsets (``SequentialMLP`` local experts) and the tied output layer of the last stage.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import torch

EMBEDDING_NAME = "embedding.word_embeddings.weight"
"""Global name of the word embeddings; the last stage's tied output weight is drawn under it too."""


def _strip_wrappers(name: str) -> str:
    """'module.module.decoder.x' (DDP, Float16Module) -> 'decoder.x'."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _prefix_renames(model: torch.nn.Module) -> dict[str, str]:
    """Local module-name prefixes -> global ones for transformer layers and local experts."""
    renames, layers = {}, {}
    for name, module in model.named_modules():
        name = _strip_wrappers(name)
        layer = re.fullmatch(r"(.*layers\.)(\d+)", name)
        if layer and hasattr(module, "layer_number"):
            renames[name] = layers[name] = f"{layer.group(1)}{module.layer_number - 1}"
        if hasattr(module, "local_experts") and hasattr(module, "ep_group"):
            offset = module.ep_group.rank() * module.num_local_experts
            owner = next((k for k in sorted(layers, key=len, reverse=True) if name.startswith(k + ".")), None)
            glob = layers[owner] + name[len(owner):] if owner else name  # the layer's global index too (PP)
            for j in range(module.num_local_experts):
                renames[f"{name}.local_experts.{j}"] = f"{glob}.local_experts.{offset + j}"
    return renames


def global_param_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> global (one-process) name, for one model chunk."""
    renames = _prefix_renames(model)
    out = {}
    for local, param in model.named_parameters():
        parts = _strip_wrappers(local).split(".")
        name = ".".join(parts)
        for cut in range(len(parts) - 1, 0, -1):  # longest renamed prefix wins
            head = ".".join(parts[:cut])
            if head in renames:
                name = ".".join([renames[head], *parts[cut:]])
                break
        out[local] = EMBEDDING_NAME if getattr(param, "shared_embedding", False) else name
    return out


def _tp_group_of(model: torch.nn.Module) -> dict[str, torch.distributed.ProcessGroup | None]:
    """Parameter name -> the tp_group of the module owning it (None when it has none)."""
    groups = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            groups[f"{mod_name}.{p_name}" if mod_name else p_name] = getattr(module, "tp_group", None)
    return groups


def _draw(name: str, shape: list[int], seed: int) -> torch.Tensor:
    """Deterministic values for global ``name`` at global ``shape``: norms ~1, the rest small."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    noise = torch.randn(shape, generator=gen, dtype=torch.float64)  # [*shape]
    is_norm_weight = len(shape) == 1 and "norm" in name and name.endswith("weight")
    return 1.0 + 0.1 * noise if is_norm_weight else 0.05 * noise


def _local_slice(full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's tensor-parallel slice of ``full``, honouring ``partition_stride`` (GLU fc1)."""
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    parts = full.chunk(stride, dim=dim)  # stride x [..., full_dim / stride, ...]
    return torch.cat([part.chunk(size, dim=dim)[rank] for part in parts], dim=dim)


def _global_shape(param: torch.Tensor, size: int) -> list[int]:
    """Unsharded shape of a (possibly tensor-parallel) parameter."""
    shape = list(param.shape)
    if size > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= size
    return shape


@torch.no_grad()
def init_weights_by_name(model: torch.nn.Module | Iterable[torch.nn.Module], seed: int) -> None:
    """Overwrite every parameter from a hash of (seed, global name), sliced for this rank's TP shard.

    ``model``: one model chunk or the list of virtual-pipeline chunks (optionally DDP-wrapped).
    """
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for chunk in chunks:
        names, groups = global_param_names(chunk), _tp_group_of(chunk)
        for local, param in chunk.named_parameters():
            group = groups.get(local)
            rank, size = (group.rank(), group.size()) if group is not None else (0, 1)
            full = _draw(names[local], _global_shape(param, size), seed)
            param.copy_(_local_slice(full, param, rank, size).to(param.dtype))
