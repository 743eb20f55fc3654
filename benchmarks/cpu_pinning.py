"""Pin a running process tree's trainer and generation processes to disjoint CPU sets (benchmarks only).

A background thread walks the descendants of one root pid every `period_s` and sets the CPU affinity of every
thread of every process (/proc/<pid>/task/*): a process whose command line, or an ancestor's, names a
generation component (the rollout server, a fleet/dispatch worker run by submitit) goes to the generation
CPUs, every other one (the launcher, torchrun, the trainer rank and its own sandboxes) to the trainer CPUs.
Re-pinning every period catches threads and processes started later. Linux only (/proc, sched_setaffinity).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

GENERATION_MARKERS = ("megatron_rl.rollout.server", "submitit.local._local", "submitit.core._submit",
                      "megatron_rl.dispatch")
"""Command-line substrings of the processes that generate episodes (their descendants follow them)."""


def parse_cpus(spec: str) -> set[int]:
    """'0' / '0,2' / '0-3' -> a set of CPU ids; refused by name when a CPU is not available to this process."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    missing = cpus - os.sched_getaffinity(0)
    if not cpus or missing:
        raise ValueError(f"--pin: CPUs {sorted(missing) or spec!r} are not available here "
                         f"(available: {sorted(os.sched_getaffinity(0))})")
    return cpus


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def classify(root: int) -> dict[int, str]:
    """pid -> 'generation' | 'trainer' for root and every descendant (a process follows its nearest marked
    ancestor)."""
    kids, out, stack = _children(), {}, [(root, "trainer")]
    while stack:
        pid, inherited = stack.pop()
        role = "generation" if inherited == "generation" or any(
            m in _cmdline(pid) for m in GENERATION_MARKERS) else "trainer"
        out[pid] = role
        stack.extend((c, role) for c in kids.get(pid, []))
    return out


def pin_tree(root: int, cpus: dict[str, set[int]]) -> dict[str, int]:
    """Set every thread of root's tree to its role's CPUs once; returns processes pinned per role."""
    counts = {"trainer": 0, "generation": 0}
    for pid, role in classify(root).items():
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus[role])
            except OSError:  # the thread ended meanwhile
                pass
        counts[role] += 1
    return counts


class TreePinner:
    """Keeps root's tree pinned (pin_tree every period_s) until stop(); `seen` = most processes per role."""

    def __init__(self, root: int, cpus: dict[str, set[int]], period_s: float = 0.2):
        self.root, self.cpus, self.period_s = root, cpus, period_s
        self.seen = {"trainer": 0, "generation": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tree-pinner")

    def start(self) -> TreePinner:
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return dict(self.seen)

    def _run(self) -> None:
        while not self._stop.is_set():
            counts = pin_tree(self.root, self.cpus)
            self.seen = {k: max(v, counts[k]) for k, v in self.seen.items()}
            self._stop.wait(self.period_s)
