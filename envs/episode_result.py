"""What an episode coroutine (`envs.episode`, `envs.agents.episode`) returns: `EpisodeResult`, and the types
its driver sends in. A module of its own so that both coroutines import it and neither imports the other's."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.envs.types import RewardResult

SEGMENT_KEYS = ("tokens", "logprobs", "loss_mask", "versions", "prompt_len")
"""The fields of one segment of `EpisodeResult.segments`."""


@dataclass
class EpisodeResult:
    """A finished episode: its token sequence and what the environment made of it."""

    tokens: list[int]
    """Prompt + every turn's model and observation tokens."""
    logprobs: list[float]
    """Behaviour log-prob per token (0.0 where loss_mask is 0)."""
    loss_mask: list[int]
    """1 on the model's tokens, 0 on the prompt and observations."""
    versions: list[int]
    """Policy version per token (prompt and observations: the version of the turn before)."""
    prompt_len: int
    """Tokens of the prompt."""
    turns: int
    """Model turns taken."""
    reward: RewardResult
    """The composed reward (status not ok: an infrastructure failure, never a score)."""
    status: str
    """ok, truncated, sandbox_error or error (the environment's final status)."""
    finish_reason: str = ""
    """Why the last turn ended: stop (a stop token), length, or budget (the episode's token budget)."""
    timings: dict = field(default_factory=dict)
    """Seconds spent in env steps ('env'), and the environment's per-tool counters (`tool.<name>.*`)."""
    segments: list[dict] = field(default_factory=list)
    """Earlier exact segments of an episode that was split (a black-box agent edited its history:
    `envs.agents.episode`), first to last, each {tokens, logprobs, loss_mask, versions, prompt_len} like the
    fields above, which hold the last segment; trained as rows of this episode, with its reward."""

    @property
    def infra_status(self) -> str:
        """ok when the episode's reward is a score (truncated included: the model's doing); else the
        infrastructure failure (sandbox_error, error, timeout) that makes it no score at all."""
        if not self.reward.valid:
            return self.reward.status
        return "ok" if self.status in ("ok", "truncated") else self.status


GenOut = tuple[list[int], list[float], list[int]]
