"""What the in-sandbox harnesses of the test-running verifiers share (`envs.harbor.verifier`,
`envs.terminal.verifier`): the fence that ends every process the tests started before a result is read, result
files read as plain regular files, and a verdict line the candidate cannot write.

THREAT MODEL (of these pieces; each verifier states what its reward trusts as a whole)
Trusted: the worker and the harness script that starts with `FENCE` (it runs no candidate code in its own
process). Untrusted: every other process in the sandbox (the tests run candidate programs, all as one uid).
- `FENCE` makes the harness non-dumpable (no /proc/<pid>/mem, fd or environ access, no ptrace by that uid) and a
  child subreaper: every process its children start, daemons and double forks included, stays its descendant.
  `fence()` SIGKILLs every other process of the sandbox (`kill(-1)`: all share the harness's uid; only pid 1,
  bwrap, which runs nothing of theirs, is spared) and reaps them until none is left, so once it returns nothing
  can write, rename or hold a result path any more. It is called before any result is read and before the
  verdict is printed (nothing can write the sandbox's stdout after the verdict).
- A harness that was stopped (SIGSTOP) and continued notices (a SIGCONT handler) and gives no pass: the pause
  is how a process could act between the end of the tests and the fence. SIGTSTP/TTIN/TTOU are caught (they do
  not stop it).
- `read_result` opens every path component without following links, and takes only a regular file (fstat
  S_ISREG: no FIFO, device or socket) of at most `limit` bytes.
- The verdict line carries a nonce the worker wrote into the harness's spec file, which the harness reads and
  unlinks before anything else runs; it lives only in the harness's (non-dumpable) memory, so no other process
  can write a line the worker accepts (`verdict_line`).
Not covered: anything a process does while the tests still run (it shares their uid and files); a process that
wins the race between the tests' exit and the fence's kill without stopping the harness (microseconds, under the
same CPU quota as the harness); SIGKILL or other fatal signals to the harness (then there is no verdict: a fail).
"""
from __future__ import annotations

import json
import os
import secrets

FENCE = r'''
import ctypes, json, os, signal, stat, time
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
_libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of what this starts come back here
STOPPED = []
def _on_cont(*_):
    STOPPED.append(1)
signal.signal(signal.SIGCONT, _on_cont)
for _s in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
    signal.signal(_s, lambda *_: None)

def require_own_pidns(host_pidns):
    """Exit (no verdict: a fail) unless this runs in a pid namespace of its own: `fence()` kills every process it
    can signal, which outside such a sandbox (the subprocess backend, a container sharing the host's pids) would
    be every process of the worker's uid, the worker itself included."""
    try:
        mine = os.readlink("/proc/self/ns/pid")
    except OSError:
        mine = None
    if mine is None or mine == host_pidns:
        os.write(2, b"verifier: refused to run outside a sandbox with its own pid namespace (bwrap, or apptainer "
                    b"--containall): its fence kills every process it can signal\n")
        os._exit(3)

def fence(limit_s=10.0):
    """Kill every other process of this sandbox and reap them; True when none is left."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return True
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)

def _others(keep):
    """Live processes of this sandbox other than pid 1, this one and `keep` (zombies cannot act)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, os.getpid(), keep):
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            out.append(int(name))
    return out

def fence_except(keep, limit_s=10.0):
    """`fence()` sparing the (stopped) process `keep`: kill and reap every other one; True when none is left."""
    deadline = time.monotonic() + limit_s
    while True:
        others = _others(keep)
        if not others:
            return True
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in others:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)

def read_result(path, limit):
    """(text, None) of the regular file `path` (relative, no link followed), (None, None) when it is missing,
    (None, why) when it is something else or too large."""
    parts = [p for p in path.split("/") if p]
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for p in parts[:-1]:
            nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, "%s: %s" % (path, e.strerror)
    finally:
        os.close(fd)
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode):
            return None, "%s is not a regular file" % path
        if st.st_size > limit:
            return None, "%s is larger than %d bytes" % (path, limit)
        data = b""
        while len(data) <= limit:
            chunk = os.read(f, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > limit:
            return None, "%s is larger than %d bytes" % (path, limit)
        return data.decode("utf-8", "replace"), None
    finally:
        os.close(f)

def print_verdict(prefix, nonce, verdict):
    view = memoryview(("\n" + prefix + nonce + " " + json.dumps(verdict) + "\n").encode())
    while view:
        view = view[os.write(1, view):]
'''
"""Prepended to a harness script."""


def host_pidns() -> str:
    """The worker's pid namespace (`/proc/self/ns/pid`), written into a harness's spec: the harness refuses to run
    (`require_own_pidns`) where its own is the same."""
    return os.readlink("/proc/self/ns/pid")


def new_nonce() -> str:
    return secrets.token_hex(16)


def verdict_line(stdout: str, prefix: str, nonce: str) -> dict | None:
    """The harness's verdict: the last line of `stdout` that starts with `prefix` and the run's nonce."""
    tag = f"{prefix}{nonce} "
    for line in reversed(stdout.splitlines()):
        if line.startswith(tag):
            try:
                v = json.loads(line[len(tag):])
            except ValueError:
                return None
            return v if isinstance(v, dict) else None
    return None
