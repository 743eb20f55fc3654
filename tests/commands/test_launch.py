"""The one launcher (megatron_rl/commands/launch.py) that train, eval and tools/convert start their ranks with."""
import sys

from megatron_rl.commands import launch as L


def _capture(monkeypatch, under: bool):
    seen = []
    monkeypatch.setattr(L, "under_launcher", lambda: under)
    monkeypatch.setattr(L, "call", lambda cmd, env: seen.append((cmd, env)) or 0)
    return seen


def test_ranks_start_under_torchrun_with_the_callers_thread_count(monkeypatch):
    seen = _capture(monkeypatch, under=False)
    assert L.run_ranks(["-m", "x.y", "--worker"], nproc=3, threads=5) == 0
    cmd, env = seen[0]
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc_per_node=3" in cmd
    assert cmd[-3:] == ["-m", "x.y", "--worker"] and env["OMP_NUM_THREADS"] == "5"


def test_a_rank_already_under_a_launcher_runs_in_process(monkeypatch):
    seen = _capture(monkeypatch, under=True)
    L.run_ranks(["-m", "x.y"], nproc=3, threads=5)
    assert seen == [([sys.executable, "-m", "x.y"], None)]


def test_rank_env_adds_the_extra_variables(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "9")
    env = L.rank_env(2, {"TAG": "1"})
    assert env["OMP_NUM_THREADS"] == "2" and env["TAG"] == "1"
