"""Tokenizers behind one small interface, chosen in one place of the run config (`tokenizer:`).

    tok = TokenizerConfig(kind="auto").build(model_cfg)      # the run's tokenizer, for every component
    ids = tok.prompt_ids([{"role": "user", "content": "What is 7 + 5?"}])   # chat template + generation prompt
    text = tok.decode(generated_ids)                          # special tokens dropped
    stop = tok.stop_ids                                       # eos and the template's end-of-turn tokens

- `HFTokenizer`: a Hugging Face tokenizer read from a local folder (`tokenizer.json`, `tokenizer_config.json`,
  `special_tokens_map.json`, `config.json`/`generation_config.json` for the eos ids, the chat template from
  `tokenizer_config.json` or `chat_template.jinja`), through the `tokenizers` library. The chat template is
  rendered with jinja2 the way transformers' `apply_chat_template` renders it (sandboxed environment,
  trim_blocks/lstrip_blocks, `tojson`, `raise_exception`, `strftime_now`) and the text encoded without
  adding special tokens, so the ids equal transformers' (tests/ground/test_tokenizer.py).
- `ByteTokenizer`: UTF-8 bytes + pad/bos/eos, no download; tiny byte-level models and fast tests. Its
  "chat template" is the compact prompt (`megatron_rl.prompts`).

`vocab_size` is the tokenizer's own size. A model's vocabulary may be larger (Megatron pads it for TP; the byte
model's 384 > 259): the ids in [tokenizer.vocab_size, model vocab) are padding, never sampled by the engine
and never part of a log-prob's normalisation (`rollout.sampling`, `trainer.logprobs`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from megatron_rl.config import ConfigError

SPECIALS = ("<pad>", "<bos>", "<eos>")
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>", "<|end_of_text|>",
                "<｜end▁of▁sentence｜>", "<|return|>")
"""Special tokens that end an assistant turn in the common chat templates (used when the template has them)."""


class Tokenizer(Protocol):
    """What every component needs of a tokenizer."""

    vocab_size: int
    pad_id: int
    eos_id: int
    stop_ids: list[int]
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]: ...

    def observation_ids(self, role: str, text: str, stopped: bool) -> list[int]:
        """Tokens that follow a model turn in a multi-turn episode: the end of that turn (unless the model
        `stopped` on an end-of-turn token already), the observation as a `role` message, and the next
        assistant header."""


@dataclass(frozen=True)
class ByteTokenizer:
    """Token ids 0..255 are bytes; 256.. are the special tokens; vocab padded to `vocab_size`."""

    model_vocab: int = 384
    """Model vocabulary (>= 259); ids past the specials are padding, never produced."""

    def __post_init__(self):
        if self.model_vocab < 256 + len(SPECIALS):
            raise ValueError(f"ByteTokenizer needs a model vocab_size >= {256 + len(SPECIALS)}, got {self.model_vocab}")

    vocab_size = 256 + len(SPECIALS)
    pad_id, bos_id, eos_id = 256, 257, 258
    has_chat_template = False

    @property
    def stop_ids(self) -> list[int]:
        return [self.eos_id]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Bytes back to text; special and out-of-range ids are dropped, bad UTF-8 is replaced."""
        return bytes(i for i in (int(t) for t in ids) if 0 <= i < 256).decode("utf-8", errors="replace")

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """bos + the messages' contents (the compact format of tiny byte-level models: no template)."""
        return [self.bos_id, *self.encode("".join(m["content"] for m in messages))]

    def observation_ids(self, role: str, text: str, stopped: bool) -> list[int]:
        """The observation's bytes (no chat format)."""
        return self.encode(text)


