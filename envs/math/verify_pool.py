"""math-verify in worker processes killed at a deadline, so that no answer can stall the caller's process.

THREAT MODEL. The answer is untrusted model text; math-verify (sympy) can spend unbounded time and memory on
it (`\\boxed{9^{9^{9^{9}}}}` holds the GIL for a minute), and its own timeout uses SIGALRM, which works only
in the main thread. Covered: every comparison runs in a persistent worker process (one per concurrent
caller, up to `max_workers`); the caller waits on a pipe with a deadline - waiting releases the GIL, so
the caller's other threads (the trainer's) keep running - and a worker that misses the deadline is
SIGKILLed and replaced; a worker's memory is capped (RLIMIT_AS). Not covered: the worker is a plain
process of the caller's user, not a sandbox - math-verify's parser is trusted code, but sympy's parsing of
plain expressions is not hardened against hostile input; use the code sandbox for anything that executes.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time

_WORKER = r'''
import json, resource, sys
cap = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
import math_verify
sys.stdout.write("ready\n")
sys.stdout.flush()
for line in sys.stdin:
    try:
        req = json.loads(line)
        gold, ans, t = req["gold"], req["answer"], req["timeout"]
        g = math_verify.parse(gold if "$" in gold else "$" + gold + "$", parsing_timeout=t)
        a = math_verify.parse(ans if "$" in ans else "$" + ans + "$", parsing_timeout=t)
        if not a:
            a = math_verify.parse(ans, parsing_timeout=t)
        out = {"equal": bool(g and a and math_verify.verify(g, a, timeout_seconds=t))}
    except BaseException as e:
        out = {"error": "%s: %s" % (type(e).__name__, str(e)[:200])}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
'''


class MathVerifyTimeout(TimeoutError):
    """math-verify did not answer within the deadline; its worker was killed."""


class MathVerifyError(RuntimeError):
    """The worker failed (could not start, crashed, ran out of memory)."""


class _Worker:
    def __init__(self, memory_mb: int, start_timeout_s: float):
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(memory_mb)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1)
        self.buf = ""
        line = self.readline(time.monotonic() + start_timeout_s)
        if line != "ready":
            self.kill()
            raise MathVerifyError(f"math-verify worker did not start ({line!r}); is math-verify installed?")

    def readline(self, deadline: float) -> str | None:
        fd = self.proc.stdout.fileno()
        poller = select.poll()  # not select(): fds above 1024 are common in a trainer
        poller.register(fd, select.POLLIN)
        while "\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(max(1, int(left * 1000))):
                return None
            chunk = os.read(fd, 1 << 16).decode("utf-8", "replace")
            if not chunk:
                return ""
            self.buf += chunk
        line, self.buf = self.buf.split("\n", 1)
        return line

    def ask(self, gold: str, answer: str, timeout_s: float) -> bool:
        req = json.dumps({"gold": gold, "answer": answer, "timeout": max(1, int(timeout_s))})
        try:
            self.proc.stdin.write(req + "\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise MathVerifyError(f"math-verify worker is gone: {e}") from None
        line = self.readline(time.monotonic() + timeout_s)
        if line is None:
            raise MathVerifyTimeout(f"math-verify gave no answer within {timeout_s:g} s")
        try:
            out = json.loads(line)
        except ValueError:
            raise MathVerifyError(f"math-verify worker died ({line[:100]!r})") from None
        if "error" in out:
            raise MathVerifyError(out["error"])
        return bool(out["equal"])

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                f.close()


class MathVerifyPool:
    """Persistent math-verify workers shared by the threads of one process (thread-safe)."""

    def __init__(self, max_workers: int = 4, memory_mb: int = 4096, start_timeout_s: float = 120.0):
        self.max_workers, self.memory_mb, self.start_timeout_s = max_workers, memory_mb, start_timeout_s
        self._idle: list[_Worker] = []
        self._busy = 0
        self._cond = threading.Condition()
        self._pid = os.getpid()
        self.killed = 0
        """Workers killed at the deadline (for monitoring and tests)."""

    def equal(self, gold: str, answer: str, timeout_s: float = 5.0) -> bool:
        """Whether `answer` equals `gold` (math-verify); MathVerifyTimeout past `timeout_s`."""
        worker = self._take()
        ok = False
        try:
            result = worker.ask(gold, answer, timeout_s)
            ok = True
            return result
        except MathVerifyTimeout:
            with self._cond:
                self.killed += 1
            raise
        finally:
            self._give_back(worker, ok)

    def _take(self) -> _Worker:
        with self._cond:
            if os.getpid() != self._pid:  # a forked child: the parent's workers are not ours
                self._idle, self._busy, self._pid = [], 0, os.getpid()
            while not self._idle and self._busy >= self.max_workers:
                self._cond.wait()
            self._busy += 1
            if self._idle:
                return self._idle.pop()
        try:
            return _Worker(self.memory_mb, self.start_timeout_s)
        except BaseException:
            with self._cond:
                self._busy -= 1
                self._cond.notify()
            raise

    def _give_back(self, worker: _Worker, healthy: bool) -> None:
        if not healthy:
            worker.kill()
        with self._cond:
            self._busy -= 1
            if healthy:
                self._idle.append(worker)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_pool: MathVerifyPool | None = None
_pool_lock = threading.Lock()


def default_pool() -> MathVerifyPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = MathVerifyPool()
            atexit.register(_pool.close)
        return _pool
