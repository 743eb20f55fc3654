"""Shared machinery of the sandbox backends: files in and out of scratch, rlimits, the output pump.

THREAT MODEL. Not a boundary by itself; it gives the backends these guarantees:
- Covered: caller file names cannot leave the scratch directory (absolute paths and `..` are refused, for
  `collect` names before the program runs: `check_collect`);
  collected files are opened without following symlinks at any path component, FIFOs and devices are
  skipped, and each file is capped in size, so a program cannot make the worker read host files, block,
  or exhaust its memory through `collect`; output is read incrementally and capped (a flood is killed at
  the cap, never buffered); the wall deadline always ends the pump, even when the program never writes,
  never exits, or leaves a descendant holding the pipes open.
- Not covered: isolation of any kind (namespaces, cgroups, uids) - that is the backend's job.
"""
from __future__ import annotations

import math
import os
import resource
import select
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_rl.envs.sandbox.base import Limits

_READ_CHUNK = 1 << 16


# ------------------------------------------------------------------------------------------ paths
def check_relpath(path: str) -> list[str]:
    """Split a caller-given relative path into safe components; ValueError naming the path otherwise."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"sandbox file name {path!r} must be a non-empty relative path without NUL bytes")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if path.startswith("/") or not parts or ".." in parts:
        raise ValueError(f"sandbox file name {path!r} must be a relative path inside scratch (no '/', no '..')")
    return parts


def check_collect(collect) -> None:
    """Validate a run's `collect` names BEFORE the program runs (a bad name must not cost a run, nor leave a
    run's leftovers behind an error): a list of relative paths inside scratch; ValueError naming the entry."""
    if collect is None:
        return
    if isinstance(collect, (str, bytes)) or not isinstance(collect, (list, tuple)):
        raise ValueError(f"sandbox collect must be a list of relative file names, got {collect!r}")
    for name in collect:
        try:
            check_relpath(name)
        except ValueError as e:
            raise ValueError(f"sandbox collect entry {name!r}: {e}") from None


def _open_dir_nofollow(root_fd: int, parts: list[str], create: bool, uid: int | None) -> int:
    """Open the directory `parts` below `root_fd` without following symlinks; returns a new fd."""
    fd = os.dup(root_fd)
    try:
        for name in parts:
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                    if uid is not None:
                        os.chown(name, uid, uid, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_files(root: str, files: dict[str, str | bytes] | None, uid: int | None = None) -> None:
    """Write `files` below `root` (which the program has not touched yet), owned by `uid` when given.
    ValueError for a bad name; OSError (e.g. ENOSPC) when scratch cannot hold them."""
    if not files:
        return
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, content in files.items():
            parts = check_relpath(name)
            data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
            dfd = _open_dir_nofollow(root_fd, parts[:-1], create=True, uid=uid)
            try:
                fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    if uid is not None:
                        os.fchown(fd, uid, uid)
                finally:
                    os.close(fd)
            finally:
                os.close(dfd)
    finally:
        os.close(root_fd)


def read_file_safely(root: str, name: str, max_bytes: int) -> bytes | None:
    """Read scratch file `name` without following symlinks; None if missing, not a regular file, or larger
    than `max_bytes`. Raises ValueError for a bad name."""
    parts = check_relpath(name)
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        dfd = _open_dir_nofollow(root_fd, parts[:-1], create=False, uid=None)
    except OSError:
        os.close(root_fd)
        return None
    try:
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
        os.close(root_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
            return None
        chunks, total = [], 0
        while True:
            b = os.read(fd, _READ_CHUNK)
            if not b:
                return b"".join(chunks)
            total += len(b)
            if total > max_bytes:
                return None
            chunks.append(b)
    finally:
        os.close(fd)


def collect_files(root: str, names: list[str] | None, max_bytes: int) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name in names or ():
        data = read_file_safely(root, name, max_bytes)
        if data is not None:
            out[name] = data
    return out


def _file_sizes(root: str, max_entries: int):
    """Sizes of the regular files below `root`, walked without recursion or following symlinks (at most
    `max_entries` directory entries are looked at)."""
    seen, stack = 0, [root]
    while stack and seen < max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    seen += 1
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        yield e.stat(follow_symlinks=False).st_size
        except OSError:
            continue


def largest_file(root: str, max_entries: int = 100_000) -> int:
    """Size of the largest regular file below `root` (no symlinks followed; stops after `max_entries`)."""
    return max(_file_sizes(root, max_entries), default=0)


def tree_bytes(root: str, max_entries: int = 100_000) -> int:
    """Bytes of the regular files below `root`, walked without recursion or following symlinks."""
    return sum(_file_sizes(root, max_entries))


def rlimits_for(limits: Limits, *, nproc: int | None, address_space: bool) -> tuple[tuple[int, int, int], ...]:
    """(resource, soft, hard) triples for a run: CPU (SIGXCPU at the soft limit, SIGKILL one second later),
    FSIZE, NOFILE, CORE=0, optionally NPROC and AS (the memory fallback when no memory cgroup exists)."""
    cpu = max(1, math.ceil(limits.cpu_s))
    fsize = limits.file_size_mb << 20
    out = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_FSIZE, fsize, fsize),
           (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files), (resource.RLIMIT_CORE, 0, 0)]
    if nproc is not None:
        out.append((resource.RLIMIT_NPROC, nproc, nproc))
    if address_space:
        out.append((resource.RLIMIT_AS, limits.memory_mb << 20, limits.memory_mb << 20))
    return tuple(out)


