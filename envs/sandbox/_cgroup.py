"""Per-slot cgroup v1 groups (memory, pids, cpu, cpuacct) for sandbox runs.

THREAT MODEL. Covered: every process a sandbox run creates is charged to its slot's groups, so memory
(RAM + swap: `memory.memsw`), task count (`pids.max`) and CPU bandwidth (`cpu.cfs_quota_us`) are bounded
for the whole process tree, not per process as rlimits are; OOM kills, refused forks and CPU time are read
back from the kernel's counters (not from anything the program prints); after a run every process left in
the group is SIGKILLed until the group is empty. The sandboxed program cannot see or write these files
(no /sys inside the sandbox, and a cgroup namespace).
cgroup v2 (a delegated subtree where these v1 hierarchies are not writable) is `envs.sandbox._cgroup2`.
Not covered: I/O bandwidth;
kernel memory outside the memory controller's accounting.
"""
from __future__ import annotations

import logging
import os
import signal
import time

from megatron_rl.envs.sandbox.base import Limits

log = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
_CFS_PERIOD_US = 100_000


def _v1_mounts() -> dict[str, tuple[str, str]]:
    """controller -> (mount point, root of the mount inside the hierarchy) for cgroup v1 mounts."""
    out: dict[str, tuple[str, str]] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(post_fields) < 3 or post_fields[0] != "cgroup":
            continue
        opts = set(post_fields[2].split(","))
        for c in CONTROLLERS:
            if c in opts and c not in out:
                out[c] = (fields[4], fields[3])
    return out


def _own_paths() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f.read().splitlines():
                _, ctrls, path = line.split(":", 2)
                for c in ctrls.split(","):
                    out[c] = path
    except (OSError, ValueError):
        pass
    return out


def own_v1_groups() -> dict[str, str]:
    """controller -> the folder of this process's own cgroup in each v1 hierarchy mounted here."""
    mounts, own, out = _v1_mounts(), _own_paths(), {}
    for c, (mnt, root) in mounts.items():
        rel = own.get(c, "/")
        rel = rel[len(root):] if root != "/" and rel.startswith(root) else rel
        out[c] = os.path.join(mnt, rel.lstrip("/"))
    return out


