"""One builder of submitit executors (`dispatch.executor.submitit_executor`) for per-step dispatches and the fleet:
the same resource fields give the same submitit parameters, whichever config carries them."""
from __future__ import annotations

from megatron_rl.dispatch.dispatcher import DispatchConfig
from megatron_rl.dispatch.fleet import Fleet, FleetConfig

SAME = dict(time_min=7, cpus_per_task=3, mem_gb=2.0, partition="short", account="proj", qos="high", signal_delay_s=45,
            max_num_timeout=5, setup=["module load x"])


def _fleet_executor(cfg: FleetConfig, folder):
    fleet = Fleet.__new__(Fleet)  # only what _build_executor reads
    fleet.config, fleet.folder = cfg, folder
    return fleet._build_executor()


def test_dispatch_and_fleet_build_the_same_slurm_executor(tmp_path):
    d = DispatchConfig(executor="slurm", array_parallelism=12, **SAME).build_executor(tmp_path / "d")
    f = _fleet_executor(FleetConfig(executor="slurm", size=3, **SAME), tmp_path / "f")
    dp, fp = dict(d._executor.parameters), dict(f._executor.parameters)
    assert (dp.pop("job_name"), fp.pop("job_name")) == ("mrl-rollout", "mrl-fleet")
    assert (dp.pop("array_parallelism"), fp.pop("array_parallelism")) == (12, 12)  # fleet: 4 x its size
    assert dp == fp == {"time": 7, "cpus_per_task": 3, "mem": "2GB", "partition": "short", "signal_delay_s": 45,
                        "account": "proj", "qos": "high", "setup": ["module load x"]}
    assert d._executor.max_num_timeout == f._executor.max_num_timeout == 5
    assert str(f._executor.folder).startswith(str(tmp_path / "f" / "submitit"))


def test_local_executors_run_the_setup_lines(tmp_path):
    d = DispatchConfig(executor="local", **SAME).build_executor(tmp_path / "d")
    f = _fleet_executor(FleetConfig(executor="local", **SAME), tmp_path / "f")
    for ex in (d, f):
        assert ex._executor.parameters["setup"] == ["module load x"] and ex._executor.parameters["timeout_min"] == 7
