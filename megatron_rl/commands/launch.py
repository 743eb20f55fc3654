"""The one launcher: start a command's ranks on this machine with torchrun, or run the rank in-process when a
launcher (torchrun, srun, mpirun) already started this process as one of the job's ranks.

Used by `train`, `eval` and `tools/convert`: `torchrun_launch` builds the command and the ranks' environment,
`rank_threads` decides their thread count (the one place of the thread defaults)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

from megatron_rl.slurm_env import under_launcher

if TYPE_CHECKING:
    from megatron_rl.run_config import LaunchConfig


def rank_threads(launch: LaunchConfig | None = None) -> int:
    """Torch intra-op threads (OMP_NUM_THREADS) of each rank. With the run's `launch` (train):
    launch.threads_per_rank, else $OMP_NUM_THREADS, else this machine's cores shared among launch.nproc_per_node
    ranks. Without (eval, convert: short jobs beside a run): $OMP_NUM_THREADS, else 1."""
    if launch is not None and launch.threads_per_rank:
        return launch.threads_per_rank
    if os.environ.get("OMP_NUM_THREADS"):
        return int(os.environ["OMP_NUM_THREADS"])
    return 1 if launch is None else max(1, len(os.sched_getaffinity(0)) // launch.nproc_per_node)


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """`python -m torch.distributed.run --standalone`: one node, `nproc` ranks each running `argv`. torchrun's
    own store binds a free port itself; a port picked here and handed over (`--master_port`) could be taken by
    another process before torchrun binds it (EADDRINUSE on a loaded machine)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv]


def torchrun_launch(argv: list[str], nproc: int, launch: LaunchConfig | None = None,
                    extra: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The torchrun command of `nproc` ranks each running `python argv`, and their environment: this process's
    with OMP_NUM_THREADS=rank_threads(launch) and `extra`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(rank_threads(launch)), **(extra or {})}
    return torchrun_command(nproc, argv), env


def run_ranks(argv: list[str], nproc: int, launch: LaunchConfig | None = None) -> int:
    """Run `python argv` as this machine's ranks: in-process rank when already under a launcher, else `nproc`
    ranks under torchrun (`torchrun_launch`). Returns the exit code (3: stopped by a signal)."""
    if under_launcher():
        return call([sys.executable, *argv], None)
    return call(*torchrun_launch(argv, nproc, launch))


def call(cmd: list[str], env) -> int:
    """Run the ranks; SIGTERM/SIGUSR1 sent to this process go to the ranks themselves (torchrun's children),
    which checkpoint and stop after the current step (exit 3). torchrun is not signalled: it would kill the
    ranks after a short grace period."""
    import psutil

    proc = subprocess.Popen(cmd, env=env)
    stopped = []

    def forward(signum, _frame):
        stopped.append(signum)
        ranks = [proc] if cmd[1] != "-m" or cmd[2] != "torch.distributed.run" else \
            psutil.Process(proc.pid).children(recursive=False)
        for p in ranks:
            p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, forward)
    rc = proc.wait()
    return 3 if stopped and rc != 0 else rc
