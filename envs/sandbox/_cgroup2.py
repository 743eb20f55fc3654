"""Per-slot cgroup v2 groups in a delegated subtree: what a normal user gets on HPC (Slurm's job cgroup with
`cgroup/v2`, a systemd user slice with `Delegate=yes`), and what root gets on a pure-v2 host.

Decision (`SlotCgroup2.create`): the worker's own v2 cgroup (`0::<path>` of /proc/self/cgroup under the
cgroup2 mount) is used only when its `cgroup.controllers` has memory and pids and it is writable by this
uid; then `+memory +pids` (and `+cpu` when delegated) go into its `cgroup.subtree_control`. The kernel's
no-internal-processes rule refuses that (EBUSY) while processes sit in the worker's own cgroup, so the
worker first moves itself into a leaf child `<own>/mrl-worker`, then enables the controllers. Each slot gets
`<own>/<group>/<slot>` with `memory.max` = `memory.swap.max`-bounded RAM (swap 0), `pids.max`, and
`cpu.max` (quota per period) when the cpu controller is there. Counters come from the kernel
(`memory.events` oom_kill, `pids.events` max, `cpu.stat` usage_usec, `memory.peak`); cleanup writes
`cgroup.kill`. Anything missing is fallen back from (`envs.sandbox._cgroup`'s v1 groups, else rlimits) and
the reason is in every result's notes.

THREAT MODEL: as `envs.sandbox._cgroup` (the sandbox sees no /sys and runs in a cgroup namespace); a
delegated subtree cannot raise limits set above it by the site (Slurm's job memory), which still apply.
Not covered: io.max; cpu.max where the cpu controller is not delegated (noted).
"""
from __future__ import annotations

import errno
import os
import time

from megatron_rl.envs.sandbox._cgroup import _kv, _read, _write, sigkill
from megatron_rl.envs.sandbox.base import Limits

_PERIOD_US = 100_000
LEAF = "mrl-worker"
"""The leaf child the worker moves itself into so that its own cgroup may enable controllers for children."""


