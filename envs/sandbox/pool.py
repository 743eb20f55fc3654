"""A pool of sandbox slots run concurrently by worker threads: `submit` / `map` / `run`.

THREAT MODEL. The pool adds no isolation of its own; each worker thread owns one backend instance (for
bubblewrap: its own uids, cgroups and scratch tmpfs), so a run can only affect its own slot, and the
isolation between concurrent runs is the backend's (see its module). Covered: a run that violates a limit,
or a backend that raises, never stops a worker thread: the error goes to that run's future and the thread
takes the next job; closing the pool closes every slot (nothing survives it).
Not covered: fairness between callers (one queue, first come first served) and back-pressure (the queue
is unbounded; callers bound their own in-flight work).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

from megatron_rl.envs.sandbox._common import check_collect
from megatron_rl.envs.sandbox.base import Limits, Sandbox, SandboxResult

log = logging.getLogger(__name__)


@dataclass
class SandboxJob:
    """One run for `SandboxPool.map`: the arguments of `Sandbox.run`."""

    command: list[str] | str
    """argv list, or a shell string run by /bin/sh -c."""
    files: dict[str, str | bytes] = field(default_factory=dict)
    """Scratch files: relative path -> content."""
    limits: Limits | None = None
    """Limits of this run; the slot's default when None."""
    stdin: bytes | None = None
    """Bytes fed to the program's standard input."""
    collect: list[str] | None = None
    """Scratch files to read back after the run."""


class SandboxPool(Sandbox):
    """N sandbox slots served by N threads from one queue. `factory(i)` builds slot i's backend."""

    name = "pool"

    @property
    def layer(self):
        """The slots' image (all slots are built by one factory)."""
        return self.slots[0].layer if self.slots else None

    def __init__(self, factory: Callable[[int], Sandbox], workers: int):
        if workers < 1:
            raise ValueError(f"SandboxPool needs workers >= 1, got {workers}")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.slots: list[Sandbox] = []
        try:
            for i in range(workers):
                self.slots.append(factory(i))
        except BaseException:
            for s in self.slots:
                s.close()
            raise
        self._closed = False
        self._zygotes: dict = {}
        self._zygote_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._serve, args=(s,), name=f"sandbox-slot-{i}", daemon=True)
                         for i, s in enumerate(self.slots)]
        for t in self._threads:
            t.start()

    @property
    def workers(self) -> int:
        return len(self.slots)

    def submit(self, command, files=None, limits=None, stdin=None, collect=None, sockets=None
               ) -> Future[SandboxResult]:
        """Queue one run; the future holds its SandboxResult (or the caller error it raised). `sockets`: as the
        slot backend's `run` (bubblewrap)."""
        if self._closed:
            raise RuntimeError("this SandboxPool is closed")
        check_collect(collect)  # a caller error: raised here, before anything runs
        fut: Future[SandboxResult] = Future()
        self._queue.put((fut, (command, files, limits, stdin, collect), {"sockets": sockets} if sockets else {}))
        return fut

    def map(self, jobs: Iterable[SandboxJob]) -> list[SandboxResult]:
        """Run every job concurrently; results in job order. A caller error in a job is raised here."""
        futs = [self.submit(j.command, j.files, j.limits, j.stdin, j.collect) for j in jobs]
        return [f.result() for f in futs]

    def run(self, command, files=None, limits=None, stdin=None, collect=None, sockets=None) -> SandboxResult:
        return self.submit(command, files, limits, stdin, collect, sockets).result()

    def zygote(self, name: str, source: str):
        """The slots' zygotes (`Sandbox.zygote`) as one `ZygoteSet`, made once per name; None when a slot's
        backend has none."""
        from megatron_rl.envs.sandbox.zygote import ZygoteSet

        with self._zygote_lock:
            if name not in self._zygotes:
                zs = [s.zygote(name, source) for s in self.slots]
                self._zygotes[name] = ZygoteSet(zs) if all(z is not None for z in zs) else None
            return self._zygotes[name]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        for s in self.slots:
            s.close()

    def _serve(self, slot: Sandbox) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(slot.run(*args, **kwargs))
            except BaseException as e:  # the worker keeps serving whatever one run did
                if not isinstance(e, (ValueError, TypeError)):
                    log.exception("sandbox slot %s failed a run; it keeps serving", slot)
                fut.set_exception(e)
