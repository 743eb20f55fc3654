"""Registry of architecture tables (one module per architecture)."""
from __future__ import annotations

from tools.convert.arch import deepseek_v3, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from tools.convert.arch.base import Arch, ConvertError

ARCHS: dict[str, Arch] = {m.ARCH.name: m.ARCH for m in (llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral,
                                                  deepseek_v3)}


def supported() -> str:
    return ", ".join(f"{a.name} ({'/'.join(a.hf_architectures)})" for a in ARCHS.values())


def by_name(name: str) -> Arch:
    if name not in ARCHS:
        raise ConvertError(f"unknown architecture {name!r}; supported: {supported()}")
    return ARCHS[name]


def for_hf_config(hf: dict) -> Arch:
    """The table for an HF config.json (by `architectures`, else `model_type`)."""
    names = hf.get("architectures") or []
    for arch in ARCHS.values():
        if any(n in arch.hf_architectures for n in names) or (not names and hf.get("model_type") == arch.model_type):
            return arch
    got = names or hf.get("model_type")
    raise ConvertError(f"unknown architecture {got!r} in config.json; supported: {supported()}")
