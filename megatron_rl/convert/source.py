"""Where a run's policy comes from: `model.init` names a pretrained checkpoint, or nothing (random weights).

    model:
      init: hf:models/SmolLM2-135M-Instruct      # an HF folder (config.json + safetensors + tokenizer files)
      init: mcore:runs/x/converted                # a `megatron-rl convert hf-to-mcore` checkpoint
      init: ""                                    # random weights of the shape given in the config (tiny tests)

The model's shape (layers, width, heads, query groups, head_dim, ffn size, rope base and scaling, sliding
window, norm eps, tied embeddings, vocab, QKV bias, QK norm, MoE, MLA) comes from the checkpoint's config.json
through the converter's architecture tables (`megatron_rl/convert/arch`), never from hand-copied sizes:
`resolve(model_cfg)` fills them in, and refuses a run config that sets one of them to a different value.
What stays the run's choice: max_seq_length (at most the checkpoint's max_position_embeddings), params_dtype,
transformer_impl, fp8.

`initializer(model_cfg)` returns the callback the trainer runs on every freshly built model chunk (before
DDP and the optimizer exist), which copies this rank's shards of every tensor in place, one tensor at a time
(HF: the converter's rule tables; mcore: dist_checkpointing, which reshards to the run's layout).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.convert.arch.base import ARCH_FIELDS
from megatron_rl.model_init import META, parse


def hf_config(init: str) -> dict:
    """The checkpoint's HF config.json (for mcore: the one stored at conversion)."""
    kind, folder = parse(init)
    if kind == "hf":
        f = folder / "config.json"
        if not f.is_file():
            raise ConfigError(f"model.init={init!r}: {f} not found; an HF model folder needs config.json")
        from megatron_rl.convert.arch.base import ConvertError
        from megatron_rl.convert.hf_io import HFReader

        try:
            return HFReader(folder).config  # as its weights have it (DeepSeek-V3 MTP layers saved or not)
        except ConvertError:
            return json.loads(f.read_text())  # no weights: _check_tensors names the problem
    f = folder / META
    if not (folder / "metadata.json").is_file() or not f.is_file():
        raise ConfigError(f"model.init={init!r}: {folder} is not a `megatron-rl convert hf-to-mcore` checkpoint "
                          f"(needs metadata.json and {META})")
    return json.loads(f.read_text())["hf_config"]


def checkpoint_model_config(init: str, params_dtype: str):
    """(ModelConfig of the checkpoint's architecture, the converter's Arch) from its config.json."""
    from megatron_rl.convert.arch import for_hf_config
    from megatron_rl.convert.arch.base import ConvertError

    hf = hf_config(init)
    try:
        arch = for_hf_config(hf)
        cfg, extra = arch.model_config(hf, params_dtype)
    except ConvertError as e:
        raise ConfigError(f"model.init={init!r}: {e}") from None
    if extra:
        raise ConfigError(f"model.init={init!r}: the converter needs TransformerConfig overrides {sorted(extra)} "
                          f"that a run's model config cannot carry")
    return cfg, arch


def resolve(cfg) -> None:
    """The resolve step of a ModelConfig with `init` set: read the checkpoint, fill `cfg` with its architecture in
    place, then validate the result (`ModelConfig.validate` itself reads nothing)."""
    from megatron_rl.models.gpt import ModelConfig

    src, _ = checkpoint_model_config(cfg.init, cfg.params_dtype)
    defaults = ModelConfig()
    for name in ARCH_FIELDS:
        mine, theirs = getattr(cfg, name), getattr(src, name)
        if mine != theirs and mine != getattr(defaults, name):
            raise ConfigError(f"model.{name}={mine!r} disagrees with the checkpoint of model.init={cfg.init!r} "
                              f"({theirs!r}); the shape comes from the checkpoint: remove model.{name}")
        setattr(cfg, name, dataclasses.replace(theirs) if dataclasses.is_dataclass(theirs) else theirs)
    _check_tensors(cfg.init)
    limit = hf_config(cfg.init).get("max_position_embeddings")
    if limit and cfg.max_seq_length > limit:
        raise ConfigError(f"model.max_seq_length={cfg.max_seq_length} exceeds the checkpoint's "
                          f"max_position_embeddings={limit}")
    cfg.validate()


def _check_tensors(init: str) -> None:
    """An HF folder's safetensors hold exactly the tensors its architecture needs (headers only)."""
    kind, folder = parse(init)
    if kind != "hf":
        return
    from megatron_rl.convert import checks
    from megatron_rl.convert.arch import for_hf_config
    from megatron_rl.convert.arch.base import ConvertError
    from megatron_rl.convert.convert import all_rules
    from megatron_rl.convert.hf_io import HFReader

    try:
        reader = HFReader(folder)
        arch = for_hf_config(reader.config)
        checks.hf_names(reader, arch, all_rules(arch, reader.config))
    except ConvertError as e:
        raise ConfigError(f"model.init={init!r}: {e}") from None


def initializer(cfg) -> Callable | None:
    """Callback that loads the checkpoint's weights into a freshly built model chunk (None: random init)."""
    if not cfg.init:
        return None
    kind, folder = parse(cfg.init)
    return _hf_loader(folder) if kind == "hf" else _mcore_loader(folder)


def _hf_loader(folder: Path) -> Callable:
    from megatron_rl.convert import checks
    from megatron_rl.convert.arch import for_hf_config
    from megatron_rl.convert.convert import all_rules, fill_model
    from megatron_rl.convert.hf_io import HFReader

    reader = HFReader(folder)
    arch = for_hf_config(reader.config)
    rules = all_rules(arch, reader.config)
    checks.hf_names(reader, arch, rules)

    def load(model) -> None:
        fill_model(model, reader, arch, rules, show=False)

    return load


def _mcore_loader(folder: Path) -> Callable:
    def load(model) -> None:
        from megatron_rl.convert.layout import load_model

        load_model(model, folder)

    return load
