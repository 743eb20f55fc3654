"""The step's shard hand-off: the batch's trajectories written as one HDF5 shard (rank 0) and read back on
every rank, within the staleness bound (the trainer's input)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from megatron_rl.loop.job import Job


def to_shard(job: Job, rollouts, groups: list, step: int, run_dir: Path):
    """Write the step's trajectories as an HDF5 shard (rank 0) and read it back on every rank, keeping samples
    within the staleness bound: (columns, or None when the batch is empty; samples dropped as stale)."""
    from megatron_rl.data.shards import read_arrays, write_shard

    trajs = rollouts.trajectories(groups, tag=f"s{step}")
    path = Path(run_dir) / "rl_shards" / f"step-{step:06d}.h5"
    if trajs and job.is_rank0:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_shard(path, trajs)
    torch.distributed.barrier(group=job.ctx.world)
    if not trajs:
        return None, 0
    return fresh_rows(read_arrays(path), oldest=step - job.cfg.rl.max_staleness)


def fresh_rows(cols, oldest: int):
    """(the rows of `cols` whose episode's first policy version is >= `oldest`, how many were dropped): the rows of
    a split agent episode are kept or dropped together."""
    episode = cols.episode_index()  # [N]
    first = np.full(int(episode.max()) + 1, np.iinfo(np.int64).max)
    np.minimum.at(first, episode, np.asarray(cols.policy_version_first, np.int64))
    fresh = first[episode] >= oldest
    return (cols, 0) if fresh.all() else (cols.select(np.flatnonzero(fresh)), int((~fresh).sum()))