def apply_rlimits(rlimits: tuple[tuple[int, int, int], ...]) -> None:
    """In a child before exec: lower the limits (never raise them above the current hard limit)."""
    for res, soft, hard in rlimits:
        cur_soft, cur_hard = resource.getrlimit(res)
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        resource.setrlimit(res, (soft, hard))


# ------------------------------------------------------------------------------------------- pump
@dataclass
class Pumped:
    """What the pump saw."""

    stdout: bytes = b""
    stderr: bytes = b""
    status: bytes = b""
    reason: str | None = None
    """Why the pump killed the run: 'wall', 'output' or 'cpu'; None when it ended by itself."""
    exited: bool = False
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class _Stream:
    def __init__(self, fd: int, cap: int | None):
        self.fd, self.cap, self.chunks, self.size = fd, cap, [], 0

    def take(self, data: bytes) -> bool:
        """Keep data up to the cap; True when the cap was exceeded."""
        room = self.cap - self.size if self.cap is not None else len(data)
        if room > 0:
            self.chunks.append(data[:room])
        self.size += len(data)
        return self.cap is not None and self.size > self.cap


def pump(
    *,
    stdout_fd: int,
    stderr_fd: int,
    stdin_fd: int | None,
    stdin_data: bytes | None,
    exit_fd: int,
    deadline: float,
    cap: int,
    kill: Callable[[], None],
    status_fd: int | None = None,
    on_status: Callable[[bytes], None] | None = None,
    on_tick: Callable[[], str | None] | None = None,
    tick_s: float = 0.1,
    drain_s: float = 1.0,
) -> Pumped:
    """Feed stdin, read stdout/stderr (capped) and a status pipe until the process behind `exit_fd` (a pidfd)
    exits and the pipes are drained. Calls `kill()` on a wall timeout, an output flood or when `on_tick`
    returns a reason. Closes every fd it was given."""
    p = _Pump(stdout_fd, stderr_fd, stdin_fd, stdin_data, exit_fd, cap, kill, status_fd, on_status, drain_s)
    try:
        p.loop(deadline, on_tick, tick_s)
    finally:
        p.close()
    return p.res


