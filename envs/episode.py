"""The one episode loop: `reset -> [generate -> step]* -> reward`, as a coroutine that any runner drives.

    co = episode(env, task, tok, max_tokens=4096)        # a generator
    tokens = next(co)                                    # the prompt: generate from these tokens
    tokens = co.send((ids, logprobs, versions))          # the model's turn -> the next context, or ...
    # ... StopIteration(value=EpisodeResult) when the episode is over

The coroutine owns everything between two generations: the environment step (sandboxed tools, rewards),
the observation's tokens and the token budget. Whoever drives it owns generation: the rollout worker
(`megatron_rl.dispatch.worker`: one HTTP call per turn, `drive`) and the in-process loop
(`megatron_rl.loop.rollout`: the engine's batch, the env steps on a thread pool) run the same code.

An episode is one token sequence, never re-tokenised: the prompt (loss_mask 0), then per turn the model's
tokens exactly as generated (loss_mask 1, with their behaviour log-probs and policy versions) and the
observation's tokens (loss_mask 0), which the tokenizer renders in the model's chat format
(`Tokenizer.observation_ids`: the end of the model's turn, the observation message, the next assistant
header). When the next turn would not fit `max_tokens`, the episode ends as `truncated` and is scored.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from envs.base import Environment, RewardResult, Task

MIN_TURN_TOKENS = 8
"""A turn is not started with fewer tokens than this left in the episode's budget."""


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


def episode(env: Environment, task: Task, tok, max_tokens: int, prompt: list[int] | None = None
            ) -> Generator[list[int], GenOut, EpisodeResult]:
    """The episode coroutine (see the module docstring). `prompt`: the prompt's token ids when the caller
    has them already (they must be the task's prompt); else the tokenizer renders the reset observation."""
    obs = env.reset(task)
    tokens = list(prompt) if prompt else tok.prompt_ids([{"role": obs.role, "content": obs.text}],
                                                        obs.tools or None)
    n = len(tokens)
    lps, mask, versions = [0.0] * n, [0] * n, [0] * n
    env_s, turns = 0.0, 0
    while True:
        ids, turn_lps, turn_versions = yield tokens
        turns += 1
        tokens, lps, mask = tokens + list(ids), lps + list(turn_lps), mask + [1] * len(ids)
        versions += list(turn_versions)
        t0 = time.perf_counter()
        res = env.step(tok.decode(ids), action_tokens=len(ids))
        if not res.done:
            obs_ids = tok.observation_ids(res.observation.role, res.observation.text, stopped=_stopped(tok, ids))
            if len(tokens) + len(obs_ids) + MIN_TURN_TOKENS > max_tokens:
                res = env.finish("truncated")
            else:
                last = versions[-1] if versions else 0
                tokens, lps, mask = tokens + obs_ids, lps + [0.0] * len(obs_ids), mask + [0] * len(obs_ids)
                versions += [last] * len(obs_ids)
        env_s += time.perf_counter() - t0
        if res.done:
            rr = res.reward_result or RewardResult(0.0, status="error", reasons={"env": "no reward"})
            versions[:n] = [min(v for v, m in zip(versions, mask) if m)] * n if any(mask) else versions[:n]
            return EpisodeResult(tokens, lps, mask, versions, n, turns, rr, res.info.get("status", rr.status),
                                 _finish_reason(tok, ids, res), {"env": env_s, **env.tool_summary()})


def open_episode(env: Environment, task: Task, tok, max_tokens: int, prompt: list[int] | None = None
                 ) -> Generator[list[int], GenOut, EpisodeResult]:
    """The episode coroutine for `env`: the loop's own turns (`episode`), or its black-box agent's calls
    (`envs.agents.episode.agent_episode`) when the environment is played by one (`env.agent`)."""
    if env.agent:
        from envs.agents.episode import agent_episode

        return agent_episode(env, task, tok, max_tokens, prompt)
    return episode(env, task, tok, max_tokens, prompt)


def _stopped(tok, ids) -> bool:
    return bool(ids) and int(ids[-1]) in set(tok.stop_ids)


def _finish_reason(tok, ids, res) -> str:
    if res.info.get("status") == "truncated" and _stopped(tok, ids):
        return "budget"
    return "stop" if _stopped(tok, ids) else "length"


def drive(co: Generator, generate: Callable[[list[int], int], GenOut]) -> EpisodeResult:
    """Run an episode coroutine to its end with a blocking `generate(tokens, turn)`."""
    tokens, turn = next(co), 0
    while True:
        try:
            tokens = co.send(generate(tokens, turn))
        except StopIteration as stop:
            return stop.value
        turn += 1


def advance(co: Generator, out: GenOut | None) -> tuple[str, list[int] | EpisodeResult]:
    """One step of an episode coroutine: ("generate", tokens) or ("done", EpisodeResult); `out` None primes
    it. Never raises on the environment's account (an environment bug ends the episode with status error)."""
    try:
        return "generate", (next(co) if out is None else co.send(out))
    except StopIteration as stop:
        return "done", stop.value
