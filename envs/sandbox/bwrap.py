"""Bubblewrap backend (default): untrusted programs in fresh namespaces, as a per-slot uid, under cgroups.

THREAT MODEL
Assumes: an untrusted program (model output) and its files; a Linux host with unprivileged user namespaces
and bubblewrap >= 0.8 (Debian `bubblewrap`); the worker runs as root (for per-slot uids and cgroups; without
root it degrades and says so in every result's `notes`).
Covered, per run:
- Filesystem: a fresh root (bwrap tmpfs, remounted read-only) holding only /usr (read-only) with its /bin,
  /lib symlinks and /etc: a private copy, taken when the sandbox is built, of a whitelist of host /etc
  entries (loader cache, alternatives, timezone, python/perl/java config; never the host's passwd, shadow
  or ssh; TLS and resolver config only with `network=True`), with a generated passwd naming one `sandbox`
  user - or a domain-provided root directory mounted read-only. A domain's image (`envs.sandbox.image`) is
  mounted read-only over /usr/local (hiding the host's) and /opt; it comes from the node's image cache, which
  only the worker's uid can write. The only writable places are /work (scratch), /tmp and /dev/shm, all
  three directories on the slot's own tmpfs (capped at `scratch_mb` together, `nosuid`, `nodev`,
  inode-capped), emptied after the run. Host /root, /home, /tmp, /dev/shm, /run, /sys, /var, /opt are not
  mounted (an image's /opt is). Collected files are
  read without following symlinks.
- Cleanup cannot be poisoned: scratch is removed without recursion and without following links (any depth:
  subdirectories are renamed up and removed one by one); a slot that cannot be emptied for any reason is
  retired (closed; its directory and uid are never used again) and replaced by a fresh slot, so nothing a
  run leaves can reach a later run. A slot is marked used before anything is written into it, so a run that
  ends in an error (a caller's bad request, a worker bug) is emptied before the slot's next run too; `collect`
  names are checked before the program starts. The sweep of folders left by dead workers touches only real
  directories owned by this uid, finds mounts without following links and unmounts with UMOUNT_NOFOLLOW.
- Network: a network namespace of the slot's own with only loopback (created once per slot and reused by
  its runs, one at a time; the program has no capability over it, and no socket outlives its processes;
  a fresh one per run via `--unshare-net` where it cannot be created): host ports, host abstract unix
  sockets, other slots and the internet are unreachable. `Limits.network=True` shares the host network
  (trusted domains only). The one way out a caller can add is a Unix socket it listens on (`run(...,
  sockets={name: bind})`, e.g. a black-box agent's gateway): bound at /.sandbox/<name> for that run only
  (the read-only control folder: the program can connect to it, not replace or remove it) and unlinked after;
  what it answers is the caller's responsibility (`envs.agents.session`).
- Processes: new pid, ipc, uts, user and cgroup namespaces; `--die-with-parent`; `--new-session` (no
  TIOCSTI into the worker's terminal); no capabilities; `--disable-userns` (no nested user namespaces);
  the program runs as uid 1000 inside, mapped to a host uid of its own slot, so concurrent sandboxes
  cannot signal each other even outside their pid namespaces (of one job or of different jobs on the node:
  slot uids are leased in a node-wide registry, not under the job's TMPDIR; `envs.sandbox._linux`). When
  the run ends its pid namespace dies, killing every descendant, `setsid` daemons included; the slot cgroup is
  then checked empty (and SIGKILLed until it is) and orphans are reaped (the worker is a child subreaper).
- Resources: cgroup v1 memory+swap, pids and CPU quota for the whole process tree (when the hierarchies
  are writable, else the same in a delegated cgroup v2 subtree; else RLIMIT_AS / RLIMIT_NPROC, noted in the
  result - for a worker that is not root the
  RLIMIT_NPROC is set by the trampoline inside the run's own user namespace, where it counts only that run's
  processes); RLIMIT_CPU/FSIZE/NOFILE/CORE per
  process; total CPU time of the tree polled from cpuacct; wall timeout; stdout/stderr capped (the run is
  killed at the cap). Scratch files live in RAM and count toward the memory limit. Violations are named:
  wall, cpu, memory, pids, file_size, output, setup.
- System calls: a seccomp filter (`envs.sandbox._seccomp`, list and reasons there) refuses keyrings,
  ptrace and process_vm_*, mount-family and namespace calls, bpf, perf_event_open, userfaultfd, io_uring,
  module/kexec/reboot and other host administration with EPERM; other architectures' call tables are killed.
Not covered:
- Kernel attack surface beyond that filter: a kernel exploit reachable through ordinary syscalls (in a user
  namespace) escapes. Use a VM/gVisor boundary for adversarial red-teaming.
- /proc inside shows host-wide information (CPU, memory, uptime, kernel version, and pid 1's command
  line with the host scratch path); /usr is readable (installed software is visible, as it is meant to
  be used).
- Side channels (timing, cache), CPU frequency and memory bandwidth contention between slots.
- I/O bandwidth is not limited. Without cgroups, the memory limit is a per-process rlimit (RLIMIT_AS) and a
  program can exceed it in aggregate with many processes. A worker that is not root gets its size-capped
  scratch tmpfs in a user + mount namespace of its own (`envs.sandbox._userns_scratch`; bwrap joins it), so
  writes past the cap fail during the run as for root; only where user namespaces are unavailable is scratch
  a host directory whose size is checked after the run (said in the notes). Its processes are told apart
  from the worker's own (same uid) by their pid namespace. cgroup v2: a delegated subtree is used where v1 is
  not writable (`envs.sandbox._cgroup2`).
- With prespawn (default) the next run's sandbox is set up (namespaces, mounts, seccomp, and /bin/sh
  started in it, blocked reading the slot's `go` FIFO; no untrusted code yet) while the current one runs,
  in a second slot with its own uid, cgroups and tmpfs; it is used only if the next run asks for the same
  rlimits and network setting, else discarded and the run starts cold. The FIFO (`/.sandbox/go`, mode
  0444 on a read-only mount) is written by the worker only; the command itself is the file `/.sandbox/cmd`
  next to it, written before the go.
- `serve()` (used by `zygote()`: the code verifier's forking service, `envs.sandbox.zygote`) runs one
  long-lived process with the same isolation in a one-slot sandbox that runs nothing else; `run` is refused
  while it lives, and closing it (or the sandbox) kills its pid namespace and empties the slot.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import errno
import glob
import json
import logging
import os
import re
import resource
import select
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field

from megatron_rl.envs.sandbox import _linux, _seccomp
from megatron_rl.envs.sandbox._cgroup import remove_stale_groups
from megatron_rl.envs.sandbox._cgroup2 import create_slot_groups
from megatron_rl.envs.sandbox._common import (
    apply_rlimits,
    check_collect,
    check_relpath,
    collect_files,
    decode,
    exit_code_from_status,
    largest_file,
    pump,
    rlimits_for,
    tree_bytes,
    write_files,
)
from megatron_rl.envs.sandbox._userns_scratch import ScratchNamespace
from megatron_rl.envs.sandbox.base import SANDBOXES, Limits, Sandbox, SandboxResult, SandboxUnavailable
from megatron_rl.envs.sandbox.image_cache import ImageLayer

log = logging.getLogger(__name__)

INNER_UID = 1000
_ETC = ("alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "nsswitch.conf",
        "protocols", "services", "mime.types", "os-release", "debian_version", "inputrc", "terminfo",
        "locale.alias", "magic", "magic.mime")
_ETC_GLOBS = ("python3*", "java-*", "perl")
_ETC_NET = ("resolv.conf", "ssl", "ca-certificates", "ca-certificates.conf", "host.conf", "gai.conf")
_SKIP_ROOT = {"proc", "dev", "sys", "tmp", "work", ".sandbox", "run", "boot", "home", "media", "mnt", "root", "srv",
              "lost+found"}
_TRAMPOLINE = "read -r _ < /.sandbox/go && . /.sandbox/cmd"
"""The prespawned sandbox's shell: started (namespaces, mounts, seccomp, exec of /bin/sh all done) before
the run is known, it blocks on the slot's `go` FIFO; the worker writes the command to `cmd`, then one line to
`go`. Keeps bwrap's exec and the shell's start-up off the run's critical path."""
_SCRATCH_INODES = 16384
_BWRAP_TASKS = 2  # outer bwrap + its pid 1 in the sandbox's pid namespace
_PREFIX = "megatron-rl-sandbox-"
_stale_lock = threading.Lock()
_stale_done = False


