"""ShardPublisher: a rollout worker's finished episodes into shards under names no retry reuses, through the run's
trajectory store."""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from pathlib import Path

from megatron_rl.dispatch.spec import WorkerSpec
from megatron_rl.slurm_env import SlurmEnv

log = logging.getLogger(__name__)


class ShardPublisher:
    """Buffers finished trajectories and publishes them as shards with unique per-attempt names.

    `freeze()` (on checkpoint/preemption) publishes what is buffered and then refuses more, so nothing is
    published after the caller decided which episodes are left to do.
    """

    def __init__(self, shard_dir: str | Path, stem: str, every: int, store=None):
        """store: where shards go (`data.store`: the worker config's; None = the shared filesystem)."""
        from megatron_rl.data.store import FsStore

        self.dir, self.stem, self.every = Path(shard_dir), stem, every
        self.store = store if store is not None else FsStore()
        self.store.prepare(self.dir)
        self._buf: list = []
        self._lock = threading.Lock()
        self._frozen = False
        self.published_ids: list[str] = []
        self.shards: list[str] = []

    def add(self, *trajs) -> None:
        """Buffer the rows of one episode (published together)."""
        with self._lock:
            if self._frozen:
                return
            self._buf.extend(trajs)
            if self.every and len(self._buf) >= self.every:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            if not self._frozen:
                self._flush_locked()

    def freeze(self) -> list[str]:
        with self._lock:
            if not self._frozen:
                self._flush_locked()
            self._frozen = True
            return list(self.published_ids)

    def discard(self) -> list[str]:
        """Drop what is buffered and refuse more (the lease was revoked); returns what was published before."""
        with self._lock:
            self._buf, self._frozen = [], True
            return list(self.published_ids)

    def _flush_locked(self) -> None:
        if not self._buf:
            return
        name = f"{self.stem}-p{len(self.shards):03d}-{uuid.uuid4().hex[:8]}.h5"
        self.store.publish(self.dir, name, self._buf)
        self.published_ids += [t.episode_id for t in self._buf]
        self.shards.append(name)
        self._buf = []


def _shard_stem(spec: WorkerSpec, rank: int) -> str:
    senv = SlurmEnv.from_environ()
    try:
        import submitit

        job = submitit.JobEnvironment().job_id
    except Exception:  # not inside a submitit job
        job = senv.job_id if senv else f"{socket.gethostname()}.{os.getpid()}"
        if senv and senv.array_task_id is not None:
            job = f"{senv.array_job_id}_{senv.array_task_id}"
    restart = senv.restart_count if senv else 0
    return f"{spec.shard_prefix}-r{spec.round}-j{job}-q{restart}-k{rank}"