class HFTokenizer:
    """A Hugging Face tokenizer from a local folder (see the module docstring)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        if not (self.path / "tokenizer.json").is_file():
            raise ConfigError(f"{self.path / 'tokenizer.json'} not found: an HF tokenizer folder needs tokenizer.json"
                              f" (transformers' tokenizer.save_pretrained(DIR) writes one); or tokenizer.kind=byte")
        self._tok = _Tok.from_file(str(self.path / "tokenizer.json"))
        self._tok.no_padding()
        self._tok.no_truncation()
        self.config = _read_json(self.path / "tokenizer_config.json")
        self.specials = self._special_tokens()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = self._chat_template()
        self.has_chat_template = self.chat_template is not None
        self.eos_id = self._eos_id()
        self.pad_id = self._id(self.specials.get("pad_token")) if self.specials.get("pad_token") else self.eos_id
        self.stop_ids = self._stop_ids()
        self._frames: dict[str, tuple[str, str, str]] = {}  # role -> observation frame (observation_ids)

    # ---------------------------------------------------------------------------------------- files
    def _special_tokens(self) -> dict[str, str]:
        out = {}
        for src in (_read_json(self.path / "special_tokens_map.json"), self.config):
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                v = src.get(key)
                v = v.get("content") if isinstance(v, dict) else v
                if isinstance(v, str) and key not in out:
                    out[key] = v
        return out

    def _chat_template(self) -> str | None:
        tpl = self.config.get("chat_template")
        if isinstance(tpl, list):  # named templates: the default one
            tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
        if tpl is None and (self.path / "chat_template.jinja").is_file():
            tpl = (self.path / "chat_template.jinja").read_text()
        return tpl

    def _id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ConfigError(f"{self.path}: special token {token!r} is not in tokenizer.json's vocabulary")
        return i

    def _eos_id(self) -> int:
        """The model's eos: generation_config.json / config.json `eos_token_id` first, else the tokenizer's."""
        for name in ("generation_config.json", "config.json"):
            e = _read_json(self.path / name).get("eos_token_id")
            if e is not None:
                return int(e[0] if isinstance(e, list) else e)
        if "eos_token" not in self.specials:
            raise ConfigError(f"{self.path}: no eos token (tokenizer_config.json eos_token or config.json "
                              f"eos_token_id); a tokenizer must say where a sample ends")
        return self._id(self.specials["eos_token"])

    def _stop_ids(self) -> list[int]:
        """eos ids of every file, and the end-of-turn tokens the chat template uses."""
        ids = {self.eos_id}
        for name in ("generation_config.json", "config.json"):
            e = _read_json(self.path / name).get("eos_token_id")
            ids |= set(e if isinstance(e, list) else [e] if e is not None else [])
        if "eos_token" in self.specials:
            ids.add(self._id(self.specials["eos_token"]))
        for tok in _END_OF_TURN:
            if self.chat_template and tok in self.chat_template and self._tok.token_to_id(tok) is not None:
                ids.add(self._tok.token_to_id(tok))
        return sorted(int(i) for i in ids)

    # ------------------------------------------------------------------------------------ interface
    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=True)

    def decode_raw(self, ids) -> str:
        """The ids' text with special tokens kept (what the chat template's text of them is)."""
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=False)

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` (as transformers' apply_chat_template(tokenize=False))."""
        if self.chat_template is None:
            raise ConfigError(f"{self.path} has no chat template (tokenizer_config.json chat_template or "
                              f"chat_template.jinja); use a chat model or prompts without one")
        return _compiled(self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **self.specials)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered chat, ending with the assistant's generation prompt. Tools go to the
        template when it renders them, else into a system message in the Hermes format (`TOOLS_SYSTEM`)."""
        if tools and not self.template_renders_tools:
            return self.encode(self.render(with_tools_system(messages, tools)))
        return self.encode(self.render(messages, tools))

    def end_of_turn(self) -> str | None:
        """The special token that closes an assistant turn in the chat template (SmolLM2: <|im_end|>), found by
        rendering one; None without a template, when it fails to render, or when a turn ends in plain text."""
        if not self.chat_template:
            return None
        mark = "\x01ASSISTANT\x01"
        chat = [{"role": "user", "content": "U"}, {"role": "assistant", "content": mark}]
        try:
            text = self.render(chat, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 (a template may refuse this chat: raise_exception, missing variables)
            return None
        after = text.split(mark, 1)[1].lstrip() if mark in text else ""
        specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values() if t.special),
                          key=len, reverse=True)
        return next((t for t in specials if after.startswith(t)), None)

    @property
    def template_renders_tools(self) -> bool:
        return bool(self.chat_template) and "tools" in self.chat_template

    def observation_ids(self, role: str, text: str, stopped: bool) -> list[int]:
        """See `Tokenizer.observation_ids`. Rendered by the chat template around placeholders, so the tokens
        are the template's own; a tool result is a `user` message when the template has no tool role."""
        if not self.has_chat_template:
            return self.encode(text)
        closing, pre, post = self._observation_frame("tool" if role == "tool" and self.template_renders_tools
                                                     else "user" if role == "tool" else role)
        if stopped:
            for i in self.stop_ids:
                stop = self._tok.id_to_token(i) or ""
                if stop and closing.startswith(stop):
                    closing = closing[len(stop):]
                    break
        return self.encode(closing + pre + text + post)

    def _observation_frame(self, role: str) -> tuple[str, str, str]:
        """(what ends an assistant turn, text before an observation, text after it incl. the next header)."""
        frame = self._frames.get(role)
        if frame is None:
            a_mark, o_mark = "\x01ASSISTANT\x01", "\x01OBSERVATION\x01"
            chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                    {"role": "assistant", "content": a_mark}]
            head = self.render(chat, add_generation_prompt=False)
            full = self.render(chat + [{"role": role, "content": o_mark}], add_generation_prompt=True)
            if not full.startswith(head) or a_mark not in head or o_mark not in full:
                raise ConfigError(f"{self.path}: the chat template does not render a conversation as a prefix of "
                                  f"its continuation, so multi-turn episodes cannot be tokenised exactly")
            closing = head[head.index(a_mark) + len(a_mark):]
            pre, post = full[len(head):].split(o_mark, 1)
            frame = self._frames[role] = (closing, pre, post)
        return frame


