"""The one place that reads Slurm's and the launchers' environment variables.

Everything else asks `SlurmEnv.from_environ()`, `TorchrunEnv.from_environ()` or `launch_source()`; nothing else in
the library reads `SLURM_*`, torchrun's `RANK`/`WORLD_SIZE`/`MASTER_*` or MPI's `OMPI_*`/`PMI*_RANK`.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm hostlist: 'gpu[01-03,07],cpu1' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu1']."""
    hosts: list[str] = []
    for part in _split_top_level(spec.strip()):
        hosts += _expand_one(part)
    return hosts


def _split_top_level(spec: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in spec:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            raise ValueError(f"malformed Slurm hostlist {spec!r}: unbalanced ']'")
        cur += ch
    if depth:
        raise ValueError(f"malformed Slurm hostlist {spec!r}: unbalanced '['")
    if cur:
        parts.append(cur)
    return [p for p in parts if p]


def _expand_one(part: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", part)
    if not m:
        return [part]
    head, tail = part[: m.start()], part[m.end():]
    out = []
    for rng in m.group(1).split(","):
        lo, _, hi = rng.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"malformed Slurm hostlist range {rng!r} in {part!r}")
        width = len(lo)
        for i in range(int(lo), int(hi or lo) + 1):
            out += _expand_one(f"{head}{i:0{width}d}{tail}")
    return out


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    value = env.get(key)
    if value in (None, ""):
        return default
    m = re.match(r"\d+", value)  # e.g. SLURM_TASKS_PER_NODE="2(x3)", SLURM_CPUS_ON_NODE="8"
    return int(m.group(0)) if m else default


@dataclass(frozen=True)
class SlurmEnv:
    """What Slurm tells a process about its job and step."""

    job_id: str
    """SLURM_JOB_ID (for an array task, its own id)."""
    procid: int
    """SLURM_PROCID: global rank of this task in the step (0 in a batch script)."""
    ntasks: int
    """Number of tasks in the step (SLURM_STEP_NUM_TASKS, else SLURM_NTASKS, else 1)."""
    localid: int
    """SLURM_LOCALID: rank of this task on its node."""
    nodeid: int
    """SLURM_NODEID: index of this node in the step."""
    nodelist: list[str] = field(default_factory=list)
    """Hosts of the step (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST), expanded."""
    in_step: bool = False
    """True inside an srun step (SLURM_STEP_ID is set), False in the batch script itself."""
    step_id: int = 0
    """SLURM_STEP_ID (0 outside a step)."""
    cpus_per_task: int | None = None
    """SLURM_CPUS_PER_TASK when set."""
    array_job_id: str | None = None
    """SLURM_ARRAY_JOB_ID for array tasks."""
    array_task_id: int | None = None
    """SLURM_ARRAY_TASK_ID for array tasks."""
    restart_count: int = 0
    """SLURM_RESTART_COUNT: how many times this job was requeued."""
    het_job_id: str | None = None
    """SLURM_HET_JOB_ID for components of a heterogeneous job."""
    submit_dir: str | None = None
    """SLURM_SUBMIT_DIR."""
    job_name: str | None = None
    """SLURM_JOB_NAME."""
    partition: str | None = None
    """SLURM_JOB_PARTITION."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SlurmEnv | None:
        """The Slurm view of this process, or None outside a Slurm job."""
        env = os.environ if environ is None else environ
        if "SLURM_JOB_ID" not in env:
            return None
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        # A heterogeneous step lists the sorted union of its components' nodes, but rank 0 runs in component 0:
        # its nodes come first (HET_GROUP in newer Slurm, PACK_GROUP in 22.05 and in `srun ... : ...` steps).
        het0 = env.get("SLURM_JOB_NODELIST_HET_GROUP_0") or env.get("SLURM_JOB_NODELIST_PACK_GROUP_0")
        if het0:
            first = expand_hostlist(het0)
            nodes = ",".join(first + [h for h in expand_hostlist(nodes) if h not in first]) if nodes else het0
        array_task = _int(env, "SLURM_ARRAY_TASK_ID")
        return cls(
            job_id=env["SLURM_JOB_ID"],
            procid=_int(env, "SLURM_PROCID", 0),
            ntasks=_int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS", 1),
            localid=_int(env, "SLURM_LOCALID", 0),
            nodeid=_int(env, "SLURM_NODEID", 0),
            nodelist=expand_hostlist(nodes) if nodes else [],
            in_step="SLURM_STEP_ID" in env,
            step_id=_int(env, "SLURM_STEP_ID", 0),
            cpus_per_task=_int(env, "SLURM_CPUS_PER_TASK"),
            array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
            array_task_id=array_task,
            restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
            het_job_id=env.get("SLURM_HET_JOB_ID"),
            submit_dir=env.get("SLURM_SUBMIT_DIR"),
            job_name=env.get("SLURM_JOB_NAME"),
            partition=env.get("SLURM_JOB_PARTITION"),
        )

    @property
    def master_addr(self) -> str:
        """First host of the step: the rendezvous address for torch.distributed."""
        if not self.nodelist:
            raise RuntimeError("Slurm gave no node list (SLURM_STEP_NODELIST / SLURM_JOB_NODELIST)")
        return self.nodelist[0]

    def master_port(self, base: int = 20000, span: int = 12000) -> int:
        """A port derived from the job and step ids, so every task of a step picks the same one unasked.

        In [20000, 32000): below Linux's ephemeral range (ip_local_port_range, 32768-60999 by default), from
        which the kernel takes the local port of every outgoing connection and of every bind to port 0 on the
        node. A derived port inside that range was once held by such a socket (EADDRINUSE at the rendezvous,
        a job lost). Two jobs on one node share a port only when their ids are equal modulo `span`."""
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return base + (int(digits) * 31 + self.step_id) % span


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Every variable torchrun sets for its ranks (removed from the environment of a process a rank starts)."""


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun (torch.distributed.run) tells each rank it starts."""

    rank: int
    """RANK: global rank."""
    world_size: int
    """WORLD_SIZE: number of ranks."""
    local_rank: int = 0
    """LOCAL_RANK: rank on this node."""
    master_addr: str = "127.0.0.1"
    """MASTER_ADDR: rendezvous host."""
    master_port: int = 29500
    """MASTER_PORT: rendezvous port."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
        """torchrun's view of this process, or None when RANK / WORLD_SIZE are not both set."""
        env = os.environ if environ is None else environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                   env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)))


def launch_source(environ: Mapping[str, str] | None = None) -> str:
    """Which launcher started this process: torchrun, mpi, slurm (an srun step) or single (none)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in env:  # mpirun (inside sbatch too: SLURM_PROCID would be orted's, not ours)
        return "mpi"
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return "slurm"
    if "PMIX_RANK" in env or "PMI_RANK" in env:
        return "mpi"
    return "single"


def submitit_local_task(environ: Mapping[str, str] | None = None) -> bool:
    """True in a task that submitit's local executor started (SUBMITIT_EXECUTOR=local): its parent is submitit's
    local controller, not Slurm."""
    env = os.environ if environ is None else environ
    return env.get("SUBMITIT_EXECUTOR") == "local"


def under_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True when a launcher (torchrun, srun, mpirun) already started this process as one of the job's ranks, so a
    command runs its rank in-process instead of starting torchrun itself."""
    return launch_source(environ) != "single"
