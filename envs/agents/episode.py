"""A black-box agent's episode as the one episode coroutine (`envs.episode`): its chat calls are the turns.

    co = agent_episode(env, task, tok, max_tokens=8192, prompt=None)
    tokens = next(co)                        # the agent's first call: generate from these tokens
    tokens = co.send((ids, logprobs, versions))  # its next call ... StopIteration(EpisodeResult) at its end

The environment (`env.run_agent(session, observation)`, e.g. Harbor's) starts the agent program in its sandbox
with the session's Unix socket bound into it, on a thread of its own; each chat call of the agent is yielded
to the driver as one generation, and the completion goes back to the agent. When the agent exits (or its
time, turns or token budget are spent), the environment scores the episode (Harbor: the task's tests in a
separate verifier sandbox).

The trajectory is the recorder's (`envs.agents.recorder`): the exact token ids of every call, the model's
tokens trained (mask 1) and everything else masked. An agent that edits its history splits the episode into
segments, each exact on its own (the context the engine received, token for token): the last is the episode's
sequence, the earlier ones travel in `EpisodeResult.segments` and are trained as rows of the same episode (one
reward and one advantage for all of them; `megatron_rl.data.shards.SEGMENT_MARK`); `agent.splits` counts them.
Nothing is trained as if exact that was not: no segment is ever joined to another.

`prompt` (the caller's first prompt, generated before the agent was asked): when the agent's first call has
exactly these ids the caller's completion answers it (a group's shared prefill); otherwise it is discarded
and the agent's own prompt is generated.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator

from megatron_rl.envs.agents.session import AgentSession
from megatron_rl.envs.base import Environment, RewardResult, Task
from megatron_rl.envs.episode_result import SEGMENT_KEYS, EpisodeResult

log = logging.getLogger(__name__)


def agent_episode(env: Environment, task: Task, tok, max_tokens: int, prompt: list[int] | None = None
                  ) -> Generator[list[int], tuple, object]:
    obs = env.reset(task)
    session = AgentSession(tok, max_tokens, call_timeout_s=env.agent_wall_s() + 60.0)
    box: dict = {}
    thread = threading.Thread(target=_run_agent, args=(env, session, obs, box), daemon=True, name="agent")
    t0 = time.perf_counter()
    thread.start()
    wait_s, turns, last = env.agent_wall_s() + 30.0, 0, []
    try:
        call = None if prompt else session.next_call(wait_s)
        out = yield list(prompt) if prompt else (call.prompt if call else [])
        if call is None and prompt:
            call = session.next_call(wait_s)
        if call is not None and prompt and call.prompt != list(prompt):
            out = yield call.prompt  # the caller's completion answered another prompt: generate the agent's
        while call is not None:
            turns, last = turns + 1, list(out[0])
            session.answer(call, *out)
            call = session.next_call(wait_s)
            if call is not None:
                out = yield call.prompt
    finally:
        session.close()
        thread.join(timeout=30.0)
    if "error" in box or thread.is_alive():  # the agent's sandbox failed: no score (infrastructure, not the model)
        log.warning("agent episode of task %s: %s", task.id, box.get("error", "the agent's sandbox did not end"))
        env.infra_status = "error"
    res = env.finish("truncated" if session.truncated else "ok")
    rr = res.reward_result or RewardResult(0.0, status="error", reasons={"env": "no reward"})
    segments = session.segments()
    tokens, lps, mask, versions, n = _sequence(segments[-1]) if segments else _prompt_only(prompt)
    timings = {"env": time.perf_counter() - t0, "agent.calls": float(turns), "agent.splits": float(session.splits()),
               "agent.rejected": float(session.rejected)}
    stop = bool(last) and int(last[-1]) in set(tok.stop_ids)
    return EpisodeResult(tokens, lps, mask, versions, n, turns, rr, res.info.get("status", rr.status),
                         "budget" if session.truncated else ("stop" if stop else "length"), timings,
                         segments=[dict(zip(SEGMENT_KEYS, _sequence(s))) for s in segments[:-1]])


def _run_agent(env: Environment, session: AgentSession, obs, box: dict) -> None:
    try:
        box["result"] = env.run_agent(session, obs)
    except Exception as e:  # an infrastructure failure: the episode ends, marked
        box["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        session.agent_exited()


def _prompt_only(prompt: list[int] | None):
    """The sequence of an episode whose agent made no call that was answered: the prompt alone."""
    ids = list(prompt or [])
    return ids, [0.0] * len(ids), [0] * len(ids), [0] * len(ids), len(ids)


def _sequence(seg: dict):
    """(tokens, logprobs, mask, versions, prompt_len) of a recorded segment; its prompt carries the version of
    its first model token."""
    n, versions, mask = seg["prompt_len"], list(seg["versions"]), list(seg["mask"])
    model = [v for v, m in zip(versions, mask) if m]
    versions[:n] = [min(model)] * n if model else versions[:n]
    return list(seg["tokens"]), list(seg["logprobs"]), mask, versions, n
