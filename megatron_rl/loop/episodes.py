"""The environment side of in-process episodes, on a thread pool of rank 0.

    runner = ThreadEpisodeRunner(sandbox_cfg, workers=4, make_env=factory, max_tokens=...)  # factory: EnvFactory
    co = runner.open(task, prompt_ids)            # the episode coroutine (envs.episode)
    fut = runner.advance(co, (ids, lps, versions))  # Future[("generate", tokens) | ("done", EpisodeResult)]
    fut = runner.submit(task, response_text)      # Future[RewardResult]: score one given answer

`open`/`advance` run the one episode loop of `envs.episode` (the same code the rollout workers run), its env
steps and rewards on the pool, with the sandbox (a `SandboxPool` when workers > 1) executing the model's
untrusted output; generation stays with the caller (`loop.rollout.Rollouts` feeds the engine). Whole
episodes on rollout workers (local processes or Slurm CPU partitions) are `loop.dispatched.DispatchRollouts`;
this runner then only runs the in-loop evaluation.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_rl.envs.base import RewardResult, Task

log = logging.getLogger(__name__)


class ThreadEpisodeRunner:
    """Runs the environment side of episodes (`envs.episode` coroutines) and scores given answers, on a thread
    pool sharing one sandbox (pool); see the module docstring. Whole episodes on rollout workers, generation
    included, are `dispatch.worker.EpisodeRunner`'s."""

    def __init__(self, sandbox_cfg, workers: int = 4, reward_weights: dict | None = None, make_env=None,
                 max_tokens: Callable[[str], int] | None = None):
        """make_env(domain, sandbox) -> Environment (default: the registry's, with `reward_weights` per domain);
        max_tokens(domain): an episode's token budget (default: the caller's limit)."""
        self.sandbox = sandbox_cfg.build()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="episode")
        self.reward_weights = reward_weights or {}
        self.make_env = make_env or self._registry_env
        self.max_tokens = max_tokens
        self.lock = threading.Lock()
        self.counters = {"submitted": 0, "finished": 0, "errors": 0, "busy_s": 0.0,
                         "last_finish": time.monotonic()}

    def submit(self, task: Task, response: str) -> Future:
        """Start env.reset(task) -> env.step(response); the future's result is a RewardResult (never raises)."""
        with self.lock:
            self.counters["submitted"] += 1
        return self.pool.submit(self._run, task, response)

    def _registry_env(self, domain: str, sandbox):
        from megatron_rl.envs.base import make_env

        return make_env(domain, sandbox=sandbox, reward_weights=self.reward_weights.get(domain))

    # ------------------------------------------------------------------------------- episodes
    def open(self, task: Task, prompt: list[int], tok, limit: int):
        """The episode coroutine of `task` (not started: `advance(co, None, prime=True)` resets the env), its
        tokens capped at `limit` and at the domain's budget."""
        from megatron_rl.envs.episode import open_episode

        def run():  # the environment is built when the episode starts, on the pool (a bad domain: status error)
            budget = min(limit, self.max_tokens(task.domain)) if self.max_tokens else limit
            return (yield from open_episode(self.make_env(task.domain, self.sandbox), task, tok, budget, prompt))

        return run()

    def advance(self, co, out, task: Task | None = None, prime: bool = False) -> Future:
        """Run the coroutine `co` to its next generation on the pool: Future[("generate", tokens) |
        ("done", EpisodeResult) | ("error", reason)] (an infrastructure bug: the sample is dropped, counted)."""
        with self.lock:
            self.counters["submitted"] += prime
        return self.pool.submit(self._advance, co, out, task, prime)

    def _advance(self, co, out, task, prime):
        from megatron_rl.envs.episode import advance

        t0 = time.perf_counter()
        try:
            if prime:
                advance(co, None)
            kind, payload = advance(co, out)
        except Exception as e:  # an infrastructure bug must not kill the loop
            log.warning("episode of task %s failed: %s: %s", getattr(task, "id", "?"), type(e).__name__, e)
            kind, payload = "error", f"{type(e).__name__}: {e}"[:300]
        with self.lock:
            c = self.counters
            c["busy_s"] += time.perf_counter() - t0
            if kind != "generate":
                c["finished"] += 1
                c["errors"] += kind == "error" or not payload.reward.valid
                c["last_finish"] = time.monotonic()
        if kind == "done" and not payload.reward.valid:
            why = "; ".join(f"{k}: {v}" for k, v in payload.reward.reasons.items()) or "no reason given"
            log.warning("episode of task %s dropped, status %s: %s", getattr(task, "id", "?"),
                        payload.reward.status, why[:500])
        return kind, payload

    # ------------------------------------------------------------------------------- one answer
    def _run(self, task: Task, response: str) -> RewardResult:
        t0 = time.perf_counter()
        try:
            env = self.make_env(task.domain, self.sandbox)
            env.reset(task)
            result = env.step(response).reward_result or RewardResult(0.0, status="error")
        except Exception as e:  # an infrastructure bug must not kill the loop: the sample is dropped
            result = RewardResult(0.0, reasons={"error": f"{type(e).__name__}: {e}"[:300]}, status="error")
        if not result.valid:  # the sample is dropped (never trained on; counted in Rollouts.batch): say why
            why = "; ".join(f"{k}: {v}" for k, v in result.reasons.items()) or "no reason given"
            log.warning("episode of task %s (%s) dropped, status %s: %s", task.id, task.domain, result.status,
                        why[:500])
        with self.lock:
            c = self.counters
            c["finished"] += 1
            c["errors"] += not result.valid
            c["busy_s"] += time.perf_counter() - t0
            c["last_finish"] = time.monotonic()
        return result

    def stats(self) -> dict:
        """Counters: submitted, finished, errors (invalid rewards), busy_s, last_finish (monotonic seconds)."""
        with self.lock:
            return dict(self.counters)

    def close(self) -> None:
        """Stop the threads and close the sandbox."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.sandbox.close()
