"""The one launcher: start a command's ranks on this machine with torchrun, or run the rank in-process when a
launcher (torchrun, srun, mpirun) already started this process as one of the job's ranks.

Used by `train`, `eval` and `tools/convert`; each passes its own thread count (behaviour of each unchanged)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from megatron_rl.slurm_env import under_launcher


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """`python -m torch.distributed.run` on one node, a free local port, `nproc` ranks each running `argv`."""
    from megatron_rl.distributed import free_port

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", *argv]


def rank_env(threads: int | str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with OMP_NUM_THREADS=threads (and `extra`) for the ranks torchrun starts."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), **(extra or {})}


def run_ranks(argv: list[str], nproc: int, threads: int | str) -> int:
    """Run `python argv` as this machine's ranks: in-process rank when already under a launcher, else `nproc`
    ranks under torchrun with OMP_NUM_THREADS=threads. Returns the exit code (3: stopped by a signal)."""
    if under_launcher():
        return call([sys.executable, *argv], None)
    return call(torchrun_command(nproc, argv), rank_env(threads))


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