class _Pump:
    def __init__(self, stdout_fd, stderr_fd, stdin_fd, stdin_data, exit_fd, cap, kill, status_fd, on_status,
                 drain_s):
        self.t0 = time.monotonic()
        self.res, self.kill, self.on_status, self.drain_s = Pumped(), kill, on_status, drain_s
        self.out, self.err = _Stream(stdout_fd, cap), _Stream(stderr_fd, cap)
        self.stat = _Stream(status_fd, 1 << 16) if status_fd is not None else None
        self.streams = {s.fd: s for s in (self.out, self.err, self.stat) if s is not None}
        self.exit_fd, self.stdin_fd = exit_fd, stdin_fd
        self.poller = select.poll()
        for fd in self.streams:
            os.set_blocking(fd, False)
            self.poller.register(fd, select.POLLIN)
        self.poller.register(exit_fd, select.POLLIN)
        self.pending = memoryview(stdin_data or b"")
        if stdin_fd is not None and self.pending:
            os.set_blocking(stdin_fd, False)
            self.poller.register(stdin_fd, select.POLLOUT)
        elif stdin_fd is not None:
            self._close_stdin(registered=False)
        self.end_by = math.inf  # after exit or kill: stop waiting for pipe EOF at this time

    def stop(self, reason: str) -> None:
        if self.res.reason is None:
            self.res.reason = reason
            self.kill()
            self.end_by = min(self.end_by, time.monotonic() + self.drain_s + 5.0)

    def loop(self, deadline: float, on_tick, tick_s: float) -> None:
        next_tick = self.t0 + tick_s if on_tick is not None else math.inf
        while self.streams or not self.res.exited:
            now = time.monotonic()
            if now >= self.end_by:
                if not self.res.exited:
                    self.res.notes.append("the process did not exit within 5 s of SIGKILL")
                return
            if self.res.reason is None and now >= deadline:
                self.stop("wall")
                continue
            if self.res.reason is None and now >= next_tick:
                next_tick = now + tick_s
                why = on_tick()
                if why:
                    self.stop(why)
                    continue
            limit = self.end_by if self.res.reason is not None else min(deadline, next_tick, self.end_by)
            for fd, _ev in self.poller.poll(max(0, math.ceil((limit - now) * 1000))):
                self._event(fd)

    def _event(self, fd: int) -> None:
        if fd == self.exit_fd:
            self.res.exited = True
            self.poller.unregister(fd)
            self.end_by = min(self.end_by, time.monotonic() + self.drain_s)
        elif fd == self.stdin_fd:
            try:
                self.pending = self.pending[os.write(fd, self.pending[:_READ_CHUNK]):]
            except OSError:  # the program closed stdin or exited
                self.pending = memoryview(b"")
            if not self.pending:
                self._close_stdin(registered=True)
        elif fd in self.streams:
            self._read(fd)

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.poller.unregister(fd)
            os.close(fd)
            del self.streams[fd]
            return
        over = self.streams[fd].take(data)
        if self.stat is not None and fd == self.stat.fd:
            if self.on_status is not None:
                self.on_status(data)
        elif over:
            self.stop("output")

    def _close_stdin(self, registered: bool) -> None:
        if registered:
            self.poller.unregister(self.stdin_fd)
        os.close(self.stdin_fd)
        self.stdin_fd = None

    def close(self) -> None:
        self.res.wall_s = time.monotonic() - self.t0
        for fd in self.streams:
            os.close(fd)
        self.streams = {}
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None
        self.res.stdout, self.res.stderr = b"".join(self.out.chunks), b"".join(self.err.chunks)
        self.res.status = b"".join(self.stat.chunks) if self.stat is not None else b""


def decode(data: bytes) -> str:
    """Untrusted bytes to text: UTF-8 with replacement characters, never an exception."""
    return data.decode("utf-8", "replace")


def exit_code_from_status(status: int) -> int:
    """A shell-style status (128+N for signal N, as bwrap and shells report) to the contract's convention:
    negative signal numbers for deaths by signal. An exit(137) by the program itself reads as SIGKILL."""
    if 128 < status < 128 + 65:
        return -(status - 128)
    return status
