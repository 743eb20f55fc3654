"""Plain-subprocess backend: for TRUSTED code only (our own graders, tests of the sandbox contract).

THREAT MODEL: THIS BACKEND ISOLATES NOTHING.
Covered (resource hygiene, not security): a fresh scratch directory as the working directory, removed
after the run; RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_AS (memory) and no core dumps per process;
a wall timeout and output caps that SIGKILL the run's process group; every violation named like the other
backends (wall, cpu, memory, file_size, output).
Not covered: the program runs as the worker's own user with the worker's view of the machine. It can read
and write any file the worker can (home, /tmp, /dev/shm, checkpoints, credentials), use the network, signal
the worker and its other children, and leave daemons behind (`setsid` escapes the process-group kill).
The process-count limit is not enforced (RLIMIT_NPROC would count the worker's own processes), memory is
an address-space limit per process, and CPU time is per process. Constructing it warns loudly. Never give
it model output.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable

from megatron_rl.envs.sandbox._common import (
    apply_rlimits,
    check_collect,
    check_relpath,
    collect_files,
    decode,
    largest_file,
    pump,
    rlimits_for,
    write_files,
)
from megatron_rl.envs.sandbox.base import SANDBOXES, Limits, Sandbox, SandboxResult

log = logging.getLogger(__name__)

WARNING = ("the 'subprocess' sandbox backend isolates NOTHING: programs run as this user with full access to "
           "files, network and processes. Use it for trusted code only; use 'bwrap' for model output.")


def run_in_scratch(argv_for: Callable[[str], list[str]], files, limits: Limits, stdin: bytes | None, collect, *,
                   env: dict[str, str], scratch_env: str | None = None, notes: list[str] | None = None,
                   scratch_parent: str | None = None) -> SandboxResult:
    """Run `argv_for(scratch)` in a fresh scratch directory as a new session with rlimits, a wall timeout and
    output caps; kill its process group afterwards; remove the scratch."""
    for name in files or {}:
        check_relpath(name)
    check_collect(collect)
    scratch = tempfile.mkdtemp(prefix="megatron-rl-scratch-", dir=scratch_parent)
    try:
        try:
            write_files(scratch, files)
        except OSError as e:
            return SandboxResult(exit_code=1, stdout="", stderr=f"sandbox setup failed: {e}", wall_s=0.0,
                                 violations=["setup"], notes=list(notes or []))
        env = {**env, **({scratch_env: scratch} if scratch_env else {})}
        return _run(argv_for(scratch), scratch, files, limits, stdin, collect, env, list(notes or []))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(argv, scratch, files, limits, stdin, collect, env, notes) -> SandboxResult:
    rl = rlimits_for(limits, nproc=None, address_space=True)
    fds = [*os.pipe2(os.O_CLOEXEC), *os.pipe2(os.O_CLOEXEC), *os.pipe2(os.O_CLOEXEC)]
    in_r, in_w, out_r, out_w, err_r, err_w = fds
    try:
        proc = subprocess.Popen(argv, cwd=scratch, env=env, stdin=in_r, stdout=out_w, stderr=err_w,
                                start_new_session=True, preexec_fn=lambda: apply_rlimits(rl))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        return SandboxResult(exit_code=127, stdout="", stderr=f"cannot start {argv[0]!r}: {e}", wall_s=0.0,
                             violations=["setup"], notes=notes)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    pidfd = os.pidfd_open(proc.pid)

    def kill() -> None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)

    p = pump(stdout_fd=out_r, stderr_fd=err_r, stdin_fd=in_w, stdin_data=stdin, exit_fd=pidfd,
             deadline=time.monotonic() + limits.wall_s, cap=limits.output_bytes, kill=kill, drain_s=0.2)
    kill()  # whatever is left in the session's process group
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    os.close(pidfd)
    code = proc.returncode if not p.reason else -signal.SIGKILL
    stderr = decode(p.stderr)
    v = [p.reason] if p.reason else []
    cpu_s = ru.ru_utime + ru.ru_stime
    if code == -signal.SIGXCPU or cpu_s > limits.cpu_s:
        v.append("cpu")
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr or "std::bad_alloc" in stderr:
        v.append("memory")
    if code == -signal.SIGXFSZ or largest_file(scratch) >= limits.file_size_mb << 20:
        v.append("file_size")
    return SandboxResult(exit_code=code, stdout=decode(p.stdout), stderr=stderr, wall_s=p.wall_s, cpu_s=cpu_s,
                         violations=list(dict.fromkeys(v)), files=collect_files(scratch, collect,
                                                                               limits.file_size_mb << 20),
                         notes=notes + p.notes)


@SANDBOXES.register("subprocess")
class SubprocessSandbox(Sandbox):
    """Runs commands as plain child processes with rlimits. TRUSTED CODE ONLY; warns on construction."""

    name = "subprocess"

    def __init__(self, *, limits: Limits | None = None, env: dict[str, str] | None = None):
        log.warning(WARNING)
        warnings.warn(WARNING, RuntimeWarning, stacklevel=2)
        self.default_limits = limits or Limits()
        self.default_limits.validate()
        self._env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "LANG": "C.UTF-8",
                     **(env or {})}

    def run(self, command, files=None, limits=None, stdin=None, collect=None, sockets=None) -> SandboxResult:
        if sockets:
            raise ValueError("the subprocess backend cannot bind Unix sockets into a run (agent episodes need "
                             "them); use sandbox.backend=bwrap")
        limits = limits or self.default_limits
        limits.validate()
        argv = _argv(command)
        notes = ["subprocess backend: no isolation; pids and network not limited; memory is RLIMIT_AS"]
        return run_in_scratch(lambda scratch: argv, files, limits, stdin, collect, env=self._env, scratch_env="HOME",
                              notes=notes)


def _argv(command) -> list[str]:
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    if isinstance(command, (list, tuple)) and command and all(isinstance(c, str) for c in command):
        return list(command)
    raise ValueError(f"sandbox command must be a non-empty list of strings or a shell string, got {command!r}")
