"""What `model.init` names: the kind of checkpoint and its folder (path checks only; nothing is read).

    hf:DIR      an HF folder (config.json + safetensors + tokenizer files)
    mcore:DIR   a `megatron-rl convert hf-to-mcore` checkpoint (its HF side files under hf_files/)

A ground module: the tokenizer finds the checkpoint's tokenizer files here, and `megatron_rl.convert.source`
reads the checkpoint itself (shape, weights) in the run's resolve step.
"""
from __future__ import annotations

from pathlib import Path

from megatron_rl.config import ConfigError

KINDS = ("hf", "mcore")
META = "megatron_rl_convert.json"


def parse(init: str) -> tuple[str, Path]:
    """('hf' | 'mcore', folder) of a model.init value; errors name the value and the fix."""
    kind, sep, path = init.partition(":")
    if not sep or kind not in KINDS or not path:
        raise ConfigError(f"model.init={init!r}: use hf:DIR (an HF folder), mcore:DIR (a converted checkpoint) "
                          f"or '' for random weights")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        hint = " (the main job's model is made by scripts/setup.sh)" if "SmolLM2" in path else ""
        raise ConfigError(f"model.init={init!r}: folder {folder} does not exist{hint}")
    return kind, folder


def tokenizer_folder(init: str) -> str:
    """The folder holding the checkpoint's tokenizer files ('' when there is none or no checkpoint)."""
    if not init:
        return ""
    kind, folder = parse(init)
    folder = folder if kind == "hf" else folder / "hf_files"
    return str(folder) if (folder / "tokenizer.json").is_file() else ""
