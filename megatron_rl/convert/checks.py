"""Up-front checks with errors that name the tensor (or file) and say what was expected."""
from __future__ import annotations

from pathlib import Path

from megatron_rl.convert.arch.base import ConvertError, head_dim

_IGNORED_CKPT_PREFIXES = ("optimizer.", "rng_state", "rerun_state", "reference.", "critic.")
"""Checkpoint tensors that are not the model's: optimizer and RNG state, an RL run's frozen KL reference and
its PPO critic (value model and its optimizer)."""


def shape(name: str, expected: tuple, got: tuple, where: str = "") -> None:
    if tuple(expected) != tuple(got):
        raise ConvertError(f"shape mismatch for tensor {name!r}{' (' + where + ')' if where else ''}: "
                           f"expected {list(expected)}, got {list(got)}")


def hf_names(reader, arch, rules: dict) -> None:
    """Every HF tensor the table needs exists; every HF tensor present is used (or carries nothing)."""
    needed = {n for r in rules.values() for n in r.hf}
    missing = sorted(needed - set(reader.weight_map))
    if missing:
        raise ConvertError(f"{reader.path}: tensor {missing[0]!r} is missing ({len(missing)} missing in all); "
                           f"checkpoint of another model or a config.json that does not match it?")
    extra = sorted(n for n in set(reader.weight_map) - needed if not arch.ignorable(reader.config, n))
    if extra:
        raise ConvertError(f"{reader.path}: unexpected tensor {extra[0]!r} ({len(extra)} unexpected in all) "
                           f"is not mapped by the {arch.name} table; unsupported variant or another model?")


def expected_hf_shape(name: str, hf: dict, cfg) -> tuple[int, ...]:
    """Shape an HF tensor must have under config.json (by its name's suffix)."""
    h, d = hf["hidden_size"], head_dim(hf)
    heads, groups = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    ffn = cfg.moe.ffn_hidden_size if (cfg.moe.num_experts and ".experts." in name) else cfg.ffn_hidden_size
    if ".shared_expert." in name or ".shared_experts." in name:
        ffn = cfg.moe.shared_expert_ffn_hidden_size
    table = {"embed_tokens.weight": (hf["vocab_size"], h), "lm_head.weight": (hf["vocab_size"], h),
             "q_proj.weight": (heads * d, h), "k_proj.weight": (groups * d, h), "v_proj.weight": (groups * d, h),
             "q_proj.bias": (heads * d,), "k_proj.bias": (groups * d,), "v_proj.bias": (groups * d,),
             "o_proj.weight": (h, heads * d), "q_norm.weight": (d,), "k_norm.weight": (d,),
             "shared_expert_gate.weight": (1, h),
             "gate.weight": (cfg.moe.num_experts, h), "gate_proj.weight": (ffn, h), "up_proj.weight": (ffn, h),
             "down_proj.weight": (h, ffn), "w1.weight": (ffn, h), "w3.weight": (ffn, h), "w2.weight": (h, ffn)}
    for suffix, shp in table.items():
        if name.endswith("." + suffix) or name == suffix:
            return shp
    return (h,)  # the norms: input_layernorm, post_attention_layernorm, model.norm


def hf_shapes(reader, arch, rules: dict, cfg, extra: dict) -> None:
    for name in sorted({n for r in rules.values() for n in r.hf}):
        want = arch.expected_shape(name, reader.config) or expected_hf_shape(name, reader.config, cfg)
        shape(name, want, reader.shape(name),
              f"in {reader.path / reader.weight_map[name]}")


def ckpt_against_model(ckpt: Path, md: dict, entries: list, cfg) -> None:
    """A checkpoint holds every tensor of the model, with the model's shapes, and nothing else."""
    known = set()
    for ent in entries:
        lead = ((cfg.num_layers,) if ent.layer_axis else ()) + ((cfg.moe.num_experts,) if "{e}" in ent.template
                                                                 else ())
        for key in ent.keys(cfg.num_layers):
            if key not in md:
                raise ConvertError(f"checkpoint {ckpt} lacks tensor {key!r}: written for another model?")
            shape(key, lead + ent.shape, tuple(md[key].global_shape),
                  f"in checkpoint {ckpt} vs the model of the HF config")
            known.add(key)
    extra = sorted(k for k in md if k not in known and not k.startswith(_IGNORED_CKPT_PREFIXES))
    if extra:
        raise ConvertError(f"checkpoint {ckpt} has tensor {extra[0]!r} that this model does not "
                           f"({len(extra)} in all): written for another model?")


def ckpt_against_shards(ckpt: Path, model) -> None:
    """Every ShardedTensor of `model` exists in the checkpoint with the same global shape."""
    from megatron.core import dist_checkpointing

    from megatron_rl.convert.layout import _shards

    md = dist_checkpointing.load_tensors_metadata(str(ckpt))
    for item in model.sharded_state_dict().values():
        for sh in _shards(item):
            if sh.key not in md:
                raise ConvertError(f"checkpoint {ckpt} lacks tensor {sh.key!r}: written for another model?")
            shape(sh.key, tuple(sh.global_shape), tuple(md[sh.key].global_shape), f"in checkpoint {ckpt}")
