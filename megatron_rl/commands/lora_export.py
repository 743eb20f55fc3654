"""Export of a LoRA run (lora.enabled): its checkpoints hold the adapters only, the base is model.init (an HF
folder). Two forms, both written atomically:

- merged (`megatron-rl export`, the end of a run): the base's HF tensors with  scale * B @ A  added to each
  adapted projection (mapped to HF names through the converter's rules: fused qkv -> q/k/v, GLU fc1 ->
  gate/up), every other file of the regular export;
- adapter folder (`megatron-rl export --adapter`): adapter_config.json + adapter_model.safetensors that
  Hugging Face PEFT loads onto the base (`PeftModel.from_pretrained(base, folder)`): per HF projection its
  lora_A (shared by q/k/v and by gate/up: one A feeds the fused output) and its rows of lora_B.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rl.config import ConfigError
from megatron_rl.trainer.lora import LoRAConfig, is_adapter


def read_adapters(ckpt: Path) -> dict[str, torch.Tensor]:
    """{global Megatron name (decoder.layers.N.<module>.lora_A|B): unsharded tensor} of a LoRA checkpoint."""
    from megatron.core import dist_checkpointing

    from megatron_rl.convert.layout import _read_regions

    md = dist_checkpointing.load_tensors_metadata(str(ckpt))
    keys = [k for k in md if is_adapter(k) and not k.startswith("optimizer.")]
    if not keys:
        raise ConfigError(f"checkpoint {ckpt} holds no LoRA adapters (saved without lora.enabled?)")
    shapes = {k: tuple(md[k].global_shape) for k in keys}
    regions = {k: (torch.empty(shapes[k], dtype=md[k].dtype), (0,) * len(shapes[k])) for k in keys}
    _read_regions(str(ckpt), regions)
    out = {}
    for key, (buf, _) in regions.items():  # [L, ...]: the layer axis leads every decoder tensor
        head, tail = key.split("decoder.layers.", 1)
        for layer in range(buf.shape[0]):
            out[f"{head}decoder.layers.{layer}.{tail}"] = buf[layer]
    return out


def _adapted(adapters: dict[str, torch.Tensor]) -> list[str]:
    """Megatron module names (decoder.layers.N.<target>) holding adapters."""
    return sorted({k.rsplit(".", 1)[0] for k in adapters})


def hf_deltas(adapters: dict, lora: LoRAConfig, arch, hf: dict) -> dict[str, torch.Tensor]:
    """{HF tensor name: scale * B @ A in HF layout} for every adapted projection."""
    from megatron_rl.convert.arch.base import to_hf
    from megatron_rl.convert.convert import all_rules

    rules, out = all_rules(arch, hf), {}
    for mod in _adapted(adapters):
        delta = lora.scale * (adapters[mod + ".lora_B"].double() @ adapters[mod + ".lora_A"].double())
        rule = rules[mod + ".weight"]
        out.update(zip(rule.hf, to_hf(rule, delta, hf)))
    return out


def write_merged(tmp: Path, init_folder: Path, adapters: dict, lora: LoRAConfig, arch, hf: dict) -> int:
    """The base's tensors (model.init) with the adapters merged, in the config's dtype; returns the count."""
    from megatron_rl.convert.hf_io import HFReader, HFWriter

    deltas = hf_deltas(adapters, lora, arch, hf)
    dtype = getattr(torch, str(hf.get("dtype") or hf.get("torch_dtype") or "float32"))
    reader, writer = HFReader(init_folder), HFWriter(tmp)
    missing = sorted(set(deltas) - set(reader.weight_map))
    if missing:
        raise ConfigError(f"model.init {init_folder} lacks {missing[:3]}: not the base this LoRA run trained on")
    for name in sorted(reader.weight_map):
        t = reader.get(name)
        if name in deltas:
            t = t.double() + deltas[name]
        writer.add(name, t.to(dtype) if t.is_floating_point() else t)
    reader.close()
    return len(writer.finish())


def write_adapter(tmp: Path, adapters: dict, lora: LoRAConfig, arch, hf: dict, base: str) -> dict:
    """adapter_config.json + adapter_model.safetensors (PEFT's LoRA format) of the adapters."""
    from safetensors.torch import save_file

    from megatron_rl.convert.arch.base import to_hf
    from megatron_rl.convert.convert import all_rules

    rules, tensors = all_rules(arch, hf), {}
    for mod in _adapted(adapters):
        rule = rules[mod + ".weight"]
        a = adapters[mod + ".lora_A"].float()
        for hf_name, b in zip(rule.hf, to_hf(rule, adapters[mod + ".lora_B"].float(), hf)):
            stem = "base_model.model." + hf_name.removesuffix(".weight")
            tensors[stem + ".lora_A.weight"] = a.clone().contiguous()
            tensors[stem + ".lora_B.weight"] = b.contiguous()
    modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none", "use_rslora": False,
              "fan_in_fan_out": False, "base_model_name_or_path": base, "inference_mode": True}
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"adapter_tensors": len(tensors), "target_modules": modules}


def export_lora_run(cfg, ckpt: Path, dest: Path, hf: dict, arch) -> dict:
    """Write the PEFT adapter folder of a LoRA run's checkpoint (the merged folder: commands/export.py)."""
    from megatron_rl.convert import runtime
    from megatron_rl.model_init import parse

    kind, folder = parse(cfg.model.init) if cfg.model.init else ("", None)
    if kind != "hf":
        raise ConfigError(f"export of a LoRA run needs model.init=hf:<folder> (the base its adapters were trained "
                          f"on), got {cfg.model.init!r}")
    adapters = read_adapters(ckpt)
    ctx = runtime.start()
    with runtime.atomic_dir(dest, ctx.world) as tmp:
        report = write_adapter(tmp, adapters, cfg.lora, arch, hf, str(folder.resolve()))
    report["lora_modules"] = len(_adapted(adapters))
    return report

