"""A pristine forking service: a long-lived sandboxed Python process that forks one child per request.

For trusted code over untrusted data (the code domain's verifier): one sandbox start and one interpreter
start serve many requests, where a sandbox per request costs both each time (about 20 ms of CPU of the
code reward's ~50, `benchmarks/sandbox_throughput.py`).

THREAT MODEL
Trusted: the worker and the service's script (`source`, compiled by the worker). Untrusted: each request's
data (a candidate's claimed results).
- The service runs in a sandbox of its own (`BwrapSandbox.serve`: the same namespaces, mounts, seccomp
  filter, per-slot uid, cgroup and rlimits as a run; a slot no run uses) started with the script only.
- The parent process never reads a request: it forks a child first, and the child reads the request from
  stdin, handles it and writes its answer into a pipe of its own; the parent relays those bytes without
  parsing them, with the child's exit status, once the child has exited. So every request is handled by
  a fresh copy of a process that has never seen request data, and one request's data cannot reach the
  next one's process state. Before handling, the child lowers its own RLIMIT_CPU and RLIMIT_AS to the
  request's limits and points fds 0 and 1 at /dev/null (the channels are the parent's again).
- The worker bounds each exchange by the request's wall limit; an exchange that is not answered in time,
  a malformed answer, an exit status other than 0 or a dead service closes the whole sandbox (its pid
  namespace dies, the slot is emptied) and the next request starts a new one, so a request that left
  bytes unread in the channel cannot be misread by the next.
- The channel is the service's own stdin/stdout pipes, held by the worker: no other sandbox can write it.
Not covered: the script's own bugs (it is trusted code); what a handler writes in the service's scratch
persists across requests (the code verifier writes nothing there).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import marshal
import os
import queue
import select
import threading
import time
from collections.abc import Callable

from megatron_rl.envs.sandbox.base import Limits

log = logging.getLogger(__name__)

_HEADER = 8
"""Bytes of a big-endian length before each request; an answer has that length, then a 4-byte status."""

LOOP = r'''
import os, resource

def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf

def _child(handle, w):
    try:
        n = int.from_bytes(_read_exact(0, 8), "big")
        cpu, mem, request = _read_exact(0, n).split(b" ", 2)
    except EOFError:
        os._exit(3)  # the worker closed the channel: the service ends
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    for res, soft, hard in ((resource.RLIMIT_CPU, int(cpu), int(cpu) + 1),
                            (resource.RLIMIT_AS, int(mem) << 20, int(mem) << 20)):
        cur = resource.getrlimit(res)[1]
        if cur != resource.RLIM_INFINITY:
            hard = min(hard, cur)
            soft = min(soft, hard)
        resource.setrlimit(res, (soft, hard))
    out = handle(request)
    view = memoryview(out)
    while view:
        view = view[os.write(w, view):]
    os._exit(0)

def serve(handle):
    """Fork a child per request (it reads the request; this process never does), relay its answer."""
    while True:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _child(handle, w)
            except BaseException:
                import traceback
                traceback.print_exc()
            os._exit(1)
        os.close(w)
        parts = []
        while True:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            parts.append(chunk)
        os.close(r)
        status = os.waitpid(pid, 0)[1]
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3:
            return
        out = b"".join(parts)
        msg = len(out).to_bytes(8, "big") + (status & 0xFFFFFFFF).to_bytes(4, "big") + out
        view = memoryview(msg)
        while view:
            view = view[os.write(1, view):]
'''
"""The fork loop, prepended to a service's script; the script ends with `serve(handle)` where `handle(bytes)
returns bytes`."""

_LOADER = ("import marshal\nwith open('zygote.pyc','rb') as f: d=f.read()\n"
           "exec(marshal.loads(d[16:]) if d[:4]==__import__('_frozen_importlib_external').MAGIC_NUMBER "
           "else compile(open('zygote.py',encoding='utf-8').read(),'zygote.py','exec'))")


def harness(source: str) -> tuple[list[str], dict[str, bytes]]:
    """argv and scratch files that run `LOOP + source` in a sandbox: the worker's bytecode when the sandbox's
    interpreter has the same magic number, else the source compiled there."""
    text = LOOP + source
    code = compile(text, "zygote.py", "exec", dont_inherit=True, optimize=0)
    pyc = importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code)
    return ["python3", "-I", "-S", "-c", _LOADER], {"zygote.py": text.encode(), "zygote.pyc": pyc}


class ZygoteError(RuntimeError):
    """A request got no answer: (reason, kind) with kind 'timeout' or 'error'."""

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.kind = kind


class Zygote:
    """The worker's end of one forking service. `call(request, limits)` -> the child's answer (bytes);
    raises ZygoteError when there is none (the service is then closed, the next call starts a new one).
    `sandbox_factory()` builds the dedicated sandbox (a `BwrapSandbox(prespawn=False)`); the service's own
    limits are the first call's (memory and pids for the whole service, CPU seconds for its lifetime);
    a call with other memory, pids, scratch or network limits restarts it with those."""

    def __init__(self, sandbox_factory: Callable[[], object], source: str):
        self._factory = sandbox_factory
        self._argv, self._files = harness(source)
        self._lock = threading.Lock()
        self._sandbox = None
        self._service = None
        self._key: tuple | None = None
        self.starts = 0
        """Services started (1 while every call is answered)."""
        self.calls = 0
        self._cpu_done = 0.0
        self._pid = os.getpid()

    def call(self, request: bytes, limits: Limits) -> bytes:
        with self._lock:
            self._ensure(limits)
            deadline = time.monotonic() + limits.wall_s
            msg = f"{max(1, int(limits.cpu_s + 0.999))} {limits.memory_mb} ".encode() + request
            try:
                self._write(len(msg).to_bytes(_HEADER, "big") + msg, deadline)
                status, out = self._read_answer(deadline)
            except ZygoteError:
                self._stop()
                raise
            self.calls += 1
            if status != 0:
                self._stop()
                raise ZygoteError(f"verifier child ended with status {status:#x}", "error")
            return out

    def cpu_s(self) -> float:
        """CPU seconds its services have used (ended ones as last seen), for benchmarks: the worker does not
        reap these processes per call, so its RUSAGE_CHILDREN does not count them."""
        return self._cpu_done + (self._service.cpu_s() if self._service is not None else 0.0)

    def close(self) -> None:
        with self._lock:
            self._stop()
            if self._sandbox is not None:
                self._sandbox.close()
                self._sandbox = None

    # ---------------------------------------------------------------------------------------- internals
    def _ensure(self, limits: Limits) -> None:
        if os.getpid() != self._pid:  # a forked copy of the worker: the service and its pipes are the parent's
            self._sandbox = self._service = None
            self._pid = os.getpid()
        key = (limits.memory_mb, limits.pids, limits.scratch_mb, limits.network, limits.cpus, limits.open_files)
        if self._service is not None and (key != self._key or not self._service.alive()):
            self._stop()
        if self._service is not None:
            return
        if self._sandbox is None:
            self._sandbox = self._factory()
        own = Limits(wall_s=limits.wall_s, cpu_s=3600.0, memory_mb=limits.memory_mb + 64, pids=limits.pids,
                     file_size_mb=limits.file_size_mb, scratch_mb=limits.scratch_mb, network=limits.network,
                     cpus=limits.cpus, open_files=limits.open_files)
        self._service = self._sandbox.serve(self._argv, files=self._files, limits=own)
        self._key = key
        self.starts += 1

    def _stop(self) -> None:
        if self._service is not None:
            self._cpu_done += self._service.cpu_s()
            with contextlib.suppress(OSError):
                os.close(self._service.stdin_w)  # the child waiting for a request exits on EOF
            for p in self._service.close():
                log.warning("verifier zygote cleanup: %s", p)
            self._service = None

    def _wait(self, fd: int, event: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        poller = select.poll()
        poller.register(fd, event)
        poller.register(self._service.pidfd, select.POLLIN)
        ready = dict(poller.poll(max(0, int(left * 1000)))) if left > 0 else {}
        self._service.drain_stderr()
        if fd in ready:
            return
        if self._service.pidfd in ready:
            raise ZygoteError(f"verifier service exited: {self._service.stderr[-300:].decode(errors='replace')}",
                              "error")
        raise ZygoteError("verifier timed out (wall)", "timeout")

    def _write(self, data: bytes, deadline: float) -> None:
        fd, view = self._service.stdin_w, memoryview(data)
        os.set_blocking(fd, False)
        while view:
            self._wait(fd, select.POLLOUT, deadline)
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except OSError as e:
                raise ZygoteError(f"verifier service gone: {e}", "error") from None

    def _read(self, n: int, deadline: float) -> bytes:
        fd, buf = self._service.stdout_r, bytearray()
        os.set_blocking(fd, False)
        while len(buf) < n:
            self._wait(fd, select.POLLIN, deadline)
            try:
                chunk = os.read(fd, n - len(buf))
            except BlockingIOError:
                continue
            if not chunk:
                raise ZygoteError("verifier service closed its channel", "error")
            buf += chunk
        return bytes(buf)

    def _read_answer(self, deadline: float) -> tuple[int, bytes]:
        head = self._read(_HEADER + 4, deadline)
        n, status = int.from_bytes(head[:_HEADER], "big"), int.from_bytes(head[_HEADER:], "big")
        if n > 64 << 20:
            raise ZygoteError(f"verifier answer of {n} bytes", "error")
        return status, self._read(n, deadline)


class ZygoteSet:
    """The zygotes of a pool's slots served as one (`SandboxPool.zygote`): a call takes a free one, waiting
    while every one is busy, so concurrent verdicts run side by side as the pool's runs do."""

    def __init__(self, zygotes: list[Zygote]):
        self.zygotes = zygotes
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for z in zygotes:
            self._free.put(z)

    def call(self, request: bytes, limits: Limits) -> bytes:
        z = self._free.get()
        try:
            return z.call(request, limits)
        finally:
            self._free.put(z)

    def cpu_s(self) -> float:
        return sum(z.cpu_s() for z in self.zygotes)
