"""How bwrap is started: by default through sh/nsenter/prlimit/setpriv exec'd without forking the worker
(`_Cell.chain`), else by a forked worker running the same steps (`_Cell.preexec`). Both must give a run the
same uid, rlimits, cgroup and network."""
from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

from envs.sandbox import bwrap
from envs.sandbox.base import Limits
from envs.sandbox.bwrap import BwrapSandbox

PROBE = ("cat /proc/self/uid_map; ulimit -n; ulimit -t; ulimit -c; ulimit -f; "
         "grep -c : /proc/net/dev; cat /proc/self/cgroup | grep -c .")


def test_the_default_start_does_not_fork_the_worker(monkeypatch):
    """With `_Cell.preexec` broken, the default start still works (it never forks the worker to run it); the
    forked start then fails."""
    def broken(*_a, **_k):
        raise AssertionError("preexec used")
    monkeypatch.setattr(bwrap._Cell, "preexec", broken)
    with BwrapSandbox(prespawn=False) as sb:
        r = sb.run(["/bin/sh", "-c", "echo ok"])
    assert r.ok and r.stdout == "ok\n", r
    with pytest.raises(AssertionError, match="preexec used"):
        BwrapSandbox(prespawn=False, exec_chain=False)


def host_uids_while_running(sb: BwrapSandbox) -> set[int]:
    """Host uids of the sandbox's processes, seen from another thread while a run sleeps."""
    seen: set[int] = set()

    def look() -> None:
        time.sleep(0.4)
        for pid in sb.processes():
            with contextlib.suppress(OSError):
                seen.add(os.stat(f"/proc/{pid}").st_uid)
    t = threading.Thread(target=look)
    t.start()
    assert sb.run("sleep 1").ok
    t.join()
    return seen


@pytest.mark.slow
def test_both_starts_give_the_same_uid_limits_and_network():
    limits = Limits(open_files=77, cpu_s=7, file_size_mb=3)
    out = {}
    for chain in (True, False):
        with BwrapSandbox(prespawn=False, exec_chain=chain) as sb:
            r = sb.run(PROBE, limits=limits)
            assert r.ok, r
            out[chain] = r.stdout.split()
            if os.geteuid() == 0:  # the run's processes are the slot's own host uid, never root
                assert host_uids_while_running(sb) == {sb.uids[0]}
    assert out[True][3:7] == ["77", "7", "0", str(3 << 11)], out[True]  # ulimit -f counts 512-byte blocks
    assert out[True][7] == "1"  # /proc/net/dev: loopback only
    assert out[True] == out[False], out
