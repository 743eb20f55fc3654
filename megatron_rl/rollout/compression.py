"""Context compression for very long multi-turn prompts: keep the first K and last N turns, replace the middle.

    cfg = CompressionConfig(keep_first=1, keep_last=2, marker_token_ids=tok.encode("[...]\\n"))
    ids, record = compress_turns(prompt_ids, turn_boundaries=[1, 40, 95, 160, 230], cfg=cfg)
    # or per request: engine.add_request(prompt_ids, params, turn_boundaries=[...], compression=cfg)

Turns are given at the token level: `turn_boundaries` holds the offset in the prompt where each turn starts
(strictly increasing, each in [0, len(prompt))); turn i spans [b[i], b[i+1]) and the last turn runs to the
end of the prompt. Tokens before b[0] (a BOS, a template header) are always kept. When there are more than
keep_first + keep_last turns (and the prompt is longer than `min_prompt_tokens`), the middle turns are
replaced by the marker tokens, or, with mode 'summarize', by the token ids a summariser callback returns.

The compressed ids are what the model sees and what the request's output reports as its prompt, so the
trainer trains on exactly those tokens; the `CompressionRecord` (also in the output) says which span of the
original prompt was dropped and what replaced it, so the original can be reconstructed and audited.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

from megatron_rl.config import ConfigError

Summarizer = Callable[[list[list[int]]], list[int]]
"""Token ids of a summary of the dropped turns (given as a list of token-id lists, one per turn)."""


@dataclass
class CompressionConfig:
    """How to shorten a long multi-turn prompt."""

    keep_first: int = 1
    """Turns kept from the start (the system prompt / task statement)."""
    keep_last: int = 4
    """Turns kept from the end (the most recent exchanges)."""
    mode: Literal["drop", "summarize"] = "drop"
    """'drop': put `marker_token_ids` in place of the middle turns; 'summarize': the summariser's ids."""
    marker_token_ids: list[int] = field(default_factory=list)
    """Token ids replacing the dropped turns in 'drop' mode (empty drops them without a trace in the prompt)."""
    min_prompt_tokens: int = 0
    """Compress only prompts longer than this many tokens (0: whenever there are turns to drop)."""

    def validate(self) -> None:
        if self.keep_first < 0 or self.keep_last < 0:
            raise ConfigError(f"compression.keep_first/keep_last must be >= 0, got {self.keep_first}/{self.keep_last}")
        if self.mode not in ("drop", "summarize"):
            raise ConfigError(f"compression.mode {self.mode!r}: use 'drop' or 'summarize'")
        if self.min_prompt_tokens < 0:
            raise ConfigError(f"compression.min_prompt_tokens must be >= 0, got {self.min_prompt_tokens}")

    def build(self, summarizer: Summarizer | None = None) -> Callable[[list[int], list[int]], tuple]:
        """A function (prompt, turn_boundaries) -> (compressed ids, CompressionRecord)."""
        self.validate()
        return lambda prompt, boundaries: compress_turns(prompt, boundaries, self, summarizer)


@dataclass
class CompressionRecord:
    """What compression did to one prompt (part of the request output)."""

    original_num_tokens: int
    """Length of the prompt as sent."""
    num_tokens: int
    """Length of the prompt the model saw."""
    num_turns: int
    """Turns in the prompt as sent."""
    dropped_turns: list[int] = field(default_factory=list)
    """Indices of the turns removed (empty: nothing was compressed)."""
    dropped_spans: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) token spans of the original prompt that were removed."""
    inserted_at: int = 0
    """Offset in the compressed prompt where the replacement tokens start."""
    inserted_token_ids: list[int] = field(default_factory=list)
    """Marker or summary tokens put in place of the dropped spans."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dropped_spans"] = [list(s) for s in self.dropped_spans]
        return d


def check_boundaries(boundaries: list[int], prompt_len: int) -> list[int]:
    """The boundaries as ints; ValueError naming the problem unless strictly increasing inside the prompt."""
    if not isinstance(boundaries, (list, tuple)) or not boundaries:
        raise ValueError("turn_boundaries must be a non-empty list of token offsets where each turn starts")
    if any(isinstance(b, bool) or not isinstance(b, int) for b in boundaries):
        raise ValueError("turn_boundaries must be integers (token offsets into the prompt)")
    out = list(boundaries)
    if out[0] < 0 or out[-1] >= prompt_len:
        raise ValueError(f"turn_boundaries must lie in [0, {prompt_len}) (the prompt has {prompt_len} tokens)")
    if any(a >= b for a, b in zip(out, out[1:])):
        raise ValueError("turn_boundaries must be strictly increasing (each is where a turn starts)")
    return out


def compress_turns(prompt: list[int], turn_boundaries: list[int], cfg: CompressionConfig,
                   summarizer: Summarizer | None = None) -> tuple[list[int], CompressionRecord]:
    """Keep the first `keep_first` and last `keep_last` turns, replace the middle (see module docstring)."""
    cfg.validate()
    b = check_boundaries(turn_boundaries, len(prompt))
    n = len(b)
    record = CompressionRecord(len(prompt), len(prompt), n)
    if n <= cfg.keep_first + cfg.keep_last or len(prompt) <= cfg.min_prompt_tokens:
        return list(prompt), record
    ends = b[1:] + [len(prompt)]
    middle = range(cfg.keep_first, n - cfg.keep_last)  # turn indices dropped
    start, end = b[middle[0]], ends[middle[-1]]
    if cfg.mode == "summarize":
        if summarizer is None:
            raise ValueError("compression mode 'summarize' needs a summarizer (RolloutEngine(..., summarizer=fn)); "
                             "use mode 'drop' with marker_token_ids otherwise")
        inserted = [int(t) for t in summarizer([list(prompt[b[i]:ends[i]]) for i in middle])]
    else:
        inserted = list(cfg.marker_token_ids)
    out = list(prompt[:start]) + inserted + list(prompt[end:])
    record.num_tokens = len(out)
    record.dropped_turns = list(middle)
    record.dropped_spans = [(start, end)]
    record.inserted_at = start
    record.inserted_token_ids = inserted
    return out, record


def restore(compressed: list[int], record: CompressionRecord, original: list[int]) -> bool:
    """Whether `compressed` is exactly `original` with the recorded spans replaced (an audit check)."""
    if not record.dropped_spans:
        return compressed == original
    (start, end), k = record.dropped_spans[0], len(record.inserted_token_ids)
    return (compressed[:start] == original[:start] and compressed[start:start + k] == record.inserted_token_ids
            and compressed[start + k:] == original[end:])
