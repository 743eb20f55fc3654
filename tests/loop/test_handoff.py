"""The staleness bound of the step's batch (`loop.handoff.fresh_rows`): rows whose episode started on a policy older
than the bound are dropped and counted (`dropped_stale`), the rows of a split agent episode together."""
from __future__ import annotations

import numpy as np

from megatron_rl.data.shards import Trajectory, segment_id, write_shard
from megatron_rl.data.shards.reader import read_arrays
from megatron_rl.loop.handoff import fresh_rows


def _row(eid: str, version: int) -> Trajectory:
    return Trajectory(tokens=np.array([5, 6, 7], np.int32), logprobs=np.array([0, -0.5, -1.0], np.float32),
                      loss_mask=np.array([0, 1, 1], np.uint8), prompt_len=1, reward=1.0, group_id=0,
                      policy_version_first=version, policy_version_last=version, env="countdown", task_id="t",
                      episode_id=eid)


def test_stale_rows_are_dropped_and_counted_split_episodes_together(tmp_path):
    rows = [_row("e0", 1), _row("e1", 3), _row(segment_id("e2", 0), 2), _row("e2", 4), _row("e3", 5)]
    cols = read_arrays(write_shard(tmp_path / "s.h5", rows))
    kept, dropped = fresh_rows(cols, oldest=3)  # e2 started at version 2: its later row goes with it
    assert kept.episode_id.tolist() == ["e1", "e3"] and dropped == 3
    same, none = fresh_rows(cols, oldest=1)
    assert same is cols and none == 0
