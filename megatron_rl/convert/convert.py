"""The three conversions: hf-to-mcore, mcore-to-hf, reshard (each checked up front, written atomically)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rl.convert import checks, layout, runtime
from megatron_rl.convert.arch import by_name, for_hf_config
from megatron_rl.convert.arch.base import ConvertError, Rule, all_rules, to_hf, to_mcore  # noqa: F401 (all_rules: used by callers of this module)
from megatron_rl.convert.hf_io import HFReader, HFWriter, copy_side_files, read_config

META = "megatron_rl_convert.json"
"""Side file of a converted Megatron checkpoint: architecture and HF config.json (for mcore-to-hf/reshard)."""
SIDE_DIR = "hf_files"
"""Tokenizer and other HF side files carried inside a Megatron checkpoint."""


def fill_rule(arch, hf: dict, rules: dict[str, Rule], name: str) -> Rule:
    """The rule filling a model tensor (a tied output layer is filled from the embedding)."""
    if name in rules:
        return rules[name]
    if name == "output_layer.weight" and hf.get("tie_word_embeddings"):
        return rules["embedding.word_embeddings.weight"]
    raise ConvertError(f"Megatron tensor {name!r} has no mapping in the {arch.name} table")


@torch.no_grad()
def fill_model(model, reader: HFReader, arch, rules: dict[str, Rule], show: bool) -> list[str]:
    """Copy HF tensors into this rank's shards, one canonical tensor at a time; returns the lossy dtype
    casts (Megatron keeps some tensors, the local spec's norms, in fp32: a bf16 value fits there exactly)."""
    hf, casts = reader.config, []
    shards = layout.model_shards(model)
    for name in runtime.progress(sorted(shards, key=_order), "hf -> mcore", show):
        rule = fill_rule(arch, hf, rules, name)
        parts = [reader.get(n) for n in rule.hf]
        full = to_mcore(rule, parts, hf)
        for sh in shards[name]:
            checks.shape(name, sh.global_shape, tuple(full.shape), f"made from {', '.join(rule.hf)}")
            if full.dtype != sh.data.dtype and not torch.equal(full.to(sh.data.dtype).to(full.dtype), full):
                casts.append(f"{name}: {full.dtype} -> {sh.data.dtype}")
            sh.data.copy_(full[sh.region])
        del parts, full
        runtime.release_freed_memory()  # the temporaries, so the peak is the model + one tensor's
    return casts


def releasing_state_dict(model) -> dict:
    """`model.sharded_state_dict()` for a save after which the model is not used: Megatron's writer clones every
    tensor that is a view (the two GLU halves of each fused fc1 weight, ShardedTensorFactory chunks) and holds all
    the clones until the end (~0.35x SmolLM2's size on top of the model); here each such tensor is cloned first,
    one parameter at a time, and that parameter's memory released, so the save needs one tensor more."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    owners = {t.untyped_storage().data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    views: dict[int, list] = {}
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor) and sh.data.untyped_storage().nbytes() != sh.data.numel() * \
                sh.data.element_size():
            views.setdefault(sh.data.untyped_storage().data_ptr(), []).append(sh)
    for ptr, shards in views.items():
        for sh in shards:
            sh.data = sh.data.clone()
        if ptr in owners:
            owners[ptr].data = owners[ptr].data.new_empty(0)  # the model is not used after the save
    return sd


def _order(name: str):
    layer = layout.layer_of(name)
    return (-1 if name.startswith("embedding") else 1e9 if layer is None else layer, name)


def write_meta(tmp: Path, arch, hf_cfg: dict, side_src: Path | None) -> None:
    (tmp / META).write_text(json.dumps({"arch": arch.name, "hf_config": hf_cfg}, indent=2) + "\n")
    if side_src is not None:
        copy_side_files(side_src, tmp / SIDE_DIR)


def save_sharded(state: dict, path: Path) -> None:
    """`dist_checkpointing.save` of a sharded state dict into folder `path`, without a spawned manager process
    (`megatron_rl.compat.sync_save`)."""
    from megatron.core import dist_checkpointing

    from megatron_rl.compat import sync_save

    sync_save.install()
    dist_checkpointing.save(state, str(path))


def hf_to_mcore(hf_dir: str, out: str, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str | None = None,
                verify: bool = False, tol: float | None = None, stages: dict | None = None) -> dict:
    """HF folder -> dist_checkpointing checkpoint written at tp x pp x ep (`stages`: an uneven split of the layers
    over the pp ranks, runtime.start); the checkpoint's keys are global, so any layout loads it."""
    reader = HFReader(hf_dir)
    arch = for_hf_config(reader.config)
    cfg, extra = arch.model_config(reader.config, dtype)
    rules = all_rules(arch, reader.config)
    checks.hf_names(reader, arch, rules)
    checks.hf_shapes(reader, arch, rules, cfg, extra)
    runtime.layout_config(tp, pp, ep, stages, cfg)  # refused before any rank starts
    ctx = runtime.start(tp, pp, ep, stages)
    # no random initialisation: every tensor is filled from the checkpoint below (fill_model refuses a missing
    # one), and Megatron's CPU initialisation builds each weight's full master copy first (~1.6x the model)
    model = layout.build_model(cfg, {**extra, "perform_initialization": False}, ctx)
    report = {"arch": arch.name, "layout": _layout(tp, pp, ep, stages), "world_size": ctx.world_size}
    report["dtype_casts"] = fill_model(model, reader, arch, rules, runtime.is_rank0(ctx.world))
    reader.close()
    with runtime.atomic_dir(out, ctx.world) as tmp:
        save_sharded(releasing_state_dict(model), tmp)
        del model
        if runtime.is_rank0(ctx.world):
            write_meta(tmp, arch, reader.config, Path(hf_dir))
        runtime.barrier(ctx.world)
        if verify:
            from megatron_rl.convert import verify as V

            report["verify"] = V.verify_mcore_against_hf(tmp, cfg, extra, ctx, hf_dir, tol)
            report["verify"]["config"] = V.check_arch_round_trip(arch, cfg, extra)
    return report


def resolve_hf_config(ckpt: Path, hf_config: str | None) -> tuple[dict, Path | None]:
    """(config.json dict, folder with tokenizer files) from --hf-config DIR / ARCH or the checkpoint's META."""
    meta = json.loads((ckpt / META).read_text()) if (ckpt / META).is_file() else None
    side = ckpt / SIDE_DIR if (ckpt / SIDE_DIR).is_dir() else None
    if hf_config and Path(hf_config).is_dir():
        return read_config(Path(hf_config)), Path(hf_config)
    if hf_config:
        arch = by_name(hf_config)
        if meta is None:
            raise ConvertError(f"--hf-config {hf_config}: an architecture name needs the model shape from "
                               f"{ckpt / META}, which is missing; pass an HF folder with config.json instead")
        src = for_hf_config(meta["hf_config"])
        return arch.hf_config(*src.model_config(meta["hf_config"])), side
    if meta is None:
        raise ConvertError(f"{ckpt} has no {META}; pass --hf-config with an HF folder (config.json) or arch name")
    return meta["hf_config"], side


def ckpt_dtype(ckpt: Path) -> str:
    """The parameter dtype of a checkpoint (its most common tensor dtype), as HF names it."""
    from collections import Counter

    from megatron.core import dist_checkpointing

    md = dist_checkpointing.load_tensors_metadata(str(ckpt))
    counts = Counter(str(v.dtype).removeprefix("torch.") for k, v in md.items() if not k.startswith("optimizer."))
    return counts.most_common(1)[0][0]


def _has_mtp(ckpt: Path) -> bool:
    from megatron.core import dist_checkpointing

    return any(k.startswith("mtp.") for k in dist_checkpointing.load_tensors_metadata(str(ckpt)))


def source_config(ckpt: Path, fallback: dict) -> dict:
    """The HF config.json the checkpoint was converted from (its META), else `fallback`."""
    meta = ckpt / META
    return json.loads(meta.read_text())["hf_config"] if meta.is_file() else fallback


def ckpt_layout(ckpt: Path, arch, cfg, extra: dict, ctx) -> tuple[list, dict]:
    """Checkpoint entries of this model (from a one-layer stand-in built under `ctx`: `runtime.start()`),
    checked against the checkpoint."""
    from megatron.core import dist_checkpointing

    entries = layout.ckpt_entries(layout.build_model(cfg, extra, ctx, num_layers=1), cfg.moe.layer_pattern)
    md = dist_checkpointing.load_tensors_metadata(str(ckpt))
    checks.ckpt_against_model(ckpt, md, entries, cfg)
    return entries, {k: v.dtype for k, v in md.items()}


def emit_hf(tensors: dict, arch, hf: dict, writer: HFWriter) -> None:
    """Write canonical tensors as HF tensors, in the config's dtype (`dtype`) when it names one."""
    rules = {**arch.global_rules(hf), **_layer_rules_for(arch, hf, tensors)}
    dtype = getattr(torch, str(hf.get("dtype") or hf.get("torch_dtype") or ""), None)
    copies = arch.shared_copies(hf)
    for name, t in tensors.items():
        if name == "output_layer.weight" and hf.get("tie_word_embeddings"):
            continue
        if name not in rules:
            raise ConvertError(f"checkpoint tensor {name!r} has no mapping in the {arch.name} table")
        keep = name.endswith(_FP32_TENSORS)  # fp32 in Megatron and in the source checkpoints: never rounded
        for hf_name, part in zip(rules[name].hf, to_hf(rules[name], t, hf)):
            writer.add(hf_name, part.to(dtype) if isinstance(dtype, torch.dtype) and not keep else part)
        for hf_name in copies.get(name, ()):  # e.g. DeepSeek-V3's MTP embed_tokens / shared_head.head
            writer.add(hf_name, (t.to(dtype) if isinstance(dtype, torch.dtype) else t).clone())


_FP32_TENSORS = (".router.expert_bias",)
"""Written in fp32 whatever the config's dtype (DeepSeek-V3's e_score_correction_bias is fp32 in its files)."""


def _layer_rules_for(arch, hf, tensors):
    layers = {layout.layer_of(n) for n in tensors} - {None}
    return {k: v for layer in layers for k, v in arch.layer_rules(hf, layer).items()}


def export_hf(ckpt: Path, entries, dtypes, arch, hf: dict, writer: HFWriter, show: bool) -> None:
    """Stream a checkpoint into `writer`: embedding, layers one at a time, final norm and output layer."""
    counts = (hf["num_hidden_layers"], hf.get(arch.moe.num_experts_key, 0) if arch.moe else 0)
    glob = layout.load_canonical(str(ckpt), entries, None, counts, dtypes)
    emit_hf({k: v for k, v in glob.items() if k.startswith("embedding.")}, arch, hf, writer)
    for layer in runtime.progress(range(counts[0]), "mcore -> hf", show):
        emit_hf(layout.load_canonical(str(ckpt), entries, layer, counts, dtypes), arch, hf, writer)
    emit_hf({k: v for k, v in glob.items() if not k.startswith("embedding.")}, arch, hf, writer)


def mcore_to_hf(ckpt: str, out: str, hf_config: str | None = None, verify: bool = False,
                max_shard_bytes: int = 5 * 2**30, tol: float | None = None) -> dict:
    ckpt_p = Path(ckpt)
    if not (ckpt_p / "metadata.json").is_file():
        raise ConvertError(f"{ckpt} is not a dist_checkpointing checkpoint (no metadata.json)")
    hf, side = resolve_hf_config(ckpt_p, hf_config)
    hf = {k: v for k, v in hf.items() if k != "quantization_config"}  # written dequantized
    if hf.get("num_nextn_predict_layers") and not _has_mtp(ckpt_p):  # converted before MTP was: none written
        hf["num_nextn_predict_layers"] = 0
    hf = {**hf, **dict.fromkeys(("dtype", "torch_dtype"), ckpt_dtype(ckpt_p))}
    arch = for_hf_config(hf)
    cfg, extra = arch.model_config(hf)
    ctx = runtime.start()
    entries, dtypes = ckpt_layout(ckpt_p, arch, cfg, extra, ctx)
    report = {"arch": arch.name, "dtype": hf["dtype"]}
    with runtime.atomic_dir(out, ctx.world) as tmp:
        writer = HFWriter(tmp, max_shard_bytes)
        export_hf(ckpt_p, entries, dtypes, arch, hf, writer, True)
        report["tensors"] = len(writer.finish())
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        report["side_files"] = copy_side_files(side, tmp) if side else []
        if verify:
            from megatron_rl.convert import verify as V

            copies = frozenset(c for names in arch.shared_copies(hf).values() for c in names)
            report["verify"] = V.verify_hf_folder(tmp, ckpt_p, cfg, extra, all_rules(arch, hf), tol, copies)
            report["verify"]["config"] = V.check_written_config(
                tmp / "config.json", {**source_config(ckpt_p, hf), "dtype": hf["dtype"], "torch_dtype": hf["dtype"]})
    return report


def _layout(tp: int, pp: int, ep: int, stages: dict | None) -> dict:
    return {"tp": tp, "pp": pp, "ep": ep, **{k: v for k, v in (stages or {}).items() if v is not None}}


def reshard(ckpt: str, out: str, tp: int = 1, pp: int = 1, ep: int = 1, hf_config: str | None = None,
            verify: bool = False, tol: float | None = None, stages: dict | None = None) -> dict:
    ckpt_p = Path(ckpt)
    hf, side = resolve_hf_config(ckpt_p, hf_config)
    arch = for_hf_config(hf)
    cfg, extra = arch.model_config(hf)
    runtime.layout_config(tp, pp, ep, stages, cfg)  # refused before any rank starts
    ctx = runtime.start(tp, pp, ep, stages)
    model = layout.build_model(cfg, extra, ctx)
    checks.ckpt_against_shards(ckpt_p, model)
    layout.load_model(model, ckpt_p)
    report = {"arch": arch.name, "layout": _layout(tp, pp, ep, stages), "world_size": ctx.world_size}
    with runtime.atomic_dir(out, ctx.world) as tmp:
        save_sharded(model.sharded_state_dict(), tmp)
        if runtime.is_rank0(ctx.world):
            write_meta(tmp, arch, hf, None)
            copy_side_files(side, tmp / SIDE_DIR) if side else None
        runtime.barrier(ctx.world)
        if verify:
            from megatron_rl.convert import verify as V

            report["verify"] = V.verify_mcore_against_ckpt(tmp, cfg, extra, ctx, ckpt_p, arch, hf, tol)
    return report