@dataclass
class _Launch:
    """A started bwrap, blocked until `block_w` is written: before exec (bwrap's `--block-fd` pipe, closed after
    the go) or, with a shell, in the trampoline (then `block_w` is the slot's `go` FIFO, which the slot holds
    open: a line written before the shell opened the FIFO is not lost)."""

    cell: _Cell
    proc: subprocess.Popen
    pidfd: int
    block_w: int
    stdin_w: int
    stdout_r: int
    stderr_r: int
    status_r: int
    key: tuple
    go_fifo: bool = False
    status: dict = field(default_factory=dict)
    pid1fd: int | None = None
    _buf: bytes = b""

    def feed_status(self, data: bytes) -> None:
        """Parse bwrap's JSON status documents (one per line) as they arrive."""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            self.status.update(doc)
            if "pid-namespace" in doc:
                self.cell.pidns.add(int(doc["pid-namespace"]))
            if "child-pid" in doc and self.pid1fd is None:
                self.pid1fd = _linux.open_owned_pidfd(int(doc["child-pid"]), self.cell.uid)

    def kill(self) -> None:
        if self.pid1fd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pid1fd, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close_fds(self) -> None:
        for fd in (self.pidfd, -1 if self.go_fifo else self.block_w, self.stdin_w, self.stdout_r, self.stderr_r,
                   self.status_r, self.pid1fd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.pidfd = self.block_w = self.stdin_w = self.stdout_r = self.stderr_r = self.status_r = -1
        self.pid1fd = None


class Service:
    """A long-lived process started by `BwrapSandbox.serve`: write requests to `stdin_w`, read answers from
    `stdout_r` (both raw fds, owned here); its stderr is kept (last 8 KiB) as `drain_stderr` reads it.
    `close()` kills it, its whole pid namespace with it, and empties the slot."""

    def __init__(self, launch: _Launch, owner: BwrapSandbox):
        self._launch, self._owner = launch, owner
        self.stdin_w, self.stdout_r, self.pidfd = launch.stdin_w, launch.stdout_r, launch.pidfd
        self.stderr = b""
        os.set_blocking(launch.stderr_r, False)

    def drain_stderr(self) -> None:
        if self._launch is None:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            while chunk := os.read(self._launch.stderr_r, 1 << 16):
                self.stderr = (self.stderr + chunk)[-8192:]

    def alive(self) -> bool:
        return self._launch is not None and self._launch.proc.poll() is None

    def cpu_s(self) -> float:
        """CPU seconds used so far by its processes (bwrap's included) and the children they reaped, from
        /proc: they are not the worker's reaped children until the service ends, so RUSAGE_CHILDREN misses
        them (benchmarks add this)."""
        if not self.alive():
            return 0.0
        todo, total = [self._launch.proc.pid], 0
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime, in clock ticks
                todo += _children(pid)
        return total / os.sysconf("SC_CLK_TCK")

    def close(self) -> list[str]:
        """Kill and reap it; returns cleanup problems (idempotent)."""
        self.drain_stderr()
        launch, self._launch = self._launch, None
        return self._owner._end_service(launch) if launch is not None else []


class _Cell:
    """One slot: a uid of its own, cgroups, a scratch tmpfs with /work and /tmp; one run at a time."""

    def __init__(self, base: str, index: int | str, group: str, uid_base: int, scratch_mb: int,
                 lease_dir: str | None = None):
        self.root = os.geteuid() == 0
        self.index, self.group, self.uid_base, self.lease_dir = index, group, uid_base, lease_dir
        self.notes: list[str] = []
        self.pidns: set[int] = set()  # of its runs whose pid 1 is not known to be gone, for processes()
        self.lease = _linux.UidLease(uid_base, directory=lease_dir) if self.root else None
        self.uid = self.lease.uid if self.lease else os.getuid()
        self.gid = self.uid if self.lease else os.getgid()
        self.dir = os.path.join(base, f"cell{index}")
        self.real_fs = os.path.join(self.dir, "fs")  # as bwrap sees it; self.fs as the worker reaches it
        for d in (self.dir, self.real_fs, os.path.join(self.dir, "ctl")):
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o711 if not d.endswith("ctl") else 0o755)
        self.ns = None if self.root else _scratch_namespace(self.notes)
        self.fs = self.ns.view(self.real_fs) if self.ns else self.real_fs
        self.work, self.tmp, self.shm, self.ctl = (os.path.join(self.fs, "work"), os.path.join(self.fs, "tmp"),
                                                   os.path.join(self.fs, "shm"), os.path.join(self.dir, "ctl"))
        self.go = os.path.join(self.ctl, "go")
        os.mkfifo(self.go, 0o600)
        self.go_fd = os.open(self.go, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)  # never blocks, keeps it alive
        os.chmod(self.go, 0o444)  # then read-only for everyone, the sandbox's uid too (and on a read-only mount)
        self.scratch_mb = 0
        self.tmpfs = self.root or self.ns is not None
        try:  # one network namespace per slot, made once: creating one per run costs more than the rest
            self.netns: int | None = _linux.new_netns()
        except OSError:
            self.netns = None  # each run gets a fresh one from bwrap (--unshare-net)
        if not self.root:
            scratch = ("scratch a size-capped tmpfs in a user namespace of the worker's own" if self.ns else
                       "scratch size checked after the run only")
            self.notes.append(f"not root: one uid for all slots, {scratch}, process limit set inside the sandbox's "
                              "user namespace (RLIMIT_NPROC)")
        self.cg, cg_notes = create_slot_groups(group, f"cell{index}-uid{self.uid}")
        if self.cg is None:
            self.notes.append("no writable cgroup (v1, or a delegated v2 subtree) with memory/pids: memory and pid "
                              "limits are per-process rlimits (" + "; ".join(cg_notes) + ")")
        else:
            self.notes += [n for n in cg_notes if "cpu" in n or "memory" in n or "pids" in n]
            self.cg.set_limits(Limits(), _BWRAP_TASKS)
        self.mount(scratch_mb)  # before any bwrap binds /work: later size changes are remounts
        problems = self.fresh_dirs()
        if problems:
            self.close()
            raise OSError(f"sandbox slot {self.dir} could not be prepared: {'; '.join(problems[:3])}")

    def mount(self, scratch_mb: int) -> None:
        """Size the scratch tmpfs (mount once, remount when the size changes)."""
        if not self.tmpfs or scratch_mb == self.scratch_mb:
            return
        try:
            if self.ns is not None:
                self.ns.mount_tmpfs(self.real_fs, scratch_mb, _SCRATCH_INODES, remount=self.scratch_mb > 0)
            else:
                _linux.mount_tmpfs(self.fs, scratch_mb, _SCRATCH_INODES, remount=self.scratch_mb > 0)
        except OSError as e:
            self.tmpfs = False
            self.notes.append(f"scratch is a plain directory (size checked after the run only): {e}")
            return
        os.chmod(self.fs, 0o711)
        self.scratch_mb = scratch_mb

    def fresh_dirs(self) -> list[str]:
        """Empty /work, /tmp and /dev/shm (removed without recursion or following links, then recreated: the
        program may have changed their modes); returns what could not be done (then retire the slot)."""
        self.dirty = False
        for d in (self.work, self.tmp, self.shm):
            problems = _linux.remove_tree(d)
            if problems:
                return problems
            mode = 0o700 if d == self.work else 0o1777
            os.mkdir(d, mode)
            os.chmod(d, mode)
            if self.root:
                os.chown(d, self.uid, self.gid)
        return []

    def scratch_full(self, scratch_mb: int) -> bool:
        if self.tmpfs:
            st = os.statvfs(self.fs)
            return st.f_bavail == 0 or st.f_favail == 0
        return sum(tree_bytes(d) for d in (self.work, self.tmp, self.shm)) > scratch_mb << 20

    def preexec(self, rlimits, network: bool):
        attach = self.cg.attach_files if self.cg else ()
        uid, gid, drop = self.uid, self.gid, self.root
        netns = self.netns if not network else None
        ns = self.ns

        def fn() -> None:  # runs in the forked child before exec: keep it to plain syscalls
            for path in attach:
                fd = os.open(path, os.O_WRONLY)
                os.write(fd, b"0")
                os.close(fd)
            if netns is not None:
                _linux.setns(netns, _linux.CLONE_NEWNET)
            if ns is not None:  # bwrap binds the scratch tmpfs of the worker's own mount namespace
                ns.join()
            apply_rlimits(rlimits)
            if drop:
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
        return fn

    def chain(self, rlimits, network: bool) -> tuple[list[str], tuple[int, ...]] | None:
        """What `preexec` does, as a chain of small programs exec'd before bwrap (argv prefix, fds to pass):
        a shell joins the slot's cgroups, nsenter the slot's network namespace (or, not root, the scratch
        namespace), prlimit sets the rlimits, setpriv drops to the slot's uid. The worker then spawns without
        forking itself (vfork): a fork copies the page tables of the whole worker, ~95 ms of CPU per start at
        2 GB of resident memory. None when a tool is missing (then `preexec`)."""
        tools = _chain_tools()
        if tools is None:
            return None
        out: list[str] = []
        if self.cg is not None and self.cg.attach_files:
            out += [tools["sh"], "-c", " && ".join(f"printf 0 > {shlex.quote(f)}" for f in self.cg.attach_files)
                    + ' && exec "$@"', "sh"]
        fds: tuple[int, ...] = ()
        netns = self.netns if not network else None
        if netns is not None or self.ns is not None:
            out.append(tools["nsenter"])
            if netns is not None:
                out.append(f"--net=/proc/self/fd/{netns}")
                fds += (netns,)
            if self.ns is not None:  # bwrap binds the scratch tmpfs of the worker's own mount namespace
                out += [f"--user=/proc/self/fd/{self.ns.user_fd}", f"--mount=/proc/self/fd/{self.ns.mnt_fd}",
                        "--preserve-credentials"]
                fds += (self.ns.user_fd, self.ns.mnt_fd)
            out.append("--")
        out += [tools["prlimit"], *(f"--{_PRLIMIT[res]}={soft}:{hard}" for res, soft, hard in rlimits), "--"]
        if self.root:
            out += [tools["setpriv"], f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--"]
        return out, fds

    def close(self) -> list[str]:
        problems = self.cg.remove() if self.cg else []
        if self.go_fd >= 0:
            os.close(self.go_fd)
            self.go_fd = -1
        if self.netns is not None:
            os.close(self.netns)
            self.netns = None
        if self.ns is not None:
            self.ns.close()  # its mount namespace, and the scratch tmpfs with it, goes with the helper
        elif self.tmpfs and self.scratch_mb:
            try:
                _linux.umount(self.fs)
            except OSError as e:
                problems.append(str(e))
        problems += _linux.remove_tree(self.dir)
        if self.lease:
            self.lease.release()
        return problems


class _State:
    """Everything a BwrapSandbox holds, separate from it so a finalizer can release it."""

    def __init__(self):
        self.cells: list[_Cell] = []
        self.base: str | None = None
        self.executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.next: concurrent.futures.Future | None = None
        self.service: _Launch | None = None
        """The launch of a running `serve()` process, killed first on close."""
        self.zygotes: dict = {}
        """name -> `Zygote` of `BwrapSandbox.zygote` (each in a sibling sandbox), closed first on close."""
        self.closed = False
        self.generation = 0
        self.owner = os.getpid()

    def close(self) -> None:
        if self.closed or os.getpid() != self.owner:  # a forked child must not tear down its parent's slots
            return
        self.closed = True
        for z in self.zygotes.values():
            with contextlib.suppress(Exception):
                z.close()
        if self.service is not None:
            for p in _dispose(self.service):
                log.warning("bwrap sandbox cleanup: %s", p)
            self.service = None
        if self.next is not None:
            with contextlib.suppress(Exception):
                _dispose(self.next.result(timeout=30))
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        for c in self.cells:
            for p in c.close():
                log.warning("bwrap sandbox cleanup: %s", p)
        if self.base:
            for p in _linux.remove_tree(self.base):
                log.warning("bwrap sandbox cleanup: %s", p)


def _dispose(launch: _Launch) -> list[str]:
    """Kill and reap a launch (used or not); returns cleanup problems."""
    problems = []
    if launch.pid1fd is None and launch.status_r >= 0:  # the status was never read: learn pid 1 first
        _await_pid1(launch)
    launch.kill()
    try:
        launch.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        problems.append(f"bwrap {launch.proc.pid} did not exit after SIGKILL")
    if launch.pid1fd is not None and not _linux.reap_pidfd(launch.pid1fd, 5.0):
        problems.append("sandbox pid 1 did not exit after SIGKILL")
    elif "pid-namespace" in launch.status:  # pid 1 is gone, and every process of its namespace with it
        launch.cell.pidns.discard(int(launch.status["pid-namespace"]))
    cell = launch.cell
    if cell.cg is not None:
        left = cell.cg.procs()
        if left:
            problems.append(f"{len(left)} processes left in the slot cgroup after the run; killed")
            if cell.cg.kill_all():
                problems.append("processes survived SIGKILL in the slot cgroup")
    if not _settle(cell):
        problems.append("tasks of the slot still exist 5 s after SIGKILL")
    launch.close_fds()
    return problems


def _await_pid1(launch: _Launch, timeout_s: float = 5.0) -> None:
    """Read bwrap's status until it names pid 1 (bwrap may still be setting up: a few ms) or bwrap exits, so
    that disposing waits for pid 1 - and with it the whole pid namespace - to be gone."""
    end = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(launch.status_r, select.POLLIN)
    poller.register(launch.pidfd, select.POLLIN)
    os.set_blocking(launch.status_r, False)
    while launch.pid1fd is None and time.monotonic() < end:
        ready = {fd for fd, _ in poller.poll(max(1, int((end - time.monotonic()) * 1000)))}
        try:
            data = os.read(launch.status_r, 1 << 16) if launch.status_r in ready else b""
        except BlockingIOError:
            data = b""
        except OSError:
            return
        launch.feed_status(data)
        if (launch.pidfd in ready or launch.status_r in ready) and not data:  # bwrap exited
            launch.feed_status(b"\n")
            return


def _settle(cell: _Cell, timeout_s: float = 5.0) -> bool:
    """Wait until no task of the slot is left, zombies included (pid 1 of a killed sandbox may still be
    dying, then becomes our orphan): reap such orphans as they appear. True when the slot is empty."""
    end = time.monotonic() + timeout_s
    while True:
        if cell.cg is not None and cell.cg.has("pids"):
            empty = cell.cg.tasks_alive_or_zombie() == 0  # the kernel's count: zombies included
        else:
            empty = not _linux.pids_of_uid(cell.uid) if cell.root else True
        if empty:
            return True
        _reap_orphans(cell.uid)
        if time.monotonic() > end:
            return False
        time.sleep(0.002)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            out += [int(p) for p in f.read().split()]
    return out


def _reap_orphans(uid: int) -> None:
    """Reap zombie children of this process running as `uid` (orphans adopted as subreaper)."""
    if uid == os.getuid():
        return  # not root: cannot tell our sandboxes' orphans from other children; leave them
    for path in glob.glob("/proc/self/task/*/children"):
        try:
            with open(path) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for pid in pids:
            if _linux.process_uid(pid) != uid:
                continue
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _linux.process_uid(pid) == uid:
                    os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                pass
            finally:
                os.close(fd)


_etc_lock = threading.Lock()
_etc_dirs: dict[tuple[int, bool], str] = {}  # (pid, network): a forked child makes its own


def _shared_etc(network: bool) -> str:
    """This process's private copy of the whitelisted /etc entries plus a generated passwd/group/hosts, shared
    by its sandboxes and mounted as /etc with ONE bind (bwrap re-reads the mount table after every bind, so
    each extra mount costs setup time). Lives on a tmpfs when possible; removed at exit."""
    with _etc_lock:
        if (os.getpid(), network) in _etc_dirs:
            return _etc_dirs[os.getpid(), network]
        base = os.path.join(tempfile.gettempdir(), f"{_PREFIX}{os.getpid()}-shared")
        if (os.getpid(), not network) not in _etc_dirs:
            os.makedirs(base, mode=0o755, exist_ok=True)
            os.chmod(base, 0o755)
            with contextlib.suppress(OSError):
                _linux.mount_tmpfs(base, 16, 4096, mode="0755")
            atexit.register(_remove_shared, base, os.getpid())
        d = os.path.join(base, "etc-net" if network else "etc")
        _linux.remove_tree(d)
        os.mkdir(d, 0o755)
        names = list(_ETC) + [os.path.basename(g) for pat in _ETC_GLOBS for g in glob.glob("/etc/" + pat)]
        for name in dict.fromkeys(names + (list(_ETC_NET) if network else [])):
            src, dst = "/etc/" + name, os.path.join(d, name)
            try:
                if os.path.isdir(src) and not os.path.islink(src):
                    shutil.copytree(src, dst, symlinks=True)
                elif os.path.lexists(src):
                    shutil.copy2(src, dst, follow_symlinks=False)
            except OSError as e:  # unreadable entry: the sandbox goes without it
                log.warning("bwrap sandbox: not copying %s into the sandbox /etc: %s", src, e)
        files = {"passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\n"
                           f"sandbox:x:{INNER_UID}:{INNER_UID}::/work:/bin/sh\n"
                           "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
                 "group": f"root:x:0:\nsandbox:x:{INNER_UID}:\nnogroup:x:65534:\n",
                 "hosts": "127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost ip6-loopback\n"}
        for name, text in files.items():
            with open(os.path.join(d, name), "w") as f:
                f.write(text)
            os.chmod(os.path.join(d, name), 0o644)
        _etc_dirs[os.getpid(), network] = d
        return d


def _remove_shared(base: str, owner: int) -> None:
    if os.getpid() != owner:  # atexit in a forked child: the directory is the parent's
        return
    with contextlib.suppress(OSError):
        _linux.umount(base)
    _linux.remove_tree(base)


def _scratch_namespace(notes: list[str]) -> ScratchNamespace | None:
    """A worker that is not root: the helper namespace for its size-capped scratch, or None (noted)."""
    try:
        return ScratchNamespace()
    except OSError as e:
        notes.append(f"no user namespace for a capped scratch tmpfs ({e})")
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _remove_stale_once() -> None:
    """Remove what workers that died without closing left behind: scratch tmpfs mounts and their
    directories, and empty slot cgroups (their processes died with them: --die-with-parent)."""
    global _stale_done
    with _stale_lock:
        if _stale_done:
            return
        _stale_done = True
    for d in glob.glob(os.path.join(tempfile.gettempdir(), _PREFIX + "*")):
        pid = os.path.basename(d)[len(_PREFIX):].split("-")[0]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue  # a symlink, or not ours: never followed, never touched
        for fs in _stale_mounts(d) + [d]:
            with contextlib.suppress(OSError):
                _linux.umount(fs)  # UMOUNT_NOFOLLOW
        for p in _linux.remove_tree(d):
            log.warning("bwrap sandbox: stale folder %s: %s", d, p)
    remove_stale_groups(_PREFIX, _pid_alive)


def _stale_mounts(d: str) -> list[str]:
    """`d/cell*/fs` of a stale folder, found without following a symlink at any level."""
    out = []
    with contextlib.suppress(OSError), os.scandir(d) as it:
        for e in it:
            if e.name.startswith("cell") and e.is_dir(follow_symlinks=False):
                fs = os.path.join(e.path, "fs")
                with contextlib.suppress(OSError):
                    if stat.S_ISDIR(os.lstat(fs).st_mode):
                        out.append(fs)
    return out


def _bwrap_version(path: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(x) for x in out.split()[-1].split("."))
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return (0,)


@SANDBOXES.register("bwrap")
class BwrapSandbox(Sandbox):
    """Bubblewrap sandbox; one run at a time per instance (use `SandboxPool` for concurrency).

    rootfs: a directory to use read-only as the sandbox's root filesystem instead of the host's /usr and
    /etc copy (e.g. an unpacked image; readable by the slot uids); it needs /bin/sh for prespawn.
    prespawn: set the next run's sandbox up while the current one runs (hides bwrap's setup latency).
    env: extra environment variables. uid_base: start of the host uid range for slots.
    seccomp: install the filter of `envs.sandbox._seccomp` (default; off only to debug with strace/gdb).
    layer: a per-domain image (`envs.sandbox.image_cache.ImageLayer`): its /usr/local and /opt are mounted
    read-only over the host's, its env set and its workdir the start directory.
    exec_chain: start bwrap through sh/nsenter/prlimit/setpriv (`_Cell.chain`) instead of a forked worker
    running the same steps (`_Cell.preexec`; also used when a tool is missing): same isolation, no fork of
    the worker.
    lease_dir: the node-wide registry of slot uid leases (`envs.sandbox._linux.lease_dir`; None = its default,
    /run/megatron-rl/sandbox-uids for root); every worker of the node must use the same one.
    Side effect: the process becomes a child subreaper (PR_SET_CHILD_SUBREAPER), so orphans of its
    descendants are re-parented to it; the sandbox reaps those of its own slots.
    """

    name = "bwrap"

    def __init__(self, rootfs: str | None = None, *, limits: Limits | None = None, prespawn: bool = True,
                 env: dict[str, str] | None = None, uid_base: int = _linux.UID_BASE, bwrap: str | None = None,
                 seccomp: bool = True, layer: ImageLayer | None = None, exec_chain: bool = True,
                 lease_dir: str | None = None):
        self.default_limits = limits or Limits()
        self.default_limits.validate()
        path = bwrap or shutil.which("bwrap") or (os.path.exists("/usr/bin/bwrap") and "/usr/bin/bwrap")
        if not path:
            raise SandboxUnavailable("bubblewrap ('bwrap') is not installed: `apt-get install bubblewrap` "
                                     "(Debian/Ubuntu), or pick backend 'apptainer' on a cluster that has it")
        if rootfs is not None and not os.path.isdir(rootfs):
            raise ValueError(f"sandbox rootfs {rootfs!r} is not a directory; pass an unpacked root filesystem")
        if layer is not None and rootfs is not None:
            raise ValueError("a sandbox image layer goes over the host's /usr; it cannot be combined with rootfs")
        if layer is not None and not os.path.isdir("/usr/local"):
            raise SandboxUnavailable("this host has no /usr/local to mount the sandbox image on: `mkdir /usr/local`")
        self.bwrap, self.rootfs, self.layer = path, rootfs, layer
        self._chain = exec_chain
        self._extra_env, self._uid_base, self._lease_dir = env, uid_base, lease_dir
        self._version = _bwrap_version(path)
        self._env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp",
                     "LANG": "C.UTF-8", "USER": "sandbox", "LOGNAME": "sandbox", **(layer.env if layer else {}),
                     **(env or {})}
        self._chdir = layer.workdir if layer else "/work"
        self._has_sh = _exists_in_root(rootfs or "/", "bin/sh")
        self._seccomp = _seccomp.program() if seccomp and _seccomp.supported() else None
        self._notes = [] if self._seccomp or not seccomp else [
            f"no seccomp filter for architecture {os.uname().machine}: keyrings, ptrace, mount, bpf etc. open"]
        self._prespawn = prespawn and self._has_sh
        self._lock = threading.Lock()
        self.counts = {"prespawned": 0, "cold": 0, "retired": 0}
        """Runs started from a prespawned sandbox vs started cold (limits or network differed, or first run),
        and slots retired because they could not be emptied."""
        self._s = _State()
        self._service: Service | None = None
        self._finalizer = weakref.finalize(self, self._s.close)
        self.subreaper = _linux.set_child_subreaper()
        try:
            _remove_stale_once()
            self._s.base = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
            os.chmod(self._s.base, 0o711)
            group = f"{_PREFIX}{os.getpid()}-{id(self):x}"
            for i in range(2 if self._prespawn else 1):
                self._s.cells.append(_Cell(self._s.base, i, group, uid_base, self.default_limits.scratch_mb,
                                           lease_dir))
            self._root: dict[bool, list[str]] = {}  # mount arguments per network setting, built once
            self._turn = 0
            if self._prespawn:
                self._s.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bwrap-prespawn")
            self._probe()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------------------- public
    @property
    def uids(self) -> list[int]:
        """Host uids of this sandbox's slots (no other process on the host runs as them)."""
        return [c.uid for c in self._s.cells]

    def processes(self) -> list[int]:
        """Host pids of this sandbox: running as its slot uids (root) or, for a worker that is not root (its
        own uid for everything), in the pid namespaces of its runs whose pid 1 was not seen to exit."""
        cells = self._s.cells
        if cells and cells[0].root:
            return [p for u in self.uids for p in _linux.pids_of_uid(u)]
        ns = {n for c in cells for n in c.pidns}
        return [p for p in _linux.pids_of_uid(os.getuid()) if _linux.pid_namespace(p) in ns]

    def leftover_processes(self) -> list[int]:
        """`processes()` other than the idle prespawned bwrap (its pid 1 and shell) waiting for the next run.
        Empty between runs when nothing survived; for health checks and tests."""
        pids = self.processes()
        allowed: set[int] = set()
        nxt = self._s.next  # no lock: callable while a run is in progress (then its processes are listed)
        if nxt is not None:
            try:
                outer = nxt.result(timeout=30).proc.pid
            except Exception:  # a failed prespawn leaves nothing to allow
                outer = None
            if outer is not None:
                allowed = {outer, *_children(outer)}
                allowed |= {p for c in list(allowed - {outer}) for p in _children(c)}  # pid 1, its shell
        return [p for p in pids if p not in allowed]

    def run(self, command, files=None, limits=None, stdin=None, collect=None, sockets=None) -> SandboxResult:
        """`sockets`: name -> bind(host_path), a Unix socket the caller listens on, reached by the program at
        /.sandbox/<name> (the slot's read-only control folder: the program can connect, not replace it)."""
        limits = limits or self.default_limits
        limits.validate()
        script = _script(command)
        check_collect(collect)
        for name in sockets or {}:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name in ("go", "cmd", ".", ".."):
                raise ValueError(f"sandbox socket name {name!r}: use a plain file name other than go/cmd")
        for name, content in (files or {}).items():
            check_relpath(name)
            if not isinstance(content, (str, bytes, bytearray, memoryview)):
                raise ValueError(f"sandbox file {name!r}: content must be str or bytes, got {type(content).__name__}")
        with self._lock:
            if self._s.closed:
                raise RuntimeError("this BwrapSandbox is closed")
            if self._service is not None:
                raise RuntimeError("this BwrapSandbox runs a service (serve()); close it before run()")
            return self._run(script, command, files, limits, stdin, collect, sockets or {})

    def zygote(self, name: str, source: str):
        """A `Zygote` serving `source` from a sandbox of its own (a one-slot sibling of this one: same root,
        image, environment, seccomp; prespawn off), built on first use and closed with this sandbox."""
        from megatron_rl.envs.sandbox.zygote import Zygote

        with self._lock:
            if self._s.closed:
                raise RuntimeError("this BwrapSandbox is closed")
            z = self._s.zygotes.get(name)
            if z is None:
                z = self._s.zygotes[name] = Zygote(self._sibling, source)
            return z

    def _sibling(self) -> BwrapSandbox:
        return BwrapSandbox(self.rootfs, limits=self.default_limits, prespawn=False, env=self._extra_env,
                            uid_base=self._uid_base, bwrap=self.bwrap, seccomp=self._seccomp is not None,
                            layer=self.layer, exec_chain=self._chain, lease_dir=self._lease_dir)

    def close(self) -> None:
        with self._lock:
            self._finalizer()

    def serve(self, command, files=None, limits=None) -> Service:
        """Start `command` as a long-lived process in this sandbox's only slot (needs prespawn=False), talking to
        the worker through its stdin and stdout pipes (`Service`); `run` is refused until the service is closed.
        The same namespaces, mounts, seccomp filter, uid, cgroup and rlimits as a run; no wall deadline (the
        caller bounds each exchange and closes the service when one is not answered in time)."""
        limits = limits or self.default_limits
        limits.validate()
        script = _script(command)
        with self._lock:
            if self._s.closed or self._prespawn or self._service is not None:
                raise RuntimeError("BwrapSandbox.serve needs an open sandbox built with prespawn=False and no "
                                   "service running")
            cell = self._s.cells[0]
            if cell.dirty:
                cell = self._reset_cell(cell)
            cell.dirty = True
            cell.mount(limits.scratch_mb)
            write_files(cell.work, files, cell.uid if cell.root else None)
            if self._has_sh:
                _rewrite(os.path.join(cell.ctl, "cmd"), _inner_limits(cell, limits) + script)
            launch = self._spawn(cell, limits, command)
            if cell.cg is not None:
                cell.cg.set_limits(limits, _BWRAP_TASKS)
                cell.cg.begin()
            cell.dirty = True
            with contextlib.suppress(OSError):
                os.write(launch.block_w, b"\n")
            if not launch.go_fifo:
                os.close(launch.block_w)
                launch.block_w = -1
            self._service = Service(launch, self)
            self._s.service = launch
            return self._service

    def _end_service(self, launch: _Launch) -> list[str]:
        with self._lock:
            problems = _dispose(launch) if self._s.service is launch else []  # else closed with the sandbox
            self._service, self._s.service = None, None
            if not self._s.closed:
                self._reset_cell(launch.cell)
            return problems

    # -------------------------------------------------------------------------------------- the run
    def _run(self, script, command, files, limits, stdin, collect, sockets) -> SandboxResult:
        launch = self._take_prespawned(limits)
        cell = launch.cell if launch else self._s.cells[self._turn]
        bound: list[str] = []
        try:
            return self._run_in(launch, cell, script, command, files, limits, stdin, collect, sockets, bound)
        finally:
            for path in bound:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def _run_in(self, launch, cell, script, command, files, limits, stdin, collect, sockets, bound):
        try:
            if launch is None and cell.dirty:
                cell = self._reset_cell(cell)
            cell.dirty = True  # from here on, whatever happens (an error included), the next use empties it first
            cell.mount(limits.scratch_mb)
            if not cell.tmpfs and _size(files) > limits.scratch_mb << 20:  # a tmpfs refuses them itself
                raise OSError(errno.ENOSPC, f"the files exceed the scratch cap of {limits.scratch_mb} MB")
            write_files(cell.work, files, cell.uid if cell.root else None)
            for name, bind in sockets.items():
                bound.append(os.path.join(cell.ctl, name))
                bind(bound[-1])
                os.chmod(bound[-1], 0o666)  # the slot's uid connects (a socket on a read-only mount still can)
            if self._has_sh:
                _rewrite(os.path.join(cell.ctl, "cmd"), _inner_limits(cell, limits) + script)
            if launch is None:
                launch = self._spawn(cell, limits, command)
                self.counts["cold"] += 1
            else:
                self.counts["prespawned"] += 1
            if cell.cg is not None:
                cell.cg.set_limits(limits, _BWRAP_TASKS)
                cell.cg.begin()
        except BaseException as e:
            problems = _dispose(launch) if launch else []
            if not isinstance(e, OSError):
                raise
            self._reset_cell(cell)
            return SandboxResult(exit_code=1, stdout="", stderr=f"sandbox setup failed: {e}", wall_s=0.0,
                                 violations=["setup"], notes=cell.notes + problems)
        try:
            os.write(launch.block_w, b"\n")  # go: the trampoline (or bwrap) execs the program now
        except OSError:
            pass  # bwrap died during setup: the run reports "setup" with its stderr
        if not launch.go_fifo:
            os.close(launch.block_w)
            launch.block_w = -1
        try:
            self._prespawn_next(cell, limits)
            return self._finish(launch, limits, stdin, collect)
        except BaseException:  # a bug or KeyboardInterrupt: still leave nothing running
            _dispose(launch)
            raise

    def _finish(self, launch: _Launch, limits: Limits, stdin, collect) -> SandboxResult:
        cell = launch.cell
        cg = cell.cg
        on_tick = None
        if cg is not None and cg.has("cpuacct"):
            def on_tick():
                used = cg.cpu_s()
                return "cpu" if used is not None and used > limits.cpu_s else None

        p = pump(stdout_fd=launch.stdout_r, stderr_fd=launch.stderr_r, stdin_fd=launch.stdin_w, stdin_data=stdin,
                 exit_fd=launch.pidfd, deadline=time.monotonic() + limits.wall_s, cap=limits.output_bytes,
                 kill=launch.kill, status_fd=launch.status_r, on_status=launch.feed_status, on_tick=on_tick)
        launch.stdout_r = launch.stderr_r = launch.stdin_w = launch.status_r = -1
        launch.feed_status(b"\n")
        problems = _dispose(launch)
        stats = cg.end() if cg is not None else {}
        result = self._result(launch, limits, p, stats)
        result.files = collect_files(cell.work, collect, limits.file_size_mb << 20)
        result.notes = self._notes + cell.notes + p.notes + problems
        if cell.cg is not None and cell.cg.tasks_alive_or_zombie() > 0:
            result.notes.append("tasks still charged to the slot cgroup after cleanup")
        cell.dirty = True
        if not self._prespawn:
            self._reset_cell(cell)  # with prespawn the reset runs off the critical path, before the next spawn
        return result

    def _result(self, launch: _Launch, limits: Limits, p, stats: dict) -> SandboxResult:
        cell, v = launch.cell, []
        if p.reason:
            v.append(p.reason)
        if "exit-code" in launch.status:
            code = exit_code_from_status(int(launch.status["exit-code"]))
        elif p.reason:
            code = -signal.SIGKILL
        else:  # bwrap failed before the program started (mount, namespace or exec failure)
            code = launch.proc.returncode if launch.proc.returncode else 1
            v.append("setup")
        stderr = decode(p.stderr)
        cpu_s = stats.get("cpu_s")
        if code == -signal.SIGXCPU or (cpu_s is not None and cpu_s > limits.cpu_s):
            v.append("cpu")
        if stats.get("oom_kills", 0) > 0 or (not _has(cell, "memory") and _memory_error(stderr)):
            v.append("memory")
        if stats.get("refused_forks", 0) > 0 or (not _has(cell, "pids") and _fork_error(stderr)):
            v.append("pids")
        limit = limits.file_size_mb << 20
        if (code == -signal.SIGXFSZ or cell.scratch_full(limits.scratch_mb)
                or max(largest_file(cell.work), largest_file(cell.tmp), largest_file(cell.shm)) >= limit):
            v.append("file_size")
        return SandboxResult(exit_code=code, stdout=decode(p.stdout), stderr=stderr, wall_s=p.wall_s,
                             cpu_s=cpu_s or 0.0, violations=list(dict.fromkeys(v)),
                             peak_memory_mb=stats.get("peak_mb", 0.0))

    def _reset_cell(self, cell: _Cell) -> _Cell:
        """Empty a used slot. A slot that cannot be emptied (whatever the reason) is retired - closed, its
        uid and directory never used again by this sandbox - and replaced by a new one, which is returned."""
        try:
            problems = cell.fresh_dirs()
        except Exception as e:
            problems = [f"{e.__class__.__name__}: {e}"]
        if not problems:
            return cell
        log.warning("bwrap sandbox: retiring slot %s, it could not be emptied: %s", cell.dir, "; ".join(problems[:3]))
        idx = self._s.cells.index(cell)
        self._s.generation += 1
        new = _Cell(self._s.base, f"{idx}r{self._s.generation}", cell.group, cell.uid_base,
                    self.default_limits.scratch_mb, cell.lease_dir)
        self._s.cells[idx] = new
        new.pidns |= cell.pidns
        self.counts["retired"] += 1
        for p in cell.close():
            log.warning("bwrap sandbox: retired slot %s: %s", cell.dir, p)
        return new

    # ----------------------------------------------------------------------------------- launching
    def _key(self, limits: Limits, cell: _Cell) -> tuple:
        """What a prespawned sandbox was started for and must match: its rlimits (set before exec; a worker
        without CAP_SYS_RESOURCE cannot change them on another uid's process later) and network."""
        return (rlimits_for(limits, nproc=self._nproc(cell, limits), address_space=not _has(cell, "memory")),
                limits.network)

    def _nproc(self, cell: _Cell, limits: Limits) -> int | None:
        if not cell.root:
            return None  # RLIMIT_NPROC counts every process of the uid: the worker's own too
        return limits.pids + _BWRAP_TASKS + (16 if _has(cell, "pids") else 0)

    def _spawn(self, cell: _Cell, limits: Limits, command=None) -> _Launch:
        key = self._key(limits, cell)
        fds = []
        try:
            block_r, block_w = self._go_fds(cell)
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            fds = [fd for fd in (block_r, block_w, status_r, status_w, in_r, in_w, out_r, out_w, err_r, err_w)
                   if fd >= 0 and fd != cell.go_fd]
            seccomp_r = _seccomp.program_fd(self._seccomp) if self._seccomp else -1
            if seccomp_r >= 0:
                fds.append(seccomp_r)
            argv = self._argv(cell, limits.network, block_r, status_w, command, seccomp_r)
            passed = (status_w,) + tuple(fd for fd in (block_r, seccomp_r) if fd >= 0)
            chain = cell.chain(key[0], limits.network) if self._chain else None
            if chain is not None:
                proc = subprocess.Popen(chain[0] + argv, stdin=in_r, stdout=out_w, stderr=err_w,
                                        pass_fds=passed + chain[1], env={"PATH": "/usr/bin:/bin"}, cwd="/")
            else:
                proc = subprocess.Popen(argv, stdin=in_r, stdout=out_w, stderr=err_w, pass_fds=passed,
                                        preexec_fn=cell.preexec(key[0], limits.network),
                                        env={"PATH": "/usr/bin:/bin"}, cwd="/")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        for fd in (block_r, status_w, in_r, out_w, err_w, seccomp_r):
            if fd >= 0:
                os.close(fd)
        return _Launch(cell=cell, proc=proc, pidfd=os.pidfd_open(proc.pid), block_w=block_w, stdin_w=in_w,
                       stdout_r=out_r, stderr_r=err_r, status_r=status_r, key=key, go_fifo=block_r < 0)

    def _go_fds(self, cell: _Cell) -> tuple[int, int]:
        """(read end for bwrap's --block-fd or -1, the worker's end): with a shell, the slot's `go` FIFO,
        emptied of any line a killed run's shell did not read."""
        if not self._has_sh:
            return os.pipe2(os.O_CLOEXEC)
        with contextlib.suppress(BlockingIOError):
            while os.read(cell.go_fd, 4096):
                pass
        return -1, cell.go_fd

    def _take_prespawned(self, limits: Limits) -> _Launch | None:
        fut, self._s.next = self._s.next, None
        if fut is None:
            return None
        try:
            launch = fut.result()
        except Exception as e:  # the next run starts cold and reports its own failure
            log.warning("bwrap prespawn failed: %s", e)
            return None
        if launch.key != self._key(limits, launch.cell) or launch.proc.poll() is not None:
            _dispose(launch)  # prespawned for other rlimits or network, or it died: start cold
            self._reset_cell(launch.cell)
            return None
        return launch

    def _prespawn_next(self, current: _Cell, limits: Limits) -> None:
        if not self._prespawn:
            return
        idx = 1 - self._s.cells.index(current)
        self._turn = idx
        try:
            self._s.next = self._s.executor.submit(self._reset_and_spawn, self._s.cells[idx], limits)
        except RuntimeError:  # the slot is being closed: this run's result stands, nothing is prespawned
            self._s.next = None

    def _reset_and_spawn(self, cell: _Cell, limits: Limits) -> _Launch:
        if cell.dirty:
            cell = self._reset_cell(cell)
        return self._spawn(cell, limits)

    def _argv(self, cell: _Cell, network: bool, block_fd: int, status_fd: int, command,
              seccomp_fd: int = -1) -> list[str]:
        a = [self.bwrap, "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-uts",
             "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
             "--uid", str(INNER_UID), "--gid", str(INNER_UID), "--hostname", "sandbox"]
        if not network and cell.netns is None:
            a.append("--unshare-net")  # else the slot's own network namespace, joined before exec
        if self._version >= (0, 8):
            a.append("--disable-userns")
        if network not in self._root:
            self._root[network] = self._root_args(network)
        a += self._root[network]
        fs = cell.real_fs
        a += ["--proc", "/proc", "--dev", "/dev", "--bind", f"{fs}/shm", "/dev/shm", "--bind", f"{fs}/work", "/work",
              "--bind", f"{fs}/tmp", "/tmp",
              "--ro-bind", cell.ctl, "/.sandbox", "--remount-ro", "/", "--chdir", self._chdir, "--clearenv"]
        for k, v in self._env.items():
            a += ["--setenv", k, v]
        if seccomp_fd >= 0:
            a += ["--seccomp", str(seccomp_fd)]
        a += ["--json-status-fd", str(status_fd)]
        a += ["--block-fd", str(block_fd), "--"] if block_fd >= 0 else ["--"]
        if self._has_sh:
            return a + ["/bin/sh", "-c", _TRAMPOLINE]
        if command is None:
            raise RuntimeError("internal: a sandbox without /bin/sh cannot be prespawned")
        return a + (["/bin/sh", "-c", command] if isinstance(command, str) else list(command))

    def _root_args(self, network: bool) -> list[str]:
        a: list[str] = []
        if self.rootfs is not None:
            for name in sorted(os.listdir(self.rootfs)):
                if name in _SKIP_ROOT:
                    continue
                p = os.path.join(self.rootfs, name)
                a += ["--symlink", os.readlink(p), "/" + name] if os.path.islink(p) else ["--ro-bind", p, "/" + name]
            return a
        a += ["--ro-bind", "/usr", "/usr"]
        for src, dst in self.layer.mounts() if self.layer else ():  # the domain's image over /usr/local, /opt
            a += ["--ro-bind", src, dst]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            p = "/" + name
            if os.path.islink(p):
                a += ["--symlink", os.readlink(p), p]
            elif os.path.isdir(p):
                a += ["--ro-bind", p, p]
        return a + ["--ro-bind", _shared_etc(network), "/etc"]

    def _probe(self) -> None:
        r = self.run(["/bin/sh", "-c", "exit 0"] if self._has_sh else ["true"], limits=Limits(wall_s=30))
        if "setup" in r.violations or r.exit_code != 0:
            if self.rootfs is not None:
                fix = (f"the rootfs {self.rootfs!r} must hold a runnable /bin/sh or `true` and be readable by the "
                       "sandbox uids (every parent directory world-traversable, e.g. not under a 0700 tmp dir)")
            else:
                fix = ("enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                       "user.max_user_namespaces > 0), or use backend 'apptainer' / 'subprocess' (trusted code only)")
            raise SandboxUnavailable(f"bubblewrap cannot start a sandbox on this machine (exit {r.exit_code}): "
                                     f"{r.stderr.strip()}. Fix: {fix}")


