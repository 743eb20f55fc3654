"""The one launcher (megatron_rl/commands/launch.py) that train, eval and tools/convert start their ranks with,
and its one place of the thread defaults (rank_threads)."""
import os
import sys

from megatron_rl.commands import launch as L
from megatron_rl.run_config import LaunchConfig


def _capture(monkeypatch, under: bool):
    seen = []
    monkeypatch.setattr(L, "under_launcher", lambda: under)
    monkeypatch.setattr(L, "call", lambda cmd, env: seen.append((cmd, env)) or 0)
    return seen


def test_ranks_start_under_torchrun_with_the_runs_thread_count(monkeypatch):
    seen = _capture(monkeypatch, under=False)
    assert L.run_ranks(["-m", "x.y", "--worker"], nproc=3, launch=LaunchConfig(threads_per_rank=5)) == 0
    cmd, env = seen[0]
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc_per_node=3" in cmd
    assert cmd[-3:] == ["-m", "x.y", "--worker"] and env["OMP_NUM_THREADS"] == "5"
    # torchrun's store binds its own free port: no port picked here that another process could take first
    assert "--standalone" in cmd and not any(a.startswith("--master_port") for a in cmd)


def test_a_rank_already_under_a_launcher_runs_in_process(monkeypatch):
    seen = _capture(monkeypatch, under=True)
    L.run_ranks(["-m", "x.y"], nproc=3)
    assert seen == [([sys.executable, "-m", "x.y"], None)]


def test_torchrun_launch_adds_the_extra_variables(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "9")
    cmd, env = L.torchrun_launch(["-m", "x.y"], 2, extra={"TAG": "1"})
    assert "--nproc_per_node=2" in cmd and env["OMP_NUM_THREADS"] == "9" and env["TAG"] == "1"


def test_thread_defaults_train_shares_the_cores_eval_and_convert_take_one(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert L.rank_threads(LaunchConfig(nproc_per_node=1)) == cores  # train: the cores among its ranks
    assert L.rank_threads(LaunchConfig(threads_per_rank=3)) == 3
    assert L.rank_threads() == 1  # eval, convert
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert L.rank_threads() == 4 == L.rank_threads(LaunchConfig(nproc_per_node=1))
    assert L.rank_threads(LaunchConfig(threads_per_rank=3)) == 3
