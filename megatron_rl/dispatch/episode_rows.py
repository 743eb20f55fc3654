"""One episode run by a rollout worker, as shard rows: the token layout of the module docstring of `dispatch.worker`
(prompt, model turns, observations), a failure as one error row."""
from __future__ import annotations

import json
import logging
import time

import numpy as np

from megatron_rl.dispatch.generators import GenerationError, Generator
from megatron_rl.dispatch.spec import EpisodeSpec
from megatron_rl.dispatch.testing import ScriptedGenerator
from megatron_rl.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def run_episode(ep: EpisodeSpec, env, generator: Generator, tok: Tokenizer, max_tokens: int = 1 << 30):
    """One episode -> its Trajectory (`episode_rows`' last row)."""
    return episode_rows(ep, env, generator, tok, max_tokens)[-1]


def episode_rows(ep: EpisodeSpec, env, generator: Generator, tok: Tokenizer, max_tokens: int = 1 << 30,
                 state=None) -> list:
    """One episode -> the Trajectory rows it publishes, through the one episode loop (`envs.episode`: reset,
    [generate -> step]* until done), each turn one call of `generator`: the episode's, after the earlier exact
    segments of a split black-box agent episode (`shards.segment_rows`).

    A non-retryable `GenerationError` (the server rejected the request, a malformed answer) gives a
    `failed_trajectory`; a retryable one propagates (the episode is left for the dispatcher's next round).
    state: (store, folder, every) to checkpoint a multi-turn episode every `every` model turns in the store and
    continue from its last checkpoint (`envs.episode_state`); None = off.
    """
    from megatron_rl.data.routes import context_routes
    from megatron_rl.data.shards import Trajectory, segment_rows
    from megatron_rl.envs.base import Task
    from megatron_rl.envs.episode import drive, open_episode

    t0, gen_s, routes = time.perf_counter(), [0.0], {}
    task = Task(**{k: v for k, v in ep.task.items() if k in ("id", "domain", "prompt", "payload", "split")})
    def make():
        return open_episode(env, task, tok, min(max_tokens, env.budget.max_tokens), list(ep.prompt_ids) or None)

    def gen(tokens, turn):
        return _generate(generator, tokens, ep, turn, gen_s, routes)

    try:
        if state is not None and state[2] and env.multi_turn and not env.agent:
            from megatron_rl.envs.episode_state import drive_resumable

            store, folder, every = state
            r = drive_resumable(make, gen, lambda: store.load_state(folder, ep.episode_id),
                                lambda data: store.save_state(folder, ep.episode_id, data), every, ep.episode_id)
        else:
            r = drive(make(), gen)
    except GenerationError as e:
        if e.retryable:
            raise
        return [failed_trajectory(ep, list(ep.prompt_ids), e.status, str(e))]
    timings = {"generate": gen_s[0], **r.timings, "turns": float(r.turns), "total": time.perf_counter() - t0}
    from megatron_rl.envs.procedural import task_provenance

    prov = {k: json.dumps(v, sort_keys=True) for k, v in r.reward.provenance.items()}
    prov.update(task_provenance(task))  # a generated task's library, version, generator, seed, index, settings
    if isinstance(generator, ScriptedGenerator):
        prov["policy"] = "scripted test policy (not a model)"
    model_versions = [v for v, m in zip(r.versions, r.loss_mask) if m] or [0]
    main = Trajectory(
        tokens=np.asarray(r.tokens, np.int32), logprobs=np.asarray(r.logprobs, np.float32),
        loss_mask=np.asarray(r.loss_mask, np.uint8), prompt_len=r.prompt_len, reward=float(r.reward.total),
        group_id=ep.group_id, policy_version_first=min(model_versions), policy_version_last=max(model_versions),
        env=ep.env, task_id=str(task.id), episode_id=ep.episode_id, status=_status(r),
        reward_components=dict(r.reward.components), timings=timings, provenance=prov,
        token_versions=np.asarray(r.versions, np.int32),
        routed_experts=context_routes(routes.get("seen"), routes.get("routes"), list(r.tokens)))
    return [*segment_rows(main, r.segments), main]


def _status(r) -> str:
    """The shard status: the reward's failure (sandbox_error, error) first, else the episode's (ok, truncated)."""
    return r.reward.status if not r.reward.valid else r.status


def _generate(generator: Generator, tokens: list[int], ep: EpisodeSpec, turn: int, gen_s: list[float],
              routes: dict | None = None):
    """One turn from the generator, checked: (ids, logprobs, per-token versions); GenerationError if malformed.
    A generator asked for routing replay also returns (tokens it ran, their experts): kept in `routes` (the
    latest turn's, which ran the whole context so far)."""
    t = time.perf_counter()
    ids, lps, version, *extra = generator.generate(tokens, ep.sampling, episode=ep, turn=turn)
    gen_s[0] += time.perf_counter() - t
    if extra and routes is not None:
        routes["seen"], routes["routes"] = extra[0]
    versions = [int(version)] * len(ids) if isinstance(version, (int, np.integer)) else list(version)
    if not len(ids) == len(lps) == len(versions):
        raise GenerationError(f"generator returned {len(ids)} tokens, {len(lps)} log-probs and {len(versions)} "
                              "policy versions")
    return list(ids), list(lps), versions


def failed_trajectory(ep: EpisodeSpec, prompt: list[int], status: str, reason: str):
    """An episode that could not be generated: its prompt only (nothing to train on), reward 0, the status
    and `provenance['error']` saying why. Published, so the dispatcher does not re-run a hopeless request."""
    from megatron_rl.data.shards import Trajectory

    log.warning("episode %s failed (%s): %s", ep.episode_id, status, reason)
    n = len(prompt)
    return Trajectory(
        tokens=np.asarray(prompt, np.int32), logprobs=np.zeros(n, np.float32), loss_mask=np.zeros(n, np.uint8),
        prompt_len=n, reward=0.0, group_id=ep.group_id, policy_version_first=0, policy_version_last=0,
        env=ep.env, task_id=str(ep.task.get("id", "")), episode_id=ep.episode_id, status=status,
        provenance={"error": reason[-2000:]})