_PRLIMIT = {resource.RLIMIT_CPU: "cpu", resource.RLIMIT_FSIZE: "fsize", resource.RLIMIT_NOFILE: "nofile",
            resource.RLIMIT_CORE: "core", resource.RLIMIT_NPROC: "nproc", resource.RLIMIT_AS: "as"}
_tools: dict | None = None


def _chain_tools() -> dict | None:
    """Absolute paths of sh, nsenter, prlimit and setpriv (util-linux), or None when one is missing."""
    global _tools
    if _tools is None:
        found = {t: shutil.which(t, path="/usr/bin:/bin") for t in ("sh", "nsenter", "prlimit", "setpriv")}
        _tools = found if all(found.values()) else {}
    return _tools or None


def _script(command) -> str:
    """The trampoline script for a command: `exec` of the argv, or the shell string itself."""
    if isinstance(command, str):
        return command
    if isinstance(command, (list, tuple)) and command and all(isinstance(c, str) for c in command):
        return "exec " + shlex.join(command)
    raise ValueError(f"sandbox command must be a non-empty list of strings or a shell string, got {command!r}")


def _inner_limits(cell: _Cell, limits: Limits) -> str:
    """Shell lines the trampoline runs first, inside the sandbox. Not root: RLIMIT_NPROC set there, in the run's
    own user namespace, counts only that run's processes (per-namespace rlimit counts, Linux >= 5.14), while
    the same limit set before bwrap would count every process of the worker's uid. `ulimit -p` is dash's name,
    `-u` bash's; both set soft and hard limits, so the program cannot raise it."""
    if cell.root or _has(cell, "pids"):
        return ""
    n = limits.pids + 1  # + bwrap's pid 1 (the trampoline shell execs the program)
    return f"ulimit -p {n} 2>/dev/null || ulimit -u {n} 2>/dev/null\n"


