"""SandboxPool: concurrent slots with their own uids, ordered map, errors confined to their run."""
from __future__ import annotations

import os
import threading
import time

import pytest

from envs.sandbox import Limits, Sandbox, SandboxJob, SandboxPool, SandboxResult
from envs.sandbox.bwrap import BwrapSandbox


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(lambda i: BwrapSandbox(), workers=3) as p:
        yield p


@pytest.mark.slow
def test_slots_have_disjoint_uids_and_run_concurrently(pool):
    uids = [set(s.uids) for s in pool.slots]
    if os.geteuid() == 0:  # root: a uid per slot (a normal user has only its own)
        assert all(not (a & b) for i, a in enumerate(uids) for b in uids[i + 1:])
    t0 = time.monotonic()
    results = pool.map([SandboxJob(command="sleep 1; id -u")] * 3)
    elapsed = time.monotonic() - t0
    assert [r.stdout for r in results] == ["1000\n"] * 3
    assert elapsed < 2.5, f"3 one-second runs on 3 slots took {elapsed:.1f}s: not concurrent"


def test_map_keeps_job_order(pool):
    jobs = [SandboxJob(command=["sh", "-c", f"sleep 0.0{9 - i}; echo {i}"]) for i in range(9)]
    assert [r.stdout for r in pool.map(jobs)] == [f"{i}\n" for i in range(9)]


def test_caller_error_goes_to_its_future_and_the_pool_keeps_serving(pool):
    bad = pool.submit(["true"], files={"../escape": "x"})
    with pytest.raises(ValueError, match="relative path"):
        bad.result()
    assert all(r.ok for r in pool.map([SandboxJob(command=["true"])] * 6))


def test_backend_crash_is_confined_to_its_run():
    class Flaky(Sandbox):
        name = "flaky"

        def __init__(self):
            self.calls = 0

        def run(self, command, files=None, limits=None, stdin=None, collect=None):
            self.calls += 1
            if command == "boom":
                raise RuntimeError("backend bug")
            return SandboxResult(exit_code=0, stdout=f"{threading.current_thread().name}", stderr="", wall_s=0.0)

    with SandboxPool(lambda i: Flaky(), workers=2) as p:
        futs = [p.submit("boom") for _ in range(4)] + [p.submit("ok") for _ in range(4)]
        errors = [f.exception() for f in futs[:4]]
        assert all(isinstance(e, RuntimeError) for e in errors)
        assert all(f.result().ok for f in futs[4:])
        assert sum(s.calls for s in p.slots) == 8


def test_close_leaves_no_process_and_refuses_new_work():
    p = SandboxPool(lambda i: BwrapSandbox(), workers=2)
    futs = [p.submit("sleep 0.2; echo $$") for _ in range(4)]
    p.close()  # queued work finishes first
    assert [f.result().stdout for f in futs] == ["2\n"] * 4
    assert [pid for s in p.slots for pid in s.processes()] == []
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(["true"])


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers >= 1"):
        SandboxPool(lambda i: BwrapSandbox(), workers=0)


def test_violations_in_one_slot_do_not_disturb_the_others(pool):
    flood = SandboxJob(command=["yes"], limits=Limits(output_bytes=1 << 12))
    normal = SandboxJob(command=["python3", "-c", "print(sum(range(10)))"])
    results = pool.map([flood, normal, flood, normal, flood, normal])
    assert [("output" in r.violations) for r in results[::2]] == [True] * 3
    assert [r.stdout for r in results[1::2]] == ["45\n"] * 3 and all(r.ok for r in results[1::2])
