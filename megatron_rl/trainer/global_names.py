"""Global (one-process) names of a pipeline/expert-parallel chunk's tensors, for the engine's weight sync.

A chunk of the trainer names its layers and experts locally: stage 1 of PP=2 calls its first layer
`decoder.layers.0`, EP rank 1 calls its first expert `local_experts.0`. The engine holds the whole model
(TP only), so the sync renames each tensor to the name it has in the unsharded model: layers by
`TransformerLayer.layer_number` (which counts pipeline and virtual-pipeline offsets), experts by the
expert-parallel rank times the local expert count. The last stage's copy of tied embeddings
(`output_layer.weight` with `shared_embedding`) is named after the embedding it duplicates.
"""
from __future__ import annotations

import re

import torch

EMBEDDING = "embedding.word_embeddings.weight"
"""Global name of the word embeddings (and of the last stage's tied copy of them)."""


def _renames(model: torch.nn.Module) -> dict[str, str]:
    """Local module-name prefixes -> global ones: transformer layers, and SequentialMLP local experts."""
    out, layers = {}, {}
    for name, module in model.named_modules():
        layer = re.fullmatch(r"(.*layers\.)(\d+)", name)
        if layer and hasattr(module, "layer_number"):
            out[name] = layers[name] = f"{layer.group(1)}{module.layer_number - 1}"
        if hasattr(module, "local_experts") and hasattr(module, "ep_group"):
            offset = module.ep_group.rank() * module.num_local_experts
            owner = next((k for k in sorted(layers, key=len, reverse=True) if name.startswith(k + ".")), None)
            glob = layers[owner] + name[len(owner):] if owner else name
            for j in range(module.num_local_experts):
                out[f"{name}.local_experts.{j}"] = f"{glob}.local_experts.{offset + j}"
    return out


def global_names(model: torch.nn.Module, local_names) -> dict[str, str]:
    """Local name -> global name for `local_names` (parameters or buffers of `model`, one unwrapped chunk)."""
    renames, params = _renames(model), dict(model.named_parameters())
    out = {}
    for local in local_names:
        parts, name = local.split("."), local
        for cut in range(len(parts) - 1, 0, -1):  # the longest renamed prefix wins
            head = ".".join(parts[:cut])
            if head in renames:
                name = ".".join([renames[head], *parts[cut:]])
                break
        shared = getattr(params.get(local), "shared_embedding", False) and local != EMBEDDING
        out[local] = EMBEDDING if shared else name
    return out
