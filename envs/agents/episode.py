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
tokens trained (mask 1) and everything else masked. An agent that edits its history splits the episode; then
only the last segment (exact on its own) is trained and `agent.splits` / `agent.untrained_tokens` say what was
left out -- nothing is trained as if exact that was not.

`prompt` (the caller's first prompt, generated before the agent was asked): when the agent's first call has
exactly these ids the caller's completion answers it (a group's shared prefill); otherwise it is discarded
and the agent's own prompt is generated.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator

from envs.agents.session import AgentSession
from envs.base import Environment, RewardResult, Task

log = logging.getLogger(__name__)


def agent_episode(env: Environment, task: Task, tok, max_tokens: int, prompt: list[int] | None = None
                  ) -> Generator[list[int], tuple, object]:
    from envs.episode import EpisodeResult

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
    tokens, lps, mask, versions, n, untrained = _sequence(session, prompt)
    timings = {"env": time.perf_counter() - t0, "agent.calls": float(turns), "agent.splits": float(session.splits()),
               "agent.untrained_tokens": float(untrained), "agent.rejected": float(session.rejected)}
    stop = bool(last) and int(last[-1]) in set(tok.stop_ids)
    return EpisodeResult(tokens, lps, mask, versions, n, turns, rr, res.info.get("status", rr.status),
                         "budget" if session.truncated else ("stop" if stop else "length"), timings)


def _run_agent(env: Environment, session: AgentSession, obs, box: dict) -> None:
    try:
        box["result"] = env.run_agent(session, obs)
    except Exception as e:  # an infrastructure failure: the episode ends, marked
        box["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        session.agent_exited()


def _sequence(session: AgentSession, prompt: list[int] | None):
    """(tokens, logprobs, mask, versions, prompt_len, untrained model tokens): the last segment, or the prompt
    alone when the agent made no call that was answered."""
    segs = session.segments()
    if not segs:
        ids = list(prompt or [])
        return ids, [0.0] * len(ids), [0] * len(ids), [0] * len(ids), len(ids), 0
    seg, untrained = segs[-1], sum(sum(s["mask"]) for s in segs[:-1])
    n, versions, mask = seg["prompt_len"], list(seg["versions"]), list(seg["mask"])
    model = [v for v, m in zip(versions, mask) if m]
    versions[:n] = [min(model)] * n if model else versions[:n]
    return list(seg["tokens"]), list(seg["logprobs"]), mask, versions, n, untrained