TOOLS_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
"""The tool prompt of templates that do not render tools (the Hermes / Qwen2.5 format, which
`envs.base.parse_tool_calls` reads back)."""


def with_tools_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the tools' JSON schemas in the system message (added, or appended to the first one)."""
    block = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t, sort_keys=True) for t in tools))
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


_TEMPLATES: dict[str, object] = {}


def _compiled(source: str):
    """The template compiled as transformers compiles chat templates (cached by source)."""
    if source not in _TEMPLATES:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            from datetime import datetime

            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


@dataclass
class TokenizerConfig:
    """Which tokenizer the run uses; every component (loop, warm-up, eval, server, workers) gets this one."""

    kind: Literal["auto", "byte", "hf"] = "auto"
    """auto: the model's own (model.init's folder) when it has tokenizer.json, else byte; byte; hf (a folder)."""
    path: str = ""
    """HF tokenizer folder for kind=hf (default: the model.init folder)."""

    def validate(self) -> None:
        if self.kind == "hf" and self.path and not (Path(self.path) / "tokenizer.json").is_file():
            raise ConfigError(f"tokenizer.path {self.path!r} has no tokenizer.json; point it at an HF tokenizer folder")

    def resolved_path(self, model_cfg) -> str:
        """The HF folder this config names ('' for the byte tokenizer)."""
        from megatron_rl.model_init import tokenizer_folder

        if self.kind == "byte":
            return ""
        folder = self.path or tokenizer_folder(model_cfg.init)
        if self.kind == "hf" and not folder:
            raise ConfigError("tokenizer.kind=hf needs tokenizer.path (or model.init: hf:DIR with tokenizer files)")
        return folder

    def build(self, model_cfg) -> Tokenizer:
        """The run's tokenizer, checked against the model's vocabulary."""
        folder = self.resolved_path(model_cfg)
        tok = HFTokenizer(folder) if folder else ByteTokenizer(model_cfg.vocab_size)
        check_vocab(tok, model_cfg.vocab_size, folder or "the byte tokenizer")
        return tok


def check_vocab(tok, model_vocab: int, name: str) -> None:
    if tok.vocab_size > model_vocab:
        raise ConfigError(f"tokenizer {name} has {tok.vocab_size} tokens but model.vocab_size is {model_vocab}: "
                          f"its ids would not fit the model; use the model's own tokenizer or a larger model vocab")


def from_path(path: str, model_vocab: int) -> Tokenizer:
    """A worker's tokenizer, given by path ('' = byte tokenizer for a model of `model_vocab` ids)."""
    return HFTokenizer(path) if path else ByteTokenizer(model_vocab)