def own_v2_dir() -> str | None:
    """This process's cgroup v2 folder (the cgroup2 mount + its `0::` path), or None without one."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((ln[3:] for ln in f.read().splitlines() if ln.startswith("0::")), None)
        with open("/proc/self/mountinfo") as f:
            mnt = next((ln.split(" - ")[0].split()[4] for ln in f.read().splitlines()
                        if ln.partition(" - ")[2].split()[:1] == ["cgroup2"]), None)
    except OSError:
        return None
    if path is None or mnt is None:
        return None
    own = os.path.join(mnt, path.lstrip("/"))
    return os.path.dirname(own) if os.path.basename(own) == LEAF else own  # we moved ourselves there earlier


def _enable(own: str, ctrls: list[str]) -> None:
    """`+c` for each controller in own/cgroup.subtree_control, moving this process into the leaf child first
    when the kernel refuses because own still holds processes (EBUSY)."""
    value = " ".join(f"+{c}" for c in ctrls)
    try:
        _write(os.path.join(own, "cgroup.subtree_control"), value)
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    leaf = os.path.join(own, LEAF)
    os.makedirs(leaf, exist_ok=True)
    _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))  # the whole process, every thread
    _write(os.path.join(own, "cgroup.subtree_control"), value)


class SlotCgroup2:
    """One sandbox slot's v2 cgroup; the same interface as `envs.sandbox._cgroup.SlotCgroups`."""

    def __init__(self, d: str, cpu: bool):
        self.d, self.cpu = d, cpu
        self.dirs = {"memory": d, "pids": d, "cpuacct": d, **({"cpu": d} if cpu else {})}
        """controller -> folder (one folder for all: v2 is one hierarchy); cpuacct = cpu.stat's usage."""
        self.attach_files = (os.path.join(d, "cgroup.procs"),)
        """The file a child writes "0" to, before exec, to join the slot's group."""
        self._applied: dict[str, str] = {}
        self._base = {"oom": 0, "max": 0, "usec": 0}

    @classmethod
    def create(cls, group: str, slot: str, own: str | None = None) -> tuple[SlotCgroup2 | None, list[str]]:
        """`<own>/<group>/<slot>` in the delegated subtree `own` (default: this process's v2 cgroup).
        Returns (None or the group, notes on what is not enforced and why)."""
        own = own or own_v2_dir()
        if own is None:
            return None, ["cgroup v2: not mounted"]
        try:
            ctrls = _read(os.path.join(own, "cgroup.controllers")).split()
        except OSError as e:
            return None, [f"cgroup v2: own cgroup {own} unreadable ({e.strerror})"]
        missing = [c for c in ("memory", "pids") if c not in ctrls]
        if missing:
            return None, [f"cgroup v2: own cgroup {own} lacks {', '.join(missing)} (has: {', '.join(ctrls) or 'none'})"
                          ": not delegated"]
        if not (os.access(own, os.W_OK) and os.access(os.path.join(own, "cgroup.subtree_control"), os.W_OK)):
            return None, [f"cgroup v2: own cgroup {own} is not writable by uid {os.geteuid()}: not delegated"]
        use = [c for c in ("memory", "pids", "cpu") if c in ctrls]
        d = os.path.join(own, group, slot)
        try:
            _enable(own, use)
            os.makedirs(os.path.dirname(d), exist_ok=True)
            _write(os.path.join(os.path.dirname(d), "cgroup.subtree_control"), " ".join(f"+{c}" for c in use))
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            return None, [f"cgroup v2: could not set up a child of {own} ({e.strerror})"]
        notes = [f"cgroup v2: memory and pids limits in the delegated subtree {own}"]
        if "cpu" not in use:
            notes.append("cgroup v2: no cpu controller delegated: cpu.max not enforced (cpu time by rlimit)")
        return cls(d, "cpu" in use), notes

    def has(self, controller: str) -> bool:
        return controller in self.dirs

    def _set(self, name: str, value: str) -> None:
        if self._applied.get(name) != value:
            _write(os.path.join(self.d, name), value)
            self._applied[name] = value

    def set_limits(self, limits: Limits, extra_tasks: int) -> None:
        """memory.max (swap 0: RAM + swap bounded, as v1's memsw), pids.max, cpu.max; only what changed."""
        self._set("memory.max", str(limits.memory_mb << 20))
        if os.path.exists(os.path.join(self.d, "memory.swap.max")):
            self._set("memory.swap.max", "0")
        self._set("pids.max", str(limits.pids + extra_tasks))
        if self.cpu:
            quota = str(int(limits.cpus * _PERIOD_US)) if limits.cpus > 0 else "max"
            self._set("cpu.max", f"{quota} {_PERIOD_US}")

    def _events(self) -> dict[str, int]:
        return {"oom": _kv(_read(os.path.join(self.d, "memory.events")), "oom_kill"),
                "max": _kv(_read(os.path.join(self.d, "pids.events")), "max"),
                "usec": _kv(_read(os.path.join(self.d, "cpu.stat")), "usage_usec")}

    def begin(self) -> None:
        """Start a run: snapshot the OOM-kill, refused-fork and CPU counters; reset the memory peak."""
        self._base = self._events()
        try:
            _write(os.path.join(self.d, "memory.peak"), "0")  # resettable since Linux 6.12
        except OSError:
            pass

    def cpu_s(self) -> float:
        return (self._events()["usec"] - self._base["usec"]) / 1e6

    def end(self) -> dict:
        """Counters since `begin`: oom_kills, refused_forks, cpu_s, peak_mb."""
        now = self._events()
        try:
            peak = int(_read(os.path.join(self.d, "memory.peak")).split()[0]) / (1 << 20)
        except (OSError, ValueError, IndexError):
            peak = 0.0
        return {"oom_kills": now["oom"] - self._base["oom"], "refused_forks": now["max"] - self._base["max"],
                "cpu_s": (now["usec"] - self._base["usec"]) / 1e6, "peak_mb": peak}

    def procs(self) -> list[int]:
        try:
            return sorted(p for p in map(int, _read(self.attach_files[0]).split()) if p > 0)
        except OSError:
            return []

    def tasks_alive_or_zombie(self) -> int:
        return int(_read(os.path.join(self.d, "pids.current")))

    def kill_all(self, timeout_s: float = 5.0) -> list[int]:
        """`cgroup.kill` (else SIGKILL each pid) until the group is empty; returns the pids left."""
        end = time.monotonic() + timeout_s
        while True:
            left = self.procs()
            if not left or time.monotonic() > end:
                return left
            try:
                _write(os.path.join(self.d, "cgroup.kill"), "1")
            except OSError:
                sigkill(left)
            time.sleep(0.005)

    def remove(self) -> list[str]:
        left = self.kill_all()
        problems = [f"processes {left} survived SIGKILL in the slot cgroup"] if left else []
        for d in (self.d, os.path.dirname(self.d)):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                if d == self.d:
                    problems.append(f"could not remove cgroup {d} ({e.strerror})")
        return problems


def create_slot_groups(group: str, slot: str):
    """The slot's cgroups: v1 hierarchies where writable (`envs.sandbox._cgroup`), else a delegated v2 subtree;
    returns (None or the groups, notes on what is not enforced)."""
    from megatron_rl.envs.sandbox._cgroup import SlotCgroups

    v1, notes = SlotCgroups.create(group, slot)
    if v1 is not None:
        return v1, notes
    v2, notes2 = SlotCgroup2.create(group, slot)
    return v2, (notes2 if v2 is not None else [n for n in notes if not n.startswith("cgroup v2")] + notes2)
