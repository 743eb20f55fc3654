"""cgroup v2 limits in a delegated subtree (envs.sandbox._cgroup2).

THESE ARE MOCKS: this host has no delegated cgroup v2 hierarchy (memory and pids are bound to its v1
hierarchies, so a cgroup2 mount, even in a new namespace, offers only hugetlb; there is no systemd user
manager for `systemd-run --user`). The decision logic and the file writes are tested against a folder laid
out like cgroupfs (the kernel's files pre-created as plain files), with the bubblewrap backend driving it as
on a pure-v2 host. That the kernel then enforces the limits is not tested here."""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from envs.sandbox import Limits, _cgroup, _cgroup2
from envs.sandbox._cgroup2 import LEAF, SlotCgroup2, create_slot_groups

FILES = {"cgroup.procs": "", "cgroup.kill": "", "cgroup.subtree_control": "", "memory.max": "max",
         "memory.swap.max": "max", "memory.peak": "0", "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
         "pids.max": "max", "pids.current": "0", "pids.events": "max 0\n", "cpu.max": "max 100000",
         "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n"}


def cgroupfs(root: Path, controllers: str = "cpuset cpu io memory hugetlb pids", children=()) -> Path:
    """A folder laid out like a delegated v2 cgroup: its interface files, and those of `children` (the kernel
    creates them on mkdir; a plain folder does not)."""
    for d in (root, *[root / c for c in children]):
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.controllers").write_text(controllers + "\n")
        for name, text in FILES.items():
            (d / name).write_text(text)
    return root


def test_a_delegated_subtree_gets_the_slot_group_and_the_run_limits(tmp_path):
    own = cgroupfs(tmp_path / "job_1", children=["g", "g/slot0"])
    cg, notes = SlotCgroup2.create("g", "slot0", own=str(own))
    assert cg is not None and notes == [f"cgroup v2: memory and pids limits in the delegated subtree {own}"]
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (own / "g/cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    cg.set_limits(Limits(memory_mb=64, pids=16, cpus=0.5), extra_tasks=3)
    slot = own / "g/slot0"
    assert (slot / "memory.max").read_text() == str(64 << 20) and (slot / "memory.swap.max").read_text() == "0"
    assert (slot / "pids.max").read_text() == "19" and (slot / "cpu.max").read_text() == "50000 100000"
    assert cg.attach_files == (str(slot / "cgroup.procs"),) and cg.has("pids") and cg.has("cpuacct")
    cg.begin()
    (slot / "memory.events").write_text("oom 1\noom_kill 1\n")  # what the kernel reports after an OOM kill
    (slot / "pids.events").write_text("max 4\n")
    (slot / "cpu.stat").write_text("usage_usec 250000\n")
    (slot / "memory.peak").write_text(str(40 << 20))
    assert cg.end() == {"oom_kills": 1, "refused_forks": 4, "cpu_s": 0.25, "peak_mb": 40.0}
    cg.set_limits(Limits(memory_mb=64, pids=16, cpus=0), extra_tasks=3)
    assert (slot / "cpu.max").read_text() == "max 100000"


def test_own_cgroup_with_processes_moves_the_worker_into_a_leaf_first(tmp_path, monkeypatch):
    """The kernel refuses subtree_control (EBUSY) while processes sit in the cgroup: the worker moves itself."""
    own = cgroupfs(tmp_path / "job_1", controllers="memory pids", children=[LEAF, "g", "g/s"])
    real = _cgroup2._write

    def write(path, value):  # the kernel's rule, for the worker's own process
        moved = (own / LEAF / "cgroup.procs").read_text() == str(os.getpid())
        if path == str(own / "cgroup.subtree_control") and not moved:
            raise OSError(errno.EBUSY, "Device or resource busy")
        real(path, value)

    monkeypatch.setattr(_cgroup2, "_write", write)
    cg, notes = SlotCgroup2.create("g", "s", own=str(own))
    assert cg is not None and (own / LEAF / "cgroup.procs").read_text() == str(os.getpid())
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert not cg.has("cpu") and any("cpu.max not enforced" in n for n in notes)


def test_without_delegated_memory_and_pids_the_fallback_notes_say_why(tmp_path, monkeypatch):
    own = cgroupfs(tmp_path / "user.slice", controllers="cpu hugetlb")
    cg, notes = SlotCgroup2.create("g", "s", own=str(own))
    assert cg is None and "lacks memory, pids (has: cpu, hugetlb): not delegated" in notes[0]
    assert not (own / "g").exists() and (own / "cgroup.subtree_control").read_text() == ""
    assert SlotCgroup2.create("g", "s", own=str(tmp_path / "absent"))[0] is None
    # this host: v1 is used where writable; on a pure-v2 host without delegation, the v2 reason is in the notes
    monkeypatch.setattr(_cgroup.SlotCgroups, "create", classmethod(lambda cls, g, s: (None, ["no v1 'memory'"])))
    monkeypatch.setattr(_cgroup2, "own_v2_dir", lambda: str(own))
    cg, notes = create_slot_groups("g", "s")
    assert cg is None and notes[0] == "no v1 'memory'" and "lacks memory" in notes[1]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_bwrap_on_a_pure_v2_host_puts_each_run_in_its_delegated_slot_group(tmp_path, monkeypatch):
    """The backend as it runs on a pure-v2 host (v1 not writable): the slot's group in the delegated subtree,
    the run's limits written there before the run, and the notes saying where they are enforced."""
    from envs.sandbox import bwrap

    own = cgroupfs(tmp_path / "job_7")
    made = []

    def makedirs(p, *a, _orig=os.makedirs, **k):
        _orig(p, *a, **k)
        if p.startswith(str(own) + "/") and p not in made:  # the kernel's files of a new cgroup
            made.append(p)
            cgroupfs(Path(p))

    monkeypatch.setattr(_cgroup.SlotCgroups, "create", classmethod(lambda cls, g, s: (None, ["no v1 'memory'"])))
    monkeypatch.setattr(_cgroup2, "own_v2_dir", lambda: str(own))
    monkeypatch.setattr(_cgroup2.os, "makedirs", makedirs)
    with bwrap.BwrapSandbox(prespawn=False) as sb:
        r = sb.run("echo hi", limits=Limits(memory_mb=96, pids=24, cpus=1.0, wall_s=20))
        (slot,) = [Path(p) for p in made if Path(p).parent.parent == own]
        assert r.exit_code == 0 and r.stdout == "hi\n", r
        assert any(f"delegated subtree {own}" in n for n in r.notes) and not any("rlimits" in n for n in r.notes)
        assert (slot / "memory.max").read_text() == str(96 << 20)
        assert int((slot / "pids.max").read_text()) == 24 + bwrap._BWRAP_TASKS
        assert (slot / "cpu.max").read_text() == "100000 100000"
        assert (slot / "cgroup.procs").read_text() == "0"  # the run's process joined the slot group before exec
