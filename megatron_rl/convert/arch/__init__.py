"""Registry of architecture tables (one module per architecture)."""
from __future__ import annotations

from megatron_rl.convert.arch import deepseek_v3, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from megatron_rl.convert.arch.base import ARCH_FIELDS, Arch, ConvertError

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


def describe(cfg, extra: dict | None = None) -> tuple[Arch, dict]:
    """(architecture, config.json) of the first table whose config.json describes `cfg` (a ModelConfig of random
    weights) exactly: written, then read back to the same shape. Raises naming why each kind does not fit."""
    why, want = {}, _effective(cfg)
    for arch in ARCHS.values():
        try:
            hf = arch.hf_config(cfg, extra or {})
            again = _effective(arch.model_config(hf)[0])
        except (ConvertError, ValueError, KeyError) as e:
            why[arch.name] = str(e).split(": ", 1)[-1][:80]
            continue
        diff = [k for k in ARCH_FIELDS if getattr(again, k) != getattr(want, k)]
        if not diff:
            return arch, hf
        why[arch.name] = f"differs in {', '.join(diff)}"
    raise ConvertError("no HF architecture describes this model exactly (" +
                       "; ".join(f"{k}: {v}" for k, v in why.items()) + ")")


def _effective(cfg):
    """`cfg` with its defaults spelled out (query groups, head size, MLP sizes) and the dense MLP size dropped
    when every layer is MoE (unused): equal for equal models."""
    from dataclasses import replace

    h, heads, moe = cfg.hidden_size, cfg.num_attention_heads, cfg.moe
    ffn = cfg.ffn_hidden_size or 4 * h
    if moe.num_experts:
        moe = replace(moe, ffn_hidden_size=moe.ffn_hidden_size or ffn)
        if moe.layer_pattern is None or all(moe.layer_pattern):
            moe, ffn = replace(moe, layer_pattern=None), 0
    if cfg.mla.enabled:
        return replace(cfg, ffn_hidden_size=ffn, moe=moe)
    return replace(cfg, num_query_groups=cfg.num_query_groups or heads, head_dim=cfg.head_dim or h // heads,
                   ffn_hidden_size=ffn, moe=moe)