def _rewrite(path: str, text: str) -> None:
    """Replace a small file's content without O_TRUNC: ext4 (auto_da_alloc) flushes a file truncated to 0 when
    it is closed, which cost ~4 ms of I/O wait per run on a disk-backed temp folder; ftruncate to the new
    length after the write does not."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _size(files: dict | None) -> int:
    return sum(len(c.encode() if isinstance(c, str) else c) for c in (files or {}).values())


def _has(cell: _Cell, controller: str) -> bool:
    return cell.cg is not None and cell.cg.has(controller)


def _memory_error(stderr: str) -> bool:
    return any(s in stderr for s in ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory"))


def _fork_error(stderr: str) -> bool:
    low = stderr.lower()
    return "cannot fork" in low or ("fork" in low and ("resource temporarily unavailable" in low or "retry" in low))


def _exists_in_root(root: str, rel: str, depth: int = 0) -> bool:
    """Whether `rel` exists inside the tree `root`, resolving symlinks relative to `root` (not the host)."""
    cur = root
    parts = [p for p in rel.split("/") if p]
    for i, name in enumerate(parts):
        p = os.path.join(cur, name)
        if os.path.islink(p):
            if depth > 20:
                return False
            target = os.readlink(p)
            rest = "/".join(parts[i + 1:])
            base = target.lstrip("/") if target.startswith("/") else os.path.relpath(
                os.path.normpath(os.path.join(cur, target)), root)
            return _exists_in_root(root, os.path.join(base, rest) if rest else base, depth + 1)
        if not os.path.lexists(p):
            return False
        cur = p
    return True
