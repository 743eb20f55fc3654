"""Distributed bootstrap: find who we are (torchrun, Slurm or MPI), start torch.distributed, build the
Megatron-Core model-parallel groups once, and hand them out explicitly.

    ctx = init_distributed(ParallelConfig(tp=2, pp=2))
    model = build(..., pg_collection=ctx.pgs)   # library code receives groups, never reads globals

Launch sources, tried in this order by `source="auto"`:
  torchrun  RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set by torchrun or torch.distributed.run
  mpi       `mpirun` (OMPI_COMM_WORLD_* set): ranks from mpi4py, rank 0's host and a free port broadcast
  slurm     inside an `srun` step: SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID, the first host of the
            step's node list, a port derived from the job and step ids (see megatron_rl.slurm_env)
  mpi       `srun --mpi=pmix` without Slurm variables we trust, or PMIX_RANK / PMI_RANK only
  single    none of the above: one process on localhost
The backend is gloo on CPU and NCCL when CUDA is present (`backend="auto"`).

`python -m megatron_rl.distributed probe` initialises, all-reduces (rank + 1) and prints one JSON line per rank.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatron_rl.parallel import ParallelConfig
from megatron_rl.slurm_env import SlurmEnv, TorchrunEnv, launch_source

Source = Literal["auto", "torchrun", "slurm", "mpi", "single"]


@dataclass(frozen=True)
class LaunchInfo:
    """Who this process is in the job, and where the rendezvous is."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    master_addr: str
    """Rendezvous host (rank 0's)."""
    master_port: int
    """Rendezvous TCP port."""
    source: str
    """Which launcher the values came from: torchrun, slurm, mpi or single."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _from_torchrun(env: Mapping[str, str]) -> LaunchInfo:
    t = TorchrunEnv.from_environ(env)
    if t is None:
        raise RuntimeError("source 'torchrun' requested but RANK / WORLD_SIZE are not set; launch with torchrun")
    return LaunchInfo(t.rank, t.world_size, t.local_rank, t.master_addr, t.master_port, "torchrun")


def _from_slurm(env: Mapping[str, str]) -> LaunchInfo:
    s = SlurmEnv.from_environ(env)
    if s is None:
        raise RuntimeError("source 'slurm' requested but this process is not in a Slurm job (no SLURM_JOB_ID)")
    if not s.in_step:
        raise RuntimeError("source 'slurm' needs an srun step (SLURM_STEP_ID unset: this is the batch script; "
                           "launch the ranks with srun)")
    return LaunchInfo(s.procid, s.ntasks, s.localid, s.master_addr, s.master_port(), "slurm")


def _from_mpi() -> LaunchInfo:
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise RuntimeError("source 'mpi' needs mpi4py (pip install mpi4py against the cluster's MPI)") from e
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank).Get_rank()
    addr, port = comm.bcast((socket.gethostname(), free_port()) if rank == 0 else None, root=0)
    return LaunchInfo(rank, size, local_rank, addr, port, "mpi")


def detect_launch(source: Source = "auto", environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Rank, world size, local rank and rendezvous of this process (see the module docstring)."""
    env = os.environ if environ is None else environ
    if source == "auto":
        source = launch_source(env)
    if source == "torchrun":
        return _from_torchrun(env)
    if source == "slurm":
        return _from_slurm(env)
    if source == "mpi":
        return _from_mpi()
    if source == "single":
        return LaunchInfo(0, 1, 0, "127.0.0.1", free_port(), "single")
    raise ValueError(f"unknown launch source {source!r}; use auto, torchrun, slurm, mpi or single")


def pick_backend(backend: str = "auto") -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend 'nccl' needs CUDA; this machine has none (use gloo or auto)")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; use auto, gloo or nccl")
    return backend


def init_process_group(launch: LaunchInfo, backend: str = "auto", timeout_minutes: int = 30) -> str:
    """Start torch.distributed for `launch`; returns the backend used. A no-op if already started."""
    backend = pick_backend(backend)
    if dist.is_initialized():
        return dist.get_backend()
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=f"tcp://{launch.master_addr}:{launch.master_port}", rank=launch.rank,
        world_size=launch.world_size, timeout=datetime.timedelta(minutes=timeout_minutes))
    return backend


