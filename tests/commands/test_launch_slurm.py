"""Launching on the dev Slurm cluster: torch.distributed rendezvous from srun (Slurm variables and
PMIx), submitit with accounting, GRES on the gpu partition and a gpu+cpu heterogeneous step."""
from __future__ import annotations

import json
import os
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

PROBE = ["-m", "megatron_rl.distributed", "probe"]
# Before the probe, each task prints which node it is on and which devices Slurm gave it.
WHERE = ('printf \'{"where": 1, "procid": %s, "node": "%s", "cuda": "%s"}\\n\' '
         '"$SLURM_PROCID" "$SLURMD_NODENAME" "${CUDA_VISIBLE_DEVICES-}"')


def json_lines(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def probes(stdout: str) -> dict[int, dict]:
    """Probe lines by rank (exactly one per rank)."""
    lines = [d for d in json_lines(stdout) if "allreduce" in d]
    by_rank = {d["rank"]: d for d in lines}
    assert len(by_rank) == len(lines), f"duplicate ranks in {lines}"
    return by_rank


def srun(cluster, *args: str) -> list[str]:
    # --kill-on-bad-exit: one rank failing must not leave the other waiting in the rendezvous.
    return ["srun", "--time=3", "--kill-on-bad-exit=1", f"--chdir={cluster.repo_root}", *args]


def test_srun_two_tasks_rendezvous_from_slurm_variables(slurm_cluster):
    c = slurm_cluster
    res = c.run(srun(c, "-p", c.cpu_partition, "-N1", "-n2", c.python, *PROBE), timeout=180)
    ranks = probes(res.stdout)
    assert sorted(ranks) == [0, 1], res.stdout
    for rank, p in ranks.items():
        assert p["source"] == "slurm"
        assert p["world_size"] == 2
        assert p["local_rank"] == rank  # one node: local rank == global rank
        assert p["backend"] == "gloo"
        assert p["allreduce"] == 3.0  # (0 + 1) + (1 + 1)
        assert p["master_addr"] == "cpunode"  # first (only) node of the step
    assert ranks[0]["master_port"] == ranks[1]["master_port"]


def test_srun_pmix_rendezvous_from_mpi(slurm_cluster):
    c = slurm_cluster
    res = c.run(srun(c, "-p", c.cpu_partition, "--mpi=pmix", "-n2", c.python, *PROBE, "--source", "mpi"),
                timeout=180)
    ranks = probes(res.stdout)
    assert sorted(ranks) == [0, 1], res.stdout
    for p in ranks.values():
        assert p["source"] == "mpi"
        assert p["world_size"] == 2
        assert p["allreduce"] == 3.0
    assert ranks[0]["master_port"] == ranks[1]["master_port"]  # broadcast by rank 0 over MPI


# ------------------------------------------------------------------------------------------ submitit
def _square_in_job(x: int) -> dict:
    # Runs inside the Slurm job (unpickled there: the repo root is on PYTHONPATH).
    return {"value": x * x, "job_id": os.environ["SLURM_JOB_ID"], "partition": os.environ["SLURM_JOB_PARTITION"]}


def _sleep_in_job(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _executor(cluster, folder, timeout_min: int = 3):
    import submitit

    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(slurm_partition=cluster.cpu_partition, timeout_min=timeout_min, cpus_per_task=1,
                         nodes=1, tasks_per_node=1)
    return ex


def _wait_state(job, states: set[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job.watcher.update()  # submitit polls sacct at most every few seconds on its own
        state = job.state
        if any(state.startswith(s) for s in states):
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {job.job_id} still {job.state!r} after {timeout}s; wanted {states}")


def test_submitit_job_returns_its_result(slurm_cluster, tmp_path, monkeypatch):
    slurm_cluster.patch_env(monkeypatch)  # submitit calls sbatch/sacct with os.environ
    job = _executor(slurm_cluster, tmp_path / "submitit").submit(_square_in_job, 7)
    out = job.result()
    assert out == {"value": 49, "job_id": job.job_id, "partition": slurm_cluster.cpu_partition}
    # Accounting (slurmdbd) is what lets submitit see the final state.
    assert _wait_state(job, {"COMPLETED"}, timeout=30) == "COMPLETED"


def test_submitit_cancelled_job_reports_done(slurm_cluster, tmp_path, monkeypatch):
    # Without accounting a cancelled job's state stays UNKNOWN and done() never turns True.
    slurm_cluster.patch_env(monkeypatch)
    job = _executor(slurm_cluster, tmp_path / "submitit").submit(_sleep_in_job, 300)
    _wait_state(job, {"RUNNING"}, timeout=60)
    job.cancel(check=True)
    assert _wait_state(job, {"CANCELLED"}, timeout=60).startswith("CANCELLED")
    assert job.done()


# ------------------------------------------------------------------------------------- gpu partition
def test_gres_gpu_job_on_gpu_partition(slurm_cluster, tmp_path):
    c = slurm_cluster
    out = tmp_path / "gpu.out"
    res = c.run(["sbatch", "--parsable", "--wait", "--time=2", "-p", c.gpu_partition, "--gres=gpu:1",
                 "-o", str(out), "--wrap", 'echo "node=$SLURMD_NODENAME cuda=$CUDA_VISIBLE_DEVICES"'],
                timeout=120)
    job_id = res.stdout.strip().split(";")[0]
    node, cuda = out.read_text().split()
    # one GPU of the node's two, whichever is free (another job of the session may hold GPU 0)
    assert node == "node=gpunode" and cuda in ("cuda=0", "cuda=1"), (node, cuda)
    # The accounting record is completed asynchronously: poll until slurmdbd has the whole of it.
    deadline = time.monotonic() + 30
    while True:
        acct = c.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,Partition,AllocTRES"]).stdout
        state, partition, tres = (acct.strip().splitlines() or ["||"])[0].split("|")
        if partition or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (state, partition) == ("COMPLETED", c.gpu_partition)
    assert "gres/gpu=1" in tres.split(","), tres


@pytest.fixture(scope="module")
def het_step(slurm_cluster):
    """One heterogeneous srun step: component 0 on gpu (1 task, 1 GPU), component 1 on cpu (1 task)."""
    c = slurm_cluster
    cmd = srun(c, "-p", c.gpu_partition, "--gres=gpu:1", "-n1", ":", "-p", c.cpu_partition, "-n1",
               "bash", "-c", f'{WHERE}; exec "$0" "$@"', c.python, *PROBE)
    res = c.run(cmd, timeout=180)
    where = {d["procid"]: d for d in json_lines(res.stdout) if "where" in d}
    return where, probes(res.stdout), res.stdout


def test_hetjob_spans_gpu_and_cpu_partitions(het_step):
    where, ranks, stdout = het_step
    assert sorted(ranks) == [0, 1], stdout
    assert (where[0]["node"], where[0]["cuda"]) == ("gpunode", "0")
    assert (where[1]["node"], where[1]["cuda"]) == ("cpunode", "")
    for p in ranks.values():
        assert p["source"] == "slurm"
        assert p["world_size"] == 2
        assert p["local_rank"] == 0  # one task per node
        assert p["allreduce"] == 3.0
    assert ranks[0]["master_port"] == ranks[1]["master_port"]


def test_hetjob_rendezvous_is_on_rank0_node(het_step):
    # Both nodes are 127.0.0.1 here, so a wrong address still connects; on a real cluster rank 0's
    # TCPStore is only on rank 0's node. In a het step SLURM_STEP_NODELIST is the sorted union
    # ("cpunode,gpunode") while rank 0 runs in component 0 (SLURM_JOB_NODELIST_PACK_GROUP_0 in
    # Slurm 22.05, ..._HET_GROUP_0 in newer ones).
    where, ranks, _ = het_step
    for p in ranks.values():
        assert p["master_addr"] == where[0]["node"], (p, where)
