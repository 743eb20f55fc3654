"""benchmarks/cpu_pinning.py: the process tree of a run is split into trainer and generation CPU sets."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.cpu_pinning import classify, parse_cpus, pin_tree

# the parent starts a "rollout server" child (the marker only in the child's command line, from the environment)
PARENT = ("import os, subprocess, sys, threading, time\n"
          "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', os.environ['MARK']])\n"
          "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
          "print(c.pid, flush=True); time.sleep(30)\n")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin to disjoint sets")
def test_the_generation_child_and_the_trainer_parent_with_all_their_threads_get_their_own_cpus():
    a, b = sorted(os.sched_getaffinity(0))[:2]
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "MARK": "megatron_rl.rollout.server"})
    child = 0
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.2)
        assert classify(parent.pid) == {parent.pid: "trainer", child: "generation"}
        assert pin_tree(parent.pid, {"trainer": {a}, "generation": {b}}) == {"trainer": 1, "generation": 1}
        for pid, cpu in ((parent.pid, a), (child, b)):
            tids = os.listdir(f"/proc/{pid}/task")
            assert len(tids) >= (2 if pid == parent.pid else 1)
            assert all(os.sched_getaffinity(int(t)) == {cpu} for t in tids), (pid, tids)
    finally:
        parent.kill()
        parent.wait()
        if child:
            os.kill(child, 9)


def test_cpu_sets_are_parsed_and_unavailable_ones_refused_by_name():
    first = min(os.sched_getaffinity(0))
    assert parse_cpus(f"{first}") == {first}
    with pytest.raises(ValueError, match="--pin: CPUs \\[4096\\] are not available"):
        parse_cpus("0,4096")