@dataclass
class DistContext:
    """The distributed state handed to library code: launch info, resolved layout and process groups."""

    launch: LaunchInfo
    """Who this process is."""
    parallel: ParallelConfig
    """The layout with dp resolved from the world size."""
    backend: str
    """gloo or nccl."""
    pgs: object
    """megatron.core.process_groups_config.ProcessGroupCollection of this rank."""

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def device(self) -> torch.device:
        """Where this rank's tensors and collectives live, chosen here only: its GPU under NCCL (set at the
        start from the local rank), else the CPU; `cuda:0` under the CPU device check (compat/device_check.py:
        mapped to the CPU, but collectives then refuse tensors never placed on it)."""
        return rank_device(self.backend)

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def world(self) -> dist.ProcessGroup:
        """The group of every rank of the job: the one object library code gets for job-wide collectives and
        rank-0 checks (`group_rank`, `group_leader`), never torch.distributed's implicit default group."""
        return dist.group.WORLD

    def ranks(self, group_name: str) -> list[int]:
        """Global ranks in one of this rank's groups (tp, pp, dp, cp, ep, expt_tp, expt_dp, mp, dp_cp...)."""
        return dist.get_process_group_ranks(getattr(self.pgs, group_name))

    def coordinates(self) -> dict[str, int]:
        """This rank's index inside each group."""
        return {name: dist.get_rank(getattr(self.pgs, name)) for name in ("tp", "pp", "dp", "cp", "ep")}


def world_group() -> dist.ProcessGroup | None:
    """The job's group for entry points that hold no DistContext (e.g. `megatron-rl convert`'s report): the
    default group once torch.distributed is started, else None (one process)."""
    return dist.group.WORLD if dist.is_initialized() else None


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in `group`; 0 for None (one process, torch.distributed not needed)."""
    return 0 if group is None else dist.get_rank(group)


def group_size(group: dist.ProcessGroup | None) -> int:
    """The number of ranks in `group`; 1 for None (one process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_leader(group: dist.ProcessGroup | None) -> int:
    """The global rank of `group`'s first member (the `src` of its broadcasts from "rank 0"); 0 for None."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def attach_distributed(parallel: ParallelConfig) -> DistContext:
    """DistContext of a process whose torch.distributed and Megatron groups are already started (for
    `parallel`; the caller checks the layout matches)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.get_world_size()
    launch = LaunchInfo(dist.get_rank(), world, 0, "127.0.0.1", 0, "reuse")
    return DistContext(launch, parallel.resolve(world), dist.get_backend(),
                       ProcessGroupCollection.use_mpu_process_groups())


def rank_device(backend: str) -> torch.device:
    """The device of a rank whose process group uses `backend` (see `DistContext.device`)."""
    from megatron_rl.compat import device_check

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", 0) if device_check.enabled() else torch.device("cpu")


def init_distributed(parallel: ParallelConfig | None = None, backend: str = "auto", source: Source = "auto",
                     timeout_minutes: int = 30) -> DistContext:
    """Start torch.distributed and Megatron-Core's model-parallel groups for `parallel`."""
    parallel = parallel or ParallelConfig()
    launch = detect_launch(source)
    resolved = parallel.resolve(launch.world_size)  # fail on an impossible layout before any rendezvous
    backend = init_process_group(launch, backend, timeout_minutes)
    if not torch.cuda.is_available():
        from megatron_rl.compat import cpu as cpu_compat

        cpu_compat.apply()
        from megatron_rl.compat import device_check

        device_check.install()  # MEGATRON_RL_DEVICE_CHECK=nccl: collectives refuse host tensors (debug, tests)
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    parallel_state.initialize_model_parallel(**resolved.megatron_kwargs(),
                                             distributed_timeout_minutes=timeout_minutes)
    return DistContext(launch, resolved, backend, ProcessGroupCollection.use_mpu_process_groups())


def destroy_distributed() -> None:
    """Tear down Megatron's groups and torch.distributed (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- probe
def probe(source: Source = "auto", backend: str = "auto") -> dict:
    """Initialise torch.distributed only, all-reduce (rank + 1), return what this rank saw."""
    launch = detect_launch(source)
    used = init_process_group(launch, backend, timeout_minutes=2)
    if not torch.cuda.is_available():
        from megatron_rl.compat import cpu as cpu_compat
        from megatron_rl.compat import device_check

        if device_check.requested():
            cpu_compat.apply()
            device_check.install()
    t = torch.tensor([float(launch.rank + 1)], device=rank_device(used))  # NCCL: on this rank's GPU
    dist.all_reduce(t)
    out = {**asdict(launch), "backend": used, "allreduce": t.item(), "host": socket.gethostname()}
    dist.barrier()
    dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.distributed",
                                description="Distributed bootstrap utilities.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("probe", help="initialise, all-reduce (rank+1), print one JSON line per rank")
    pr.add_argument("--source", default="auto", choices=["auto", "torchrun", "slurm", "mpi", "single"])
    pr.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = p.parse_args(argv)
    print(json.dumps(probe(args.source, args.backend)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
