"""The main job with its episodes on the real dev Slurm cluster: the trainer ranks (torchrun, 2 ranks, TP=2)
serve the engine over HTTP; the episodes run as a submitit job array on the `cpu` partition, call back for
tokens, score in bubblewrap sandboxes and publish HDF5 shards that the trainer reads."""
from __future__ import annotations

import subprocess

import pytest

from tests.commands.test_main_job_multiproc import DISPATCH, EXE, REPO, SHORT, _episodes, _rows

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.multiproc]


def test_rl_steps_with_episodes_on_the_cpu_partition(slurm_cluster, tmp_path):
    # No warm-up (train.steps=0: RL from the model's initialisation) and no dynamic sampling (one dispatch, one job
    # array, of the step's 16 episodes; with it, the replacements of equal-reward groups went out in 5-8 more
    # arrays a step): nothing here asserts a learnt policy or the replacements. The launch from a warm-up into RL
    # is test_main_job_async_with_a_separate_rollout_server's; dispatched replacements, test_main_job_multiproc's
    # test_main_job_dispatched_episodes_and_recovery_from_published_shards.
    cmd = [EXE, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}", *SHORT, "train.steps=0",
           "rl.dynamic_sampling=false", *DISPATCH, "rl.steps=2",
           "episodes.dispatch.executor=slurm", f"episodes.dispatch.partition={slurm_cluster.cpu_partition}",
           "episodes.dispatch.mem_gb=0.5", "episodes.dispatch.time_min=5"]
    proc = subprocess.run(cmd, cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "demo"
    rl = _rows(run, "rl")
    assert [r["step"] for r in rl] == [0, 1]
    assert all(r["episodes_dispatched"] >= 16 and r["episodes_missing"] == 0 and r["dispatch_failed_tasks"] == 0
               for r in rl)
    assert all(abs(r["mismatch_kl"]) < 1e-3 for r in rl)
    eps = _episodes(run)
    assert len(eps) == sum(r["episodes_dispatched"] for r in rl) == len({t.episode_id for t in eps})
    assert {int(t.token_versions[-1]) for t in eps} == {0, 1}
    # the shards came from Slurm jobs (<job>_<index> for arrays of several tasks) that ran on the cpu partition
    jobs = {p.name.split("-j")[1].split("-q")[0] for p in (run / "rl_episodes").glob("*/*.h5")}
    assert jobs and all(j.split("_")[0].isdigit() for j in jobs) and any("_" in j for j in jobs), jobs
    out = slurm_cluster.run(["sacct", "-n", "-X", "-P", "-o", "JobID,Partition,State", "-j", ",".join(sorted(jobs))])
    rows = [line.split("|") for line in out.stdout.split() if line]
    assert rows and all(r[1] == slurm_cluster.cpu_partition and r[2] == "COMPLETED" for r in rows), out.stdout
