"""--verify: logits of the HF model and of our Megatron model agree, and every tensor is accounted for.

Meant for small models and tests: the HF reference model is materialised in full (on every rank for the
checks that read a checkpoint, since dist_checkpointing loads are collective).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.convert import checks, layout, runtime
from megatron_rl.convert.arch.base import ConvertError, all_rules, to_hf
from megatron_rl.convert.hf_io import read_config

DEFAULT_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


VERIFY_SHAPE = (4, 128)
"""Sequences x tokens compared: long enough for sliding windows and RoPE scaling to show."""
_MATTER = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "vocab_size", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
           "sliding_window", "use_sliding_window", "num_experts", "num_local_experts", "num_experts_per_tok",
           "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "attention_bias",
           "qkv_bias", "dtype", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
           "n_routed_experts", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
           "first_k_dense_replace")
"""config.json keys compared verbatim between the source and a written config (where both set them; the
ones with several spellings, rope_scaling, layer_types, mlp_only_layers..., through the ModelConfig)."""


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(vocab, VERIFY_SHAPE, generator=torch.Generator().manual_seed(0))  # [b, s]


def _model_cfg(hf: dict):
    from megatron_rl.convert.arch import for_hf_config

    return for_hf_config(hf).model_config(hf)[0]


def check_written_config(written: Path, source: dict) -> dict:
    """The written config.json describes the source model: the same ModelConfig (every setting the
    model uses) and the same values of the keys that matter, where both configs have them."""
    import json

    out = json.loads(Path(written).read_text())
    a, b = _model_cfg(out), _model_cfg(source)
    if a != b:
        diff = {k: (getattr(b, k), getattr(a, k)) for k in vars(a) if getattr(a, k) != getattr(b, k)}
        raise ConvertError(f"verify: written {written} describes another model than the source: "
                           f"(source, written) = {diff}")
    src = {**source, "dtype": source.get("dtype") or source.get("torch_dtype")}
    both = [k for k in _MATTER if src.get(k) is not None and out.get(k) is not None]
    bad = {k: (src[k], out[k]) for k in both if src[k] != out[k]}
    if bad:
        raise ConvertError(f"verify: written {written} differs from the source config: (source, written) = {bad}")
    return {"same_model_config": True, "keys_compared": sorted(both)}


def check_arch_round_trip(arch, cfg, extra: dict) -> dict:
    """An export by architecture name (`mcore-to-hf --hf-config ARCH`) would describe this same model."""
    again = arch.model_config(arch.hf_config(cfg, extra))[0]
    if again != cfg:
        diff = {k: (getattr(cfg, k), getattr(again, k)) for k in vars(cfg) if getattr(cfg, k) != getattr(again, k)}
        raise ConvertError(f"verify: {arch.name}'s config.json writer loses settings: (model, rewritten) = {diff}")
    return {"arch_round_trip": True}


def hf_logits(model, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.float().eval()(toks).logits.float()  # [b, s, V]


def reference_config(hf: dict):
    """The transformers config of an HF config.json; a model_type that names another one's architecture
    (Kimi-K2's kimi_k2 = deepseek_v3) is read as that architecture."""
    from transformers import AutoConfig

    from megatron_rl.convert.arch import for_hf_config

    arch = for_hf_config(hf)
    rest = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "auto_map")}
    model_type = arch.model_type if hf.get("model_type") in getattr(arch, "aliases", ()) else hf.get("model_type")
    return AutoConfig.for_model(model_type or arch.model_type, **rest)


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    config = reference_config(read_config(Path(path)))
    return AutoModelForCausalLM.from_pretrained(path, config=config, torch_dtype=torch.float32,
                                                attn_implementation="eager", output_loading_info=True)


def compare(mc: torch.Tensor | None, ref_fn, tol: float | None, dtype) -> dict:
    """Max |logits difference| on the rank holding the logits; raises above the tolerance."""
    if mc is None:
        return {"logits": "held by another rank"}
    diff = (mc - ref_fn()).abs().max().item()
    tol = DEFAULT_TOL.get(dtype, 5e-2) if tol is None else tol
    if not diff <= tol:
        raise ConvertError(f"verify: HF and Megatron logits differ by {diff:.3g} (tolerance {tol:g})")
    return {"max_abs_logit_diff": diff, "tol": tol}


def fresh_logits(ckpt: Path, cfg, extra: dict, ctx):
    """Logits of a model built anew at this layout and loaded from `ckpt` (checks every key and shape)."""

    model = layout.build_model(cfg, extra, ctx)
    checks.ckpt_against_shards(ckpt, model)
    layout.load_model(model, ckpt)
    return runtime.megatron_logits(model, tokens(cfg.vocab_size), ctx), model.config.params_dtype


def verify_mcore_against_hf(ckpt: Path, cfg, extra: dict, ctx, hf_dir: str, tol: float | None) -> dict:
    mc, dtype = fresh_logits(ckpt, cfg, extra, ctx)
    load = load_hf_dequantized if "quantization_config" in read_config(Path(hf_dir)) else (lambda p: load_hf(p)[0])
    return compare(mc, lambda: hf_logits(load(Path(hf_dir)), tokens(cfg.vocab_size)), tol, dtype)


