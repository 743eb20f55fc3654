"""The one launcher: start a command's ranks on this machine, or run the rank in-process when a launcher
(torchrun, srun, mpirun) already started this process as one of the job's ranks.

Used by `train`, `eval` and `tools/convert`: `rank_env` builds the ranks' environment, `rank_threads` decides
their thread count (the one place of the thread defaults), `LocalRanks` starts and watches them; `run_here` runs
a single rank in the calling process (`megatron-rl train` with one rank)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

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


def rank_env(launch: LaunchConfig | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The ranks' environment: this process's with OMP_NUM_THREADS=rank_threads(launch) and `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": str(rank_threads(launch)), **(extra or {})}


def run_ranks(argv: list[str], nproc: int, launch: LaunchConfig | None = None,
              extra: dict[str, str] | None = None) -> int:
    """Run `python argv` as this machine's ranks: one plain process when already under a launcher (it is that
    job's rank), else `nproc` local ranks (`LocalRanks`). Returns the exit code (3: stopped by a signal)."""
    if under_launcher():
        return LocalRanks(argv, 1, None).run()
    return LocalRanks(argv, nproc, rank_env(launch, extra)).run()


class LocalRanks:
    """What `torchrun --standalone` did, without its agent process (a Python start and a torch import, ~3.5
    CPU-s per launch): this process hosts the rendezvous store (a TCPStore on a port the kernel picks when it
    binds: no port handed over that another process could take first), starts `nproc` ranks of
    `python argv` with torchrun's variables (so `init_process_group` over env:// or tcp:// joins this store
    exactly as under torchrun), forwards SIGTERM/SIGUSR1 to them (they checkpoint and stop, exit 3), and when a
    rank fails unasked, stops the others as torchrun does (SIGTERM, SIGKILL after `grace_s`; after a forwarded
    stop signal, ranks still saving their checkpoint get 10 x `grace_s`).

    nproc=1 with env=None runs one plain process with this environment (a rank of an outer launcher)."""

    def __init__(self, argv: list[str], nproc: int, env: dict[str, str] | None,
                 stdout: IO | None = None, stderr: IO | None = None, grace_s: float = 30.0):
        self.argv, self.nproc, self.env, self.grace_s = list(argv), nproc, env, grace_s
        self.stdout, self.stderr = stdout, stderr
        self.procs: list[subprocess.Popen] = []
        self.stopped: list[int] = []  # signals forwarded
        self.store = None

    def start(self) -> LocalRanks:
        if self.env is None:  # under an outer launcher: its variables are this process's
            self.procs = [subprocess.Popen([sys.executable, *self.argv], stdout=self.stdout, stderr=self.stderr)]
            return self
        self.store = rendezvous_store()
        for rank in range(self.nproc):
            env = {**self.env, **torchrun_vars(rank, self.nproc, self.store.port)}
            self.procs.append(subprocess.Popen([sys.executable, *self.argv], env=env, stdout=self.stdout,
                                               stderr=self.stderr))
        return self

    def signal(self, signum: int) -> None:
        """Forward `signum` to every live rank (SIGTERM/SIGUSR1: checkpoint and stop after the current step)."""
        self.stopped.append(signum)
        self._send(signum)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for every rank; returns 0, 3 (stopped by a forwarded signal), or the exit code of the first rank
        that failed (128 + N for a rank killed by signal N). `timeout`: kill them all and raise
        subprocess.TimeoutExpired."""
        deadline = None if timeout is None else time.monotonic() + timeout
        first, kill_at = None, None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed and kill_at is None:  # asked to stop, the others may still be saving: a longer grace
                first, kill_at = failed[0], now + self.grace_s * (10 if self.stopped else 1)
                if not self.stopped:
                    print(f"megatron-rl launch: rank {first[0]} exited with {first[1]}; stopping the other ranks",
                          file=sys.stderr, flush=True)
                    self._send(signal.SIGTERM)
            if kill_at is not None and now > kill_at:
                self._send(signal.SIGKILL)
            if deadline is not None and now > deadline:
                self.kill()
                raise subprocess.TimeoutExpired(self.argv, timeout)
            time.sleep(0.1)
        self.close()
        if first is None:
            first = next(((r, c) for r, c in enumerate(codes) if c), (0, 0))
        rc = first[1] if first[1] >= 0 else 128 - first[1]
        return 3 if self.stopped and rc != 0 else rc

    def _send(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def kill(self) -> None:
        self._send(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.close()

    def close(self) -> None:
        self.store = None  # the rendezvous store's server stops with its last reference

    def run(self) -> int:
        """start + wait, with SIGTERM/SIGUSR1 of this process forwarded to the ranks (the main thread's handlers
        are restored after). The ranks are signalled, not an agent: one would kill them after a grace period."""
        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, lambda signum, _f: self.signal(signum)) for s in (signal.SIGTERM, signal.SIGUSR1)} \
            if main else {}
        try:
            self.start()
            return self.wait()
        except BaseException:  # a failed start or an interrupt: no rank outlives its launcher
            self.kill()
            raise
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def rendezvous_store():
    """The job's rendezvous store, served by this process on a port the kernel picks as it binds (the ranks
    import torch anyway; so did torchrun's agent)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)


def torchrun_vars(rank: int, nproc: int, port: int) -> dict[str, str]:
    """torchrun's variables for `rank` of `nproc` local ranks; TORCHELASTIC_USE_AGENT_STORE makes every rank a
    client of the store on `port` that the launching process hosts (torch.distributed.rendezvous)."""
    n = str(nproc)
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": n, "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def run_here(rank_fn: Callable[[], int], launch: LaunchConfig | None = None) -> int:
    """One rank in this process: what `LocalRanks` with one rank would run, without a second interpreter that
    imports torch and Megatron again (~3.5 CPU-s a launch). For the duration of `rank_fn()` the process has the
    rank's environment (torchrun's variables pointing at a store served here, OMP_NUM_THREADS and torch's thread
    count from `rank_threads(launch)`); signal handlers, environment and thread count are restored after. An
    exception is printed and gives exit 1, as a failed rank process would."""
    import torch

    store = rendezvous_store()
    env = {"OMP_NUM_THREADS": str(rank_threads(launch)), **torchrun_vars(0, 1, store.port)}
    saved_env, threads = {k: os.environ.get(k) for k in env}, torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        return rank_fn()
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            signal.signal(s, h)
        del store
