"""What a black-box agent's chat calls were, token for token: one exact sequence per episode, or several.

    rec = Recorder(tok)                                      # a tokenizer with a chat template
    prompt, exact, text = rec.prompt("ep1", messages, tools)  # the call's prompt ids
    ... generate from `prompt` ...
    rec.record("ep1", prompt, exact, text, ids, logprobs, versions)
    rec.trajectory("ep1")                                    # {"segments": [...], "splits": n}

Exactness: the chat is rendered with the model's chat template (text); when that text extends the text of the
episode's tokens so far (the previous prompt and completion, special tokens included), only the new suffix is
tokenised and appended (mask 0), so the earlier tokens are never re-tokenised and the episode stays one
sequence: the model's tokens (mask 1) interleaved with everything else (mask 0). When it does not -- the agent
edited or dropped earlier messages, rewrote the assistant's reply, or the template renders history
differently -- the call starts a new segment (`splits` counts them) and the old segment ends there: each
segment is exact on its own, nothing is trained as if exact that was not. A completion that ended on a stop
token the template does not close the turn with (SmolLM2's GGUF names <|im_start|> as eos) is continued after
that token: the rendered chat extends the text without it, and the model's token stays in the sequence.

Used by the rollout server's gateway routes (`megatron_rl.rollout.gateway`) and by the in-loop agent
episodes (`envs.agents.session`).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field


@dataclass
class Segment:
    """An exact token sequence of one episode."""

    tokens: list[int] = field(default_factory=list)
    """Prompt, completions and everything between them, in order."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-prob per token (0 where mask is 0)."""
    mask: list[int] = field(default_factory=list)
    """1 on the model's tokens, 0 elsewhere."""
    versions: list[int] = field(default_factory=list)
    """Policy version per token (0 before the first completion)."""
    text: str = ""
    """The tokens' text with special tokens (what a continuation's rendered chat must start with)."""
    open_text: str = ""
    """`text` without the last completion's stop token ('' when it ended otherwise): a continuation may start
    with this instead, when the model stopped on a token the template does not close its turn with (SmolLM2
    stops on <|im_start|> too); the model's stop token then stays in the tokens, as generated."""
    calls: int = 0
    """Completions in this segment."""
    prompt_len: int = 0
    """Tokens of the segment's first prompt."""

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("tokens", "logprobs", "mask", "versions", "calls", "prompt_len")}


class Recorder:
    """Per-episode segments; thread-safe (handlers of several episodes run concurrently)."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "has_chat_template", False):
            raise ValueError("the gateway renders OpenAI chats with the model's chat template; this tokenizer has "
                             "none (use the model's HF tokenizer folder)")
        self.tok, self.lock = tokenizer, threading.Lock()
        self.episodes: dict[str, list[Segment]] = {}

    def prompt(self, episode: str, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], bool, str]:
        """The call's prompt ids, whether it continues the episode's current segment exactly, and the chat's
        rendered text (for `record`)."""
        text = self._render(messages, tools)
        with self.lock:
            segs = self.episodes.setdefault(episode, [])
            seg = segs[-1] if segs and segs[-1].calls else None
            for base in (seg.text, seg.open_text) if seg else ():
                if base and text.startswith(base):
                    return seg.tokens + self.tok.encode(text[len(base):]), True, text
            return self.tok.encode(text), not segs, text

    def record(self, episode: str, prompt: list[int], exact: bool, text: str, ids: list[int], logprobs: list[float],
               versions: list[int]) -> None:
        """Append a completion (and the new prompt tokens before it) to the episode."""
        with self.lock:
            segs = self.episodes.setdefault(episode, [])
            if not (exact and segs and segs[-1].calls):
                segs.append(Segment(prompt_len=len(prompt)))
            seg = segs[-1]
            new = prompt[len(seg.tokens):]
            last = seg.versions[-1] if seg.versions else (versions[0] if versions else 0)
            seg.tokens += new + list(ids)
            seg.logprobs += [0.0] * len(new) + list(logprobs)
            seg.mask += [0] * len(new) + [1] * len(ids)
            seg.versions += [last] * len(new) + list(versions)
            seg.text = text + self.tok.decode_raw(ids)
            stopped = bool(ids) and int(ids[-1]) in set(self.tok.stop_ids)
            seg.open_text = text + self.tok.decode_raw(ids[:-1]) if stopped else ""
            seg.calls += 1

    def trajectory(self, episode: str) -> dict:
        with self.lock:
            segs = self.episodes.get(episode, [])
            return {"episode": episode, "segments": [s.to_dict() for s in segs], "splits": max(0, len(segs) - 1)}

    def forget(self, episode: str) -> None:
        with self.lock:
            self.episodes.pop(episode, None)

    def _render(self, messages: list[dict], tools: list[dict] | None) -> str:
        from megatron_rl.tokenizer import with_tools_system

        if tools and not self.tok.template_renders_tools:
            return self.tok.render(with_tools_system(messages, tools))
        return self.tok.render(messages, tools)


def tool_calls(text: str) -> list[dict]:
    """OpenAI `tool_calls` of the well-formed `<tool_call>` blocks in a completion."""
    from megatron_rl.envs.tools import parse_tool_calls

    return [{"id": f"call_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for i, c in enumerate(parse_tool_calls(text)) if c.error is None]


def completion_message(text: str) -> tuple[dict, list[dict]]:
    """The OpenAI assistant message of a completion's text and its `tool_calls` (also inside the message)."""
    message = {"role": "assistant", "content": text}
    calls = tool_calls(text)
    if calls:
        message["tool_calls"] = calls
    return message, calls


def chat_response(rid: str, model: str, prompt: list[int], text: str, ids: list[int], logprobs: list[float],
                  versions: list[int], finish_reason: str, exact: bool, splits: int) -> dict:
    """An OpenAI chat.completion body with the token-id extensions (prompt/completion ids, log-probs,
    versions) and the episode's exactness."""
    message, calls = completion_message(text)
    return {
        "id": rid, "object": "chat.completion", "model": model, "prompt_token_ids": prompt,
        "choices": [{"index": 0, "message": message, "token_ids": ids, "policy_versions": versions,
                     "finish_reason": "tool_calls" if calls else finish_reason,
                     "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs)]}}],
        "episode": {"exact": exact, "splits": splits},
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids)}}
