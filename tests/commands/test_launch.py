"""The one launcher (megatron_rl/commands/launch.py) that train, eval and tools/convert start their ranks with
(LocalRanks, in place of torchrun), and its one place of the thread defaults (rank_threads)."""
import json
import os
import signal
import subprocess
import time

import pytest

from megatron_rl.commands import launch as L
from megatron_rl.run_config import LaunchConfig


def _capture(monkeypatch, under: bool):
    seen = []
    monkeypatch.setattr(L, "under_launcher", lambda: under)
    monkeypatch.setattr(L.LocalRanks, "run", lambda self: seen.append(self) or 0)
    return seen


def test_ranks_start_locally_with_the_runs_thread_count(monkeypatch):
    seen = _capture(monkeypatch, under=False)
    assert L.run_ranks(["-m", "x.y", "--worker"], nproc=3, launch=LaunchConfig(threads_per_rank=5)) == 0
    (ranks,) = seen
    assert ranks.nproc == 3 and ranks.argv == ["-m", "x.y", "--worker"] and ranks.env["OMP_NUM_THREADS"] == "5"


def test_a_rank_already_under_a_launcher_runs_as_one_plain_process(monkeypatch):
    seen = _capture(monkeypatch, under=True)
    L.run_ranks(["-m", "x.y"], nproc=3)
    assert [(r.argv, r.nproc, r.env) for r in seen] == [(["-m", "x.y"], 1, None)]


def test_rank_env_adds_the_extra_variables(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "9")
    env = L.rank_env(extra={"TAG": "1"})
    assert env["OMP_NUM_THREADS"] == "9" and env["TAG"] == "1"


RANK = """
import json, os, signal, sys, time
out = sys.argv[1]
def stop(*_):
    open(f"{out}/stopped{os.environ['RANK']}", "w").close()
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
with open(f"{out}/env{os.environ['RANK']}.json", "w") as f:
    json.dump({k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                              "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS")}, f)
behaviour = sys.argv[2].split(",")[int(os.environ["RANK"])]
if behaviour.startswith("exit"):
    sys.exit(int(behaviour[4:]))
if behaviour == "kill9":
    os.kill(os.getpid(), signal.SIGKILL)
if behaviour == "hang":  # deaf to SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(60)
"""


def _ranks(tmp_path, behaviours: str, **kw) -> L.LocalRanks:
    """Ranks of a small script (no torch): each writes its variables, then exits, kills itself or sleeps."""
    n = len(behaviours.split(","))
    return L.LocalRanks(["-c", RANK, str(tmp_path), behaviours], n, L.rank_env(extra={"OMP_NUM_THREADS": "2"}),
                        **kw).start()


def test_ranks_get_torchruns_variables_pointing_at_the_store_this_process_hosts(tmp_path):
    ranks = _ranks(tmp_path, "exit0,exit0,exit0")
    port = ranks.store.port
    assert ranks.wait(timeout=60) == 0
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [(str(r), str(r), "3") for r in range(3)]
    # every rank a client of the store bound here on a port the kernel picked: no port handed over that another
    # process could take before it was bound (torchrun's --master_port race)
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["TORCHELASTIC_USE_AGENT_STORE"]) for e in envs} == \
        {("127.0.0.1", str(port), "True")} and port > 0
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"2"}


def test_a_failed_rank_stops_the_others_and_its_exit_code_is_returned(tmp_path):
    ranks = _ranks(tmp_path, "sleep,exit5,sleep")
    assert ranks.wait(timeout=60) == 5
    assert sorted(p.name for p in tmp_path.glob("stopped*")) == ["stopped0", "stopped2"]  # SIGTERMed, not left


def test_a_rank_killed_by_a_signal_is_128_plus_it_and_a_hung_peer_is_killed_after_the_grace(tmp_path):
    ranks = _ranks(tmp_path, "kill9,hang", grace_s=1.0)
    _wait_for(lambda: len(list(tmp_path.glob("env*.json"))) == 2)
    assert ranks.wait(timeout=60) == 128 + 9
    assert ranks.procs[1].returncode == -signal.SIGKILL  # ignored the SIGTERM, killed after the grace


def test_a_forwarded_stop_signal_returns_3(tmp_path):
    ranks = _ranks(tmp_path, "sleep,sleep")
    _wait_for(lambda: len(list(tmp_path.glob("env*.json"))) == 2)  # handlers installed before the env file
    ranks.signal(signal.SIGTERM)
    assert ranks.wait(timeout=60) == 3 and len(list(tmp_path.glob("stopped*"))) == 2


def test_a_timeout_kills_every_rank(tmp_path):
    ranks = _ranks(tmp_path, "sleep,sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        ranks.wait(timeout=0.5)
    assert all(p.poll() is not None for p in ranks.procs)


def _wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_thread_defaults_train_shares_the_cores_eval_and_convert_take_one(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert L.rank_threads(LaunchConfig(nproc_per_node=1)) == cores  # train: the cores among its ranks
    assert L.rank_threads(LaunchConfig(threads_per_rank=3)) == 3
    assert L.rank_threads() == 1  # eval, convert
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert L.rank_threads() == 4 == L.rank_threads(LaunchConfig(nproc_per_node=1))
    assert L.rank_threads(LaunchConfig(threads_per_rank=3)) == 3


def test_run_here_gives_the_call_a_ranks_environment_and_restores_the_process_after(monkeypatch):
    import torch

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before_threads, before_handler = torch.get_num_threads(), signal.getsignal(signal.SIGTERM)
    seen = {}

    def rank():
        seen.update({k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS",
                                                    "TORCHELASTIC_USE_AGENT_STORE")})
        seen["threads"] = torch.get_num_threads()
        signal.signal(signal.SIGTERM, lambda *_: None)  # what the driver's StopFlag does
        return 3

    assert L.run_here(rank, LaunchConfig(threads_per_rank=2)) == 3
    assert seen["RANK"] == "0" and seen["WORLD_SIZE"] == "1" and int(seen["MASTER_PORT"]) > 0
    assert seen["OMP_NUM_THREADS"] == "2" == str(seen["threads"]) and seen["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert "RANK" not in os.environ and os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == before_threads and signal.getsignal(signal.SIGTERM) == before_handler


def test_run_here_a_failing_rank_is_exit_1_with_its_traceback(capsys):
    def rank():
        raise ValueError("bad layout")

    assert L.run_here(rank) == 1
    assert "ValueError: bad layout" in capsys.readouterr().err


def test_the_train_command_runs_a_single_rank_here_and_the_python_api_in_a_process_of_its_own(monkeypatch, tmp_path):
    from megatron_rl.commands import train as T
    from megatron_rl.run_config import RunConfig

    calls = []
    monkeypatch.setattr(T, "run_here", lambda fn, launch: calls.append("here") or 0)
    monkeypatch.setattr(T, "run_ranks", lambda argv, n, launch: calls.append(f"ranks{n}") or 0)
    monkeypatch.setattr(T, "under_launcher", lambda: False)
    one, two = RunConfig(), RunConfig()
    one.launch.nproc_per_node, two.launch.nproc_per_node = 1, 2
    for cfg, here in ((one, True), (one, False), (two, True)):
        T.launch_workers(cfg, tmp_path, here)
    assert calls == ["here", "ranks1", "ranks2"]
