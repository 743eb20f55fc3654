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

from megatron_rl.envs.base import Environment, RewardResult, Task
from megatron_rl.envs.episode_result import SEGMENT_KEYS, EpisodeResult, GenOut  # noqa: F401 (this module's result types)

MIN_TURN_TOKENS = 8
"""A turn is not started with fewer tokens than this left in the episode's budget."""


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
        from megatron_rl.envs.agents.episode import agent_episode

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
