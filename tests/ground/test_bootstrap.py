"""Launch detection (torchrun / Slurm / MPI / single) and the Slurm environment reader, in one process."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.distributed import detect_launch, pick_backend
from megatron_rl.slurm_env import SlurmEnv, expand_hostlist, launch_source, under_launcher


@pytest.mark.parametrize("spec, hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[1-2],b3,c[9-10]", ["a1", "a2", "b3", "c9", "c10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["gpu[01-03", "gpu01]", "gpu[a-b]"])
def test_expand_hostlist_rejects_malformed(spec):
    with pytest.raises(ValueError, match="malformed Slurm hostlist"):
        expand_hostlist(spec)


SLURM_STEP = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
              "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
              "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[07-10]",
              "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_RESTART_COUNT": "2"}


def test_slurm_env_reads_a_step():
    s = SlurmEnv.from_environ(SLURM_STEP)
    assert (s.procid, s.ntasks, s.localid, s.nodeid, s.restart_count) == (3, 4, 1, 1, 2)
    assert s.nodelist == ["gpu07", "gpu08"] and s.master_addr == "gpu07" and s.in_step
    assert s.master_port() == SlurmEnv.from_environ({**SLURM_STEP, "SLURM_PROCID": "0"}).master_port()
    assert s.master_port() != SlurmEnv.from_environ({**SLURM_STEP, "SLURM_STEP_ID": "1"}).master_port()
    assert SlurmEnv.from_environ({}) is None


def test_the_derived_port_stays_below_the_kernels_ephemeral_ports_and_apart_between_jobs():
    """The rendezvous port of a Slurm step is never one the kernel hands to an outgoing connection or a bind to
    port 0 (Linux's default ip_local_port_range starts at 32768): such a socket on the node once held it and the
    job failed with EADDRINUSE. Consecutive jobs on a node get different ports."""
    ports = [SlurmEnv.from_environ({**SLURM_STEP, "SLURM_JOB_ID": str(j)}).master_port()
             for j in range(47549000, 47549000 + 5000)]
    assert all(20000 <= p < 32768 for p in ports), (min(ports), max(ports))
    assert len(set(ports)) == len(ports)
    array = SlurmEnv.from_environ({**SLURM_STEP, "SLURM_JOB_ID": "47549516_3"}).master_port()
    assert 20000 <= array < 32768


def test_detect_launch_from_each_source():
    li = detect_launch("auto", SLURM_STEP)
    assert (li.source, li.rank, li.world_size, li.local_rank, li.master_addr) == ("slurm", 3, 4, 1, "gpu07")
    tr = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "123"}
    assert detect_launch("auto", {**SLURM_STEP, **tr}).source == "torchrun"  # torchrun inside srun wins
    assert launch_source({**SLURM_STEP, "OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"  # mpirun inside sbatch
    assert launch_source({"PMIX_RANK": "0"}) == "mpi"
    assert under_launcher(SLURM_STEP) and under_launcher(tr) and under_launcher({"OMPI_COMM_WORLD_SIZE": "2"})
    batch_script = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"}  # sbatch itself: not a rank
    assert not under_launcher(batch_script) and not under_launcher({})
    single = detect_launch("auto", {})
    assert (single.source, single.rank, single.world_size) == ("single", 0, 1)


def test_detect_launch_errors_name_the_fix():
    with pytest.raises(RuntimeError, match="launch the ranks with srun"):
        detect_launch("slurm", {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0"})
    with pytest.raises(RuntimeError, match="not in a Slurm job"):
        detect_launch("slurm", {})
    with pytest.raises(RuntimeError, match="RANK / WORLD_SIZE are not set; launch with torchrun"):
        detect_launch("torchrun", {})
    with pytest.raises(ValueError, match="unknown launch source 'pbs'"):
        detect_launch("pbs", {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choice; this machine has CUDA")
def test_backend_choice_on_cpu():
    assert pick_backend("auto") == "gloo"
    with pytest.raises(RuntimeError, match="backend 'nccl' needs CUDA"):
        pick_backend("nccl")


def test_het_step_rendezvous_is_component_0():
    env = {**SLURM_STEP, "SLURM_STEP_NODELIST": "cpunode,gpunode", "SLURM_JOB_NODELIST_PACK_GROUP_0": "gpunode"}
    s = SlurmEnv.from_environ(env)
    assert s.master_addr == "gpunode" and s.nodelist == ["gpunode", "cpunode"]
    env = {**SLURM_STEP, "SLURM_STEP_NODELIST": "a[1-3]", "SLURM_JOB_NODELIST_HET_GROUP_0": "a[2-3]"}
    assert SlurmEnv.from_environ(env).nodelist == ["a2", "a3", "a1"]