def v2_status() -> str:
    """What cgroup v2 offers this process, for the notes: whether its own v2 cgroup (Slurm's job cgroup, a
    systemd user slice) is a writable subtree with the memory and pids controllers. Used for notes only: the
    v2 limits themselves are not set yet (no host here to test them on)."""
    own = _own_paths().get("", None)
    mnt = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f.read().splitlines():
                pre, _, post = line.partition(" - ")
                if post.split()[:1] == ["cgroup2"]:
                    mnt = pre.split()[4]
                    break
    except OSError:
        pass
    if own is None or mnt is None:
        return "cgroup v2: not mounted"
    d = os.path.join(mnt, own.lstrip("/"))
    try:
        ctrls = _read(os.path.join(d, "cgroup.controllers")).split()
    except OSError as e:
        return f"cgroup v2: own cgroup {d} unreadable ({e.strerror})"
    missing = [c for c in ("memory", "pids") if c not in ctrls]
    if missing or not os.access(d, os.W_OK):
        why = f"lacks {', '.join(missing)} (has: {', '.join(ctrls) or 'none'})" if missing else "is not writable"
        return f"cgroup v2: own cgroup {d} {why}: no delegated memory/pids limits"
    return f"cgroup v2: a delegated subtree {d} with memory and pids exists, but v2 limits are not set yet"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)  # as the shell's `echo v > file` (cgroupfs accepts O_TRUNC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def sigkill(pids) -> None:
    """SIGKILL each of `pids` (gone or not ours: skipped)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _kv(text: str, key: str) -> int:
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


class SlotCgroups:
    """The cgroups of one sandbox slot, created once and reused by every run of that slot."""

    def __init__(self, dirs: dict[str, str]):
        self.dirs = dirs
        """controller -> directory of this slot's group."""
        self.attach_files = tuple(os.path.join(d, "cgroup.procs") for d in dirs.values())
        """Files a child writes "0" to (as root, before exec) to join the slot's groups."""
        self._applied: dict[str, str] = {}
        self._base_oom = self._base_pids = 0
        self._fds: dict[str, int] = {}  # counters read on every run: kept open (pread is ~30x cheaper than open)

    def _fd(self, controller: str, name: str) -> int:
        key = f"{controller}/{name}"
        if key not in self._fds:
            path = os.path.join(self.dirs[controller], name)
            self._fds[key] = os.open(path, os.O_RDWR if os.access(path, os.W_OK) else os.O_RDONLY)
        return self._fds[key]

    def _get(self, controller: str, name: str) -> str:
        fd, chunks, off = self._fd(controller, name), [], 0
        while True:  # to EOF: a list of pids may exceed one read, and a cut pid must never be parsed
            b = os.pread(fd, 65536, off)
            if not b:
                return b"".join(chunks).decode()
            chunks.append(b)
            off += len(b)

    def _put(self, controller: str, name: str, value: str) -> None:
        os.pwrite(self._fd(controller, name), value.encode(), 0)

    @classmethod
    def create(cls, group: str, slot: str) -> tuple[SlotCgroups | None, list[str]]:
        """Create `<own cgroup>/<group>/<slot>` in each v1 controller hierarchy that is writable.
        Returns (None or the groups, notes on what is missing)."""
        own, dirs, notes = own_v1_groups(), {}, []
        for c in CONTROLLERS:
            if c not in own:
                notes.append(f"no cgroup v1 '{c}' hierarchy")
                continue
            d = os.path.join(own[c], group, slot)
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                notes.append(f"cgroup '{c}' not writable ({e.strerror})")
                continue
            if not os.access(os.path.join(d, "cgroup.procs"), os.W_OK):
                notes.append(f"cgroup '{c}' not writable")
                _rmdir(d, quiet=True)
                continue
            dirs[c] = d
        if "memory" not in dirs and "pids" not in dirs:
            for d in dirs.values():
                _rmdir(d)
            return None, notes + [v2_status()]
        return cls(dirs), notes

    def has(self, controller: str) -> bool:
        return controller in self.dirs

    def _set(self, controller: str, name: str, value: str) -> None:
        key = f"{controller}/{name}"
        if self._applied.get(key) != value:
            _write(os.path.join(self.dirs[controller], name), value)
            self._applied[key] = value

    def set_limits(self, limits: Limits, extra_tasks: int) -> None:
        """Apply `limits` (only what changed since the last run). `extra_tasks`: the launcher's own."""
        if "memory" in self.dirs:
            mem = str(limits.memory_mb << 20)
            d = self.dirs["memory"]
            sw = os.path.join(d, "memory.memsw.limit_in_bytes")
            old = self._applied.get("memory/memory.limit_in_bytes")
            old = int(old if old is not None else _read(os.path.join(d, "memory.limit_in_bytes")))
            has_sw = os.path.exists(sw)
            if int(mem) > old:  # raising: memsw first (it must stay >= the memory limit)
                if has_sw:
                    self._set("memory", "memory.memsw.limit_in_bytes", mem)
                self._set("memory", "memory.limit_in_bytes", mem)
            else:
                self._set("memory", "memory.limit_in_bytes", mem)
                if has_sw:
                    self._set("memory", "memory.memsw.limit_in_bytes", mem)
        if "pids" in self.dirs:
            self._set("pids", "pids.max", str(limits.pids + extra_tasks))
        if "cpu" in self.dirs:
            quota = str(int(limits.cpus * _CFS_PERIOD_US)) if limits.cpus > 0 else "-1"
            self._set("cpu", "cpu.cfs_period_us", str(_CFS_PERIOD_US))
            self._set("cpu", "cpu.cfs_quota_us", quota)

    def begin(self) -> None:
        """Start a run: snapshot the OOM-kill and refused-fork counters, zero CPU time and peak memory."""
        if "memory" in self.dirs:
            self._base_oom = _kv(self._get("memory", "memory.oom_control"), "oom_kill")
            self._put("memory", "memory.max_usage_in_bytes", "0")
        if "pids" in self.dirs:
            self._base_pids = _kv(self._get("pids", "pids.events"), "max")
        if "cpuacct" in self.dirs:
            self._put("cpuacct", "cpuacct.usage", "0")

    def cpu_s(self) -> float | None:
        if "cpuacct" not in self.dirs:
            return None
        return int(self._get("cpuacct", "cpuacct.usage")) / 1e9

    def end(self) -> dict:
        """Counters since `begin`: oom_kills, refused_forks, cpu_s (or None), peak_mb."""
        out: dict = {"oom_kills": 0, "refused_forks": 0, "cpu_s": self.cpu_s(), "peak_mb": 0.0}
        if "memory" in self.dirs:
            out["oom_kills"] = _kv(self._get("memory", "memory.oom_control"), "oom_kill") - self._base_oom
            out["peak_mb"] = int(self._get("memory", "memory.max_usage_in_bytes")) / (1 << 20)
        if "pids" in self.dirs:
            out["refused_forks"] = _kv(self._get("pids", "pids.events"), "max") - self._base_pids
        return out

    def procs(self) -> list[int]:
        """Processes in the slot (every run process joins all the slot's groups, so one group tells)."""
        c = "pids" if "pids" in self.dirs else "memory" if "memory" in self.dirs else next(iter(self.dirs))
        try:
            return sorted(int(x) for x in self._get(c, "cgroup.procs").split())
        except OSError:
            return []

    def tasks_alive_or_zombie(self) -> int:
        """pids.current: tasks not yet reaped (zombies count); -1 without a pids group."""
        if "pids" not in self.dirs:
            return -1
        return int(self._get("pids", "pids.current"))

    def kill_all(self, timeout_s: float = 5.0) -> list[int]:
        """SIGKILL every process in the groups until they are empty; returns the pids still there after
        `timeout_s` (empty on success)."""
        end = time.monotonic() + timeout_s
        while True:
            left = [p for p in self.procs() if _state(p) not in ("Z", None)]  # zombies wait for their reaper
            if not left or time.monotonic() > end:
                return left
            sigkill(left)
            time.sleep(0.005)

    def remove(self) -> list[str]:
        """Kill what is left and remove the groups (and their parent when it is empty); returns problems."""
        problems = []
        left = self.kill_all()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if left:
            problems.append(f"processes {left} survived SIGKILL in the slot cgroup")
        for d in self.dirs.values():
            if not _rmdir(d):
                problems.append(f"could not remove cgroup {d}")
            _rmdir(os.path.dirname(d), quiet=True)
        return problems


