"""Episode execution behind one small interface, so the driver does not care where episodes run.

    runner = ThreadEpisodeRunner(sandbox_cfg, workers=4)
    fut = runner.submit(task, response_text)      # Future[RewardResult]; env.reset -> env.step -> reward

`ThreadEpisodeRunner` runs the environment's step and reward on a thread pool in this process, with the
sandbox (a `SandboxPool` when workers > 1) executing the model's untrusted output. Whole episodes on rollout
workers (local processes or Slurm CPU partitions) are `loop.dispatched.DispatchRollouts`; this runner then
only scores the in-loop evaluation.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from envs.base import RewardResult, Task

log = logging.getLogger(__name__)


class EpisodeRunner(Protocol):
    """Runs the environment side of single-turn episodes and returns their composed rewards."""

    def submit(self, task: Task, response: str) -> Future:
        """Start env.reset(task) -> env.step(response); the future's result is a RewardResult (never raises)."""

    def stats(self) -> dict:
        """Counters: submitted, finished, errors (invalid rewards), busy_s, last_finish (monotonic seconds)."""

    def close(self) -> None:
        """Stop the threads and close the sandboxes."""


class ThreadEpisodeRunner:
    """Episodes on a thread pool sharing one sandbox (pool); see the module docstring."""

    def __init__(self, sandbox_cfg, workers: int = 4, reward_weights: dict | None = None):
        self.sandbox = sandbox_cfg.build()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="episode")
        self.reward_weights = reward_weights or {}
        self.lock = threading.Lock()
        self.counters = {"submitted": 0, "finished": 0, "errors": 0, "busy_s": 0.0,
                         "last_finish": time.monotonic()}

    def submit(self, task: Task, response: str) -> Future:
        with self.lock:
            self.counters["submitted"] += 1
        return self.pool.submit(self._run, task, response)

    def _run(self, task: Task, response: str) -> RewardResult:
        from envs.base import make_env

        t0 = time.perf_counter()
        try:
            env = make_env(task.domain, sandbox=self.sandbox, reward_weights=self.reward_weights.get(task.domain))
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
        with self.lock:
            return dict(self.counters)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.sandbox.close()
