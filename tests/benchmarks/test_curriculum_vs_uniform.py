"""benchmarks/curriculum_vs_uniform.py real: the two sides' commands and how they are launched."""
from __future__ import annotations

import argparse
import sys

import pytest

from benchmarks.curriculum_vs_uniform import _commands, launch

# waits (up to 120 s) for the file argv[1] to exist, then writes argv[2]; exits 1 if it never appears
WAIT_FOR = ("import os, sys, time\n"
            "t = time.time() + 120\n"
            "while not os.path.exists(sys.argv[1]) and time.time() < t: time.sleep(0.05)\n"
            "open(sys.argv[2], 'w').write('x'); print('saw', os.path.exists(sys.argv[1]))\n"
            "sys.exit(0 if os.path.exists(sys.argv[1]) else 1)\n")
TOUCH = "import sys; open(sys.argv[1], 'w').write('x'); print('started')"


def test_the_sides_differ_only_in_the_curriculum_switch_and_their_output_folder(tmp_path):
    args = argparse.Namespace(config="configs/many_domains_cpu.yaml", out=str(tmp_path), steps=7,
                              set=["rl.group_size=4"])
    c = _commands(args)
    assert set(c) == {"uniform", "curriculum"}
    diff = [(a, b) for a, b in zip(c["uniform"], c["curriculum"]) if a != b]
    assert diff == [(f"output_dir={tmp_path / 'uniform'}", f"output_dir={tmp_path / 'curriculum'}"),
                    ("envs.curriculum.enabled=false", "envs.curriculum.enabled=true")]
    assert "rl.steps=7" in c["uniform"] and c["uniform"][-1] == "rl.group_size=4"


def test_parallel_runs_both_sides_at_once_each_with_its_log(tmp_path):
    a, b = tmp_path / "a_started", tmp_path / "b_started"
    cmds = {"uniform": [sys.executable, "-c", WAIT_FOR, str(b), str(a)],   # finishes only once the other started
            "curriculum": [sys.executable, "-c", TOUCH, str(b)]}
    launch(cmds, tmp_path / "out", parallel=True)
    assert (tmp_path / "out" / "uniform.log").read_text() == "saw True\n"
    assert (tmp_path / "out" / "curriculum.log").read_text() == "started\n"


def test_one_after_the_other_the_second_starts_after_the_first_ended(tmp_path):
    first = tmp_path / "first_done"
    cmds = {"uniform": [sys.executable, "-c", TOUCH, str(first)],
            "curriculum": [sys.executable, "-c", "import os, sys; sys.exit(0 if os.path.exists(sys.argv[1]) else 5)",
                           str(first)]}
    launch(cmds, tmp_path, parallel=False)
    assert first.exists()


@pytest.mark.parametrize("parallel", [False, True])
def test_a_failed_side_stops_the_benchmark_naming_it_with_its_log(tmp_path, parallel):
    cmds = {"uniform": [sys.executable, "-c", "print('fine')"],
            "curriculum": [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]}
    with pytest.raises(SystemExit, match=r"(?s)curriculum run failed \(3\).*no model here"):
        launch(cmds, tmp_path, parallel=parallel)
