"""A size-capped scratch tmpfs for a worker that is not root: mounted in a user + mount namespace of the
worker's own, held by a helper process, and reached from the worker through `/proc/<helper>/root`.

A normal user cannot mount a tmpfs on the host, and bubblewrap 0.8 has no `--size`. The owner of a user
namespace can, in a mount namespace that namespace owns. So a helper (`/bin/sh` blocked reading a pipe only
the worker holds: it exits when the worker does) is started in a new user namespace (the worker's uid mapped
to itself) and mount namespace; tmpfs mounts with `size=` and `nr_inodes=` are made there by a forked child
that joins both namespaces; bwrap is started in them too (joined before exec), so it binds the capped tmpfs;
and the worker reads and writes the same files through `/proc/<helper pid>/root/<path>` (same uid: allowed).
The host's folder under that path stays an empty directory. Writes past the cap fail with ENOSPC while the
program runs. The mounts vanish with the helper (its namespace has no other process once the runs are over).

THREAT MODEL: the helper runs no untrusted code; its namespaces hold only the scratch mounts. A sandboxed
program still runs inside bwrap's own nested user namespace with no capabilities, so the extra level gives it
nothing. Not covered: needs unprivileged user namespaces (the same requirement as bwrap itself); when they
are missing the caller falls back to checking the size after the run and says so in the notes.
"""
from __future__ import annotations

import contextlib
import os
import subprocess

from megatron_rl.envs.sandbox import _linux

CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18


def _enter_new_namespaces(uid: int, gid: int):
    def fn() -> None:  # in the forked helper before exec: plain syscalls only
        if _linux._libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
            os._exit(90)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
            os.write(fd, text.encode())
            os.close(fd)
        _linux._libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None)  # nothing propagates anywhere
    return fn


class ScratchNamespace:
    """The helper and its namespaces; `view(path)` is how the worker reaches `path` as the namespace sees it."""

    def __init__(self):
        r, self._keep = os.pipe2(os.O_CLOEXEC)
        try:
            self.proc = subprocess.Popen(["/bin/sh", "-c", "read _ ; exit 0"], stdin=r, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, cwd="/", env={"PATH": "/usr/bin:/bin"},
                                         preexec_fn=_enter_new_namespaces(os.getuid(), os.getgid()))
        finally:
            os.close(r)
        self.user_fd = self.mnt_fd = -1
        try:
            self.user_fd, self.mnt_fd = self._open_ns("user"), self._open_ns("mnt")
        except OSError:
            self.close()
            raise

    def _open_ns(self, kind: str) -> int:
        path, shell = f"/proc/{self.proc.pid}/ns/{kind}", os.path.realpath("/bin/sh")
        for _ in range(2500):  # namespaces and id maps are made before the exec: wait for the exec'd shell
            if self.proc.poll() is not None:
                raise OSError(f"user namespace helper exited ({self.proc.returncode}): unprivileged user "
                              "namespaces are not available")
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{self.proc.pid}/exe") == shell:
                    if os.readlink(path) == os.readlink(f"/proc/self/ns/{kind}"):
                        raise OSError("user namespace helper shares the worker's namespaces")
                    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.002)
        raise OSError("user namespace helper did not enter its namespaces")

    def view(self, path: str) -> str:
        return f"/proc/{self.proc.pid}/root{os.path.abspath(path)}"

    def join(self) -> None:
        """Join the helper's namespaces (in a forked child before exec: needs a single-threaded process)."""
        _linux.setns(self.user_fd, CLONE_NEWUSER)
        _linux.setns(self.mnt_fd, CLONE_NEWNS)

    def mount_tmpfs(self, target: str, size_mb: int, inodes: int, remount: bool = False) -> None:
        """`_linux.mount_tmpfs` of `target` inside the helper's mount namespace (by a forked child)."""
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self.join()
                _linux.mount_tmpfs(target, size_mb, inodes, remount=remount)
                code = 0
            except BaseException:
                pass
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise OSError(f"mount tmpfs on {target} in the worker's user namespace failed")

    def close(self) -> None:
        for fd in (self.user_fd, self.mnt_fd, self._keep):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.user_fd = self.mnt_fd = self._keep = -1
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
