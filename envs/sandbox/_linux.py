"""Small Linux helpers for the sandbox backends: child subreaper, tmpfs mounts, per-slot uids, pidfds.

THREAT MODEL. Covered: slot uids are unique among all processes on the node that use this module: a lease is
an flock on a per-uid file in ONE registry folder per node, `/run/megatron-rl/sandbox-uids` (root-owned, 0700;
`SandboxConfig.lease_dir` may name another), the same for every job whatever its TMPDIR (Slurm gives each job
its own), so two concurrent sandboxes - of one job or of two jobs - never share a uid and cannot signal each
other or count against each other's RLIMIT_NPROC. A crashed holder's flock is dropped by the kernel and its uid
is leased again once no process of it is left. The registry is checked before use (a real folder owned by the
worker's uid, writable by no one else) and lease files are opened without following links, so no other user
can plant links or hold leases in it. Scratch tmpfs mounts are `nosuid,nodev` with a size and inode cap;
orphaned sandbox processes are reaped through pidfds checked against the slot uid, so the worker never reaps
(and steals the exit status of) a process it does not own.
Not covered: uids are not reserved in /etc/passwd - a host account with a uid in the sandbox range (default
2,000,000-2,065,535) would share it; choose `uid_base` accordingly. Workers that point `lease_dir` at different
folders do not see each other's leases, nor do jobs that each run in a container with a private /run (bind one
host folder into every such container and name it in `lease_dir`). A worker that is not root leases no uid (its
slots all run as its own uid); `UidLease` used by such a user keeps its leases in a folder of its own under the
system's /run/lock (`/run/lock/megatron-rl-sandbox-uids-<uid>`): node-wide for that user, not across users.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import select
import socket
import stat
import struct
import threading

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_PR_SET_CHILD_SUBREAPER = 36
MS_NOSUID, MS_NODEV, MS_REMOUNT = 2, 4, 32
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8

UID_BASE = 2_000_000
UID_COUNT = 65_536


def set_child_subreaper() -> bool:
    """Make this process adopt orphaned descendants (bwrap's inner pid 1 can outlive the outer bwrap); they
    are then reaped by the backend instead of piling up as zombies under an init that may never reap."""
    return _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def mount_tmpfs(target: str, size_mb: int, inodes: int, remount: bool = False, mode: str = "0711") -> None:
    flags = MS_NOSUID | MS_NODEV | (MS_REMOUNT if remount else 0)
    data = f"size={size_mb}m,nr_inodes={inodes},mode={mode}".encode()
    if _libc.mount(b"tmpfs", target.encode(), b"tmpfs", flags, data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount tmpfs on {target}: {os.strerror(e)}")


def umount(target: str) -> None:
    """Lazily unmount `target`, never following a symlink at its last component (UMOUNT_NOFOLLOW: a planted
    link cannot make this unmount what it points to); not mounted / missing / a symlink: nothing happens."""
    if _libc.umount2(target.encode(), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):
            raise OSError(e, f"umount {target}: {os.strerror(e)}")


def remove_tree(path: str) -> list[str]:
    """Remove `path` and everything below it without recursion and without following symlinks; never raises.

    Any depth works with two open fds: each subdirectory found is renamed up into `path` itself and
    removed in its turn, so a 100,000-deep chain costs no stack and no fd per level. Directories the program
    made unreadable are opened up first (root is not needed for the sandbox's own files). Returns the
    problems (empty when `path` is gone), so a caller can retire what it could not clean."""
    problems: list[str] = []
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return problems
    except OSError as e:
        return [f"remove {path}: {e}"]
    if not _is_dir(st.st_mode):
        try:
            os.unlink(path)
        except OSError as e:
            problems.append(f"remove {path}: {e}")
        return problems
    try:
        root = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return [f"remove {path}: {e}"]
    try:
        todo, n = [None], 0  # None: the root itself; else a name directly below it
        while todo and len(problems) < 20:
            name = todo.pop()
            try:
                fd = root if name is None else _open_dir(name, root)
            except OSError as e:
                problems.append(f"open {path}/{name}: {e}")
                continue
            try:
                for entry in _entries(fd):
                    if entry[1]:
                        n += 1
                        new = f".mrl-rm-{n}"
                        _rename_up(entry[0], fd, new, root)
                        todo.append(new)
                    else:
                        os.unlink(entry[0], dir_fd=fd)
            except OSError as e:
                problems.append(f"clean {path}/{name or ''}: {e}")
            finally:
                if fd != root:
                    os.close(fd)
            if name is not None:
                try:
                    os.rmdir(name, dir_fd=root)
                except OSError as e:
                    if not problems or e.errno != errno.ENOTEMPTY:
                        problems.append(f"rmdir {path}/{name}: {e}")
    finally:
        os.close(root)
    if not problems:
        try:
            os.rmdir(path)
        except OSError as e:
            problems.append(f"rmdir {path}: {e}")
    return problems


def _is_dir(mode: int) -> bool:
    return (mode & 0o170000) == 0o040000


def _open_dir(name: str, parent: int) -> int:
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except PermissionError:  # made unreadable by its owner (us, when not root): open it up, then retry
        os.chmod(name, 0o700, dir_fd=parent, follow_symlinks=False)
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)


def _rename_up(name: str, parent: int, new: str, root: int) -> None:
    try:
        os.rename(name, new, src_dir_fd=parent, dst_dir_fd=root)
    except PermissionError:  # moving a directory needs write access to it (its `..`): open up our own first
        os.chmod(name, 0o700, dir_fd=parent, follow_symlinks=False)
        os.rename(name, new, src_dir_fd=parent, dst_dir_fd=root)


def _entries(fd: int) -> list[tuple[str, bool]]:
    """(name, is a real directory) of every entry of the directory `fd` (listed before any is changed)."""
    with os.scandir(fd) as it:  # scandir works on a duplicate of `fd`; `fd` stays open
        return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]


CLONE_NEWNET = 0x40000000
_SIOCSIFFLAGS, _IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x8914, 0x1, 0x8, 0x40


def new_netns() -> int:
    """A new network namespace with only loopback (up), as an O_CLOEXEC fd; made in a throwaway thread
    (network namespaces are per thread), so the process's own network is untouched."""
    out: list = []

    def make() -> None:
        try:
            if _libc.unshare(CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sk:
                flags = _IFF_UP | _IFF_LOOPBACK | _IFF_RUNNING
                fcntl.ioctl(sk, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags))
            out.append(os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as e:
            out.append(e)

    t = threading.Thread(target=make, name="netns")
    t.start()
    t.join()
    if isinstance(out[0], OSError):
        raise out[0]
    return out[0]


def setns(fd: int, nstype: int) -> None:
    """Join the namespace behind `fd` (in a child before exec)."""
    if _libc.setns(fd, nstype) != 0:
        raise OSError(ctypes.get_errno(), "setns")


LEASE_DIR = "/run/megatron-rl/sandbox-uids"
"""The node-wide registry of slot uid leases of root workers (`SandboxConfig.lease_dir` overrides it)."""
USER_LEASE_DIR = "/run/lock/megatron-rl-sandbox-uids-{uid}"
"""Where a user that is not root keeps its leases (the system's sticky lock folder; a folder per user)."""


class LeaseDirError(OSError):
    """The lease registry folder cannot be used safely; the message names it and the fix."""


def lease_dir(configured: str | None = None) -> str:
    """The folder of the uid lease registry, made when missing and checked: a real folder (not a link) owned by
    this uid (or root) that no other uid can write. Root: `configured` or LEASE_DIR; another user: `configured`
    or its own folder under /run/lock. Never derived from TMPDIR (Slurm gives every job its own)."""
    uid = os.geteuid()
    path = configured or (LEASE_DIR if uid == 0 else USER_LEASE_DIR.format(uid=uid))
    fix = ("remove it, or set sandbox.lease_dir to a folder of this user that no other user can write (the same "
           "path for every job on the node)")
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as e:
        raise LeaseDirError(e.errno, f"sandbox uid lease folder {path!r} cannot be made or read ({e.strerror}); "
                                     f"{fix}") from None
    _check_lease_dir(st, path)
    return path


def _check_lease_dir(st: os.stat_result, path: str) -> None:
    uid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022:
        raise LeaseDirError(errno.EPERM, f"sandbox uid lease folder {path!r} is not a folder owned by uid {uid} "
                                         f"that only its owner can write (a link, another owner, or mode "
                                         f"{stat.S_IMODE(st.st_mode):o}); remove it, or set sandbox.lease_dir to "
                                         "a folder of this user that no other user can write (the same path for "
                                         "every job on the node)")


class UidLease:
    """A uid no other process on this node holds while the lease lives: an flock on the file `<uid>` in the
    node-wide registry `lease_dir()` (the same folder for every job, whatever its TMPDIR). The kernel drops the
    flock when its holder dies, so a crashed holder's uid is free again (unless processes of that uid live)."""

    def __init__(self, base: int = UID_BASE, count: int = UID_COUNT, directory: str | None = None):
        self.dir = lease_dir(directory)
        self._fd = -1
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _check_lease_dir(os.fstat(dfd), self.dir)  # the folder in use is the one checked (no swap after lstat)
            start = (os.getpid() * 7) % count  # spread processes over the range to make collisions rare
            for i in range(count):
                uid = base + (start + i) % count
                fd = _try_lock(dfd, str(uid))
                if fd is None:
                    continue
                if _uid_has_processes(uid):  # a leftover of a crashed worker: not ours to reuse yet
                    os.close(fd)
                    continue
                self.uid, self._fd, self._dfd = uid, fd, dfd
                return
        except BaseException:
            os.close(dfd)
            raise
        os.close(dfd)
        raise RuntimeError(f"no free sandbox uid in [{base}, {base + count}) in the lease registry {self.dir}: "
                           "every uid is leased by a live sandbox on this node or runs processes; close sandboxes "
                           "or give this one another uid_base")

    def release(self) -> None:
        """Give the uid back: its file is removed while still locked (a taker checks it locked the file that is
        still in the folder), then the lock dropped."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(str(self.uid), dir_fd=self._dfd)
            os.close(self._fd)
            os.close(self._dfd)
            self._fd = -1


def _try_lock(dfd: int, name: str) -> int | None:
    """An fd holding the exclusive flock of lease file `name`, or None when another process holds it. The file
    is opened without following links, and the lock counts only if the locked file is still the one under that
    name (a releaser removes its file before unlocking)."""
    for _ in range(8):
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as e:  # a link or a file of another user planted in a shared folder: not usable
            if e.errno in (errno.ELOOP, errno.EACCES, errno.EPERM):
                return None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # removed by its releaser after we opened it: try again with the current file
    return None


def _uid_has_processes(uid: int) -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit() and process_uid(int(pid)) == uid:
            return True
    return False


def process_uid(pid: int) -> int | None:
    """Real uid of `pid` (as seen from this namespace), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def pids_of_uid(uid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and process_uid(int(p)) == uid]


def pid_namespace(pid: int) -> int | None:
    """Inode of the pid namespace of `pid` (as bwrap's `pid-namespace` reports it), None when unreadable."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def open_owned_pidfd(pid: int, uid: int) -> int | None:
    """A pidfd for `pid` if it is alive and runs as `uid` (checked while it is alive, so pid reuse cannot
    fool the check); None otherwise."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    if process_uid(pid) == uid and not exited(fd):
        return fd
    os.close(fd)
    return None


def exited(pidfd: int, timeout_s: float = 0.0) -> bool:
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(int(timeout_s * 1000)))


def reap_pidfd(pidfd: int, timeout_s: float) -> bool:
    """Wait for the process behind `pidfd` to exit and reap it if it is our child (it is when it was
    reparented to us, the subreaper). True when it exited."""
    if not exited(pidfd, timeout_s):
        return False
    try:
        os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    except ChildProcessError:  # reaped by its own parent, or not our child: nothing to do
        pass
    return True