def load_hf_dequantized(path: Path):
    """The HF model of an FP8 block-scaled folder with its weights dequantized (transformers' own FP8
    loading needs a GPU): the architecture from config.json without quantization_config."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.convert.hf_io import HFReader

    reader = HFReader(path)
    hf = {k: v for k, v in reader.config.items() if k != "quantization_config"}
    ref = AutoModelForCausalLM.from_config(reference_config(hf), torch_dtype=torch.float32,
                                           attn_implementation="eager")
    state = {n: reader.get(n) for n in reader.weight_map if not n.endswith("_scale_inv")}
    missing, unexpected = ref.load_state_dict({k: v for k, v in state.items() if k not in beyond_layers(hf, state)},
                                              strict=False)
    missing = [m for m in missing if not (hf.get("tie_word_embeddings") and m == "lm_head.weight")]
    if missing or unexpected:
        raise ConvertError(f"verify: dequantized reference missing {missing[:3]}, unexpected {unexpected[:3]}")
    return ref


def beyond_layers(hf: dict, names) -> set[str]:
    """Names of tensors of layers >= num_hidden_layers (DeepSeek-V3's MTP layers, which transformers ignores)."""
    n = hf["num_hidden_layers"]
    return {x for x in names if x.startswith("model.layers.") and x.split(".")[2].isdigit()
            and int(x.split(".")[2]) >= n}


def verify_hf_folder(out: Path, ckpt: Path, cfg, extra: dict, rules: dict, tol: float | None,
                     copies: frozenset = frozenset()) -> dict:
    """The written folder loads with transformers with no missing/unexpected/mismatched tensors (but the MTP
    layers', which it ignores); it holds exactly the table's tensors and `copies`."""
    from safetensors import safe_open

    from megatron_rl.convert.hf_io import HFReader

    model, info = load_hf(out)
    unexpected = info.get("unexpected_keys") or []
    info["unexpected_keys"] = sorted(set(unexpected) - beyond_layers(read_config(out), unexpected))
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
    if problems:
        raise ConvertError(f"verify: transformers loads {out} with problems: {problems}")
    reader = HFReader(out)
    expected = {n for r in rules.values() for n in r.hf} | set(copies)
    written = set(reader.weight_map)
    if written != expected:
        raise ConvertError(f"verify: written tensors differ from the table: missing "
                           f"{sorted(expected - written)[:3]}, extra {sorted(written - expected)[:3]}")
    dtypes = set()
    for shard in set(reader.weight_map.values()):
        with safe_open(out / shard, "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    mc, dtype = fresh_logits(ckpt, cfg, extra, runtime.start())
    return {"tensors": len(expected), "dtypes": sorted(dtypes),
            **compare(mc, lambda: hf_logits(model, tokens(cfg.vocab_size)), tol, dtype)}


def hf_reference(ckpt: Path, model, arch, hf: dict, group):
    """An HF model (transformers, from config) holding the tensors of checkpoint `ckpt`; collective over
    `group` (the ranks holding `model`'s parts: `DistContext.world`)."""
    from transformers import AutoModelForCausalLM

    parts: list = [None] * dist.get_world_size(group)
    pattern = model.config.moe_layer_freq if isinstance(model.config.moe_layer_freq, list) else None
    dist.all_gather_object(parts, layout.ckpt_entries(model, pattern), group=group)
    entries = layout.merge_entries(parts)
    md_dtypes = {e.key: model.config.params_dtype for e in entries}
    counts = (hf["num_hidden_layers"], hf.get(arch.moe.num_experts_key, 0) if arch.moe else 0)
    rules, state = all_rules(arch, hf), {}
    for layer in [None, *range(counts[0])]:
        for name, t in layout.load_canonical(str(ckpt), entries, layer, counts, md_dtypes).items():
            if name in rules:
                state.update(zip(rules[name].hf, to_hf(rules[name], t, hf)))
    ref = AutoModelForCausalLM.from_config(reference_config(hf), torch_dtype=torch.float32,
                                           attn_implementation="eager")
    missing, unexpected = ref.load_state_dict({k: v for k, v in state.items() if k not in beyond_layers(hf, state)},
                                              strict=False)
    missing = [m for m in missing if not (hf.get("tie_word_embeddings") and m == "lm_head.weight")]
    if missing or unexpected:
        raise ConvertError(f"verify: reference model missing {missing[:3]}, unexpected {unexpected[:3]}")
    return ref


def verify_mcore_against_ckpt(out: Path, cfg, extra: dict, ctx, src: Path, arch, hf: dict,
                              tol: float | None) -> dict:
    """Logits of the resharded checkpoint at its layout vs an HF model holding the source checkpoint."""
    mc, dtype = fresh_logits(out, cfg, extra, ctx)
    ref = hf_reference(src, layout.build_model(cfg, extra, ctx), arch, hf, ctx.world)
    return compare(mc, lambda: hf_logits(ref, tokens(cfg.vocab_size)), tol, dtype)