def remove_stale_groups(prefix: str, pid_alive) -> None:
    """Remove `<own cgroup>/<prefix><pid>-*` groups (and their slots) of processes that no longer exist.

    Several processes sweep at once (every rank of a job builds its sandbox at start-up), so a group or slot
    listed here may be gone a moment later, removed by another sweeper: that is its goal reached, never an
    error."""
    for c, parent in own_v1_groups().items():
        for group in _stale_in(parent, prefix, pid_alive):
            try:
                slots = os.listdir(group)
            except OSError:  # removed by a concurrent sweeper
                continue
            for slot in slots:
                if os.path.isdir(os.path.join(group, slot)):
                    SlotCgroups({c: os.path.join(group, slot)}).kill_all(timeout_s=1.0)
                    _rmdir(os.path.join(group, slot), quiet=True)
            _rmdir(group, quiet=True)


def _stale_in(parent: str, prefix: str, pid_alive) -> list[str]:
    """`parent/<prefix><pid>-*` of pids that are gone (nothing when `parent` cannot be listed)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    out = []
    for name in names:
        pid = name[len(prefix):].split("-")[0] if name.startswith(prefix) else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            out.append(os.path.join(parent, name))
    return out


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _rmdir(d: str, quiet: bool = False) -> bool:
    for _ in range(100):
        try:
            os.rmdir(d)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:  # EBUSY while the last task is being released
            if quiet:
                return False
            last = e
            time.sleep(0.01)
    log.warning("cannot remove cgroup %s: %s", d, last)
    return False
