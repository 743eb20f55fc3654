"""The shard reader checks values as the writer does: a shard forged (or corrupted) after the writer's checks, with
one bad value, is quarantined by the one shard consumer (`data.consume.read_folder`, which the dispatched loop's
reader uses: its episodes count as missing) with a reason naming the field, and refused by read_shard/read_arrays
with ShardError (never another exception, never a silently wrong sample). Real HDF5 files in tmp_path, edited
with h5py."""
from __future__ import annotations

import h5py
import hdf5plugin  # noqa: F401  (the blosc filter, for the in-place edits)
import numpy as np
import pytest

from megatron_rl.data import ShardError, Trajectory, read_arrays, read_shard, write_shard
from megatron_rl.data.consume import read_folder


def _good(path, n: int = 3):
    trajs = [Trajectory(tokens=np.array([5, 6, 7, 8], np.int32), logprobs=np.array([0, 0, -0.5, -1.0], np.float32),
                        loss_mask=np.array([0, 0, 1, 1], np.uint8), prompt_len=2, reward=1.0, group_id=0,
                        policy_version_first=2, policy_version_last=3, env="countdown", task_id=f"t{i}",
                        episode_id=f"g0-s{i}", reward_components={"correct": 1.0}, timings={"total": 0.5},
                        token_versions=np.array([2, 2, 2, 3], np.int32), provenance={"verifier": "v1"})
             for i in range(n)]
    return write_shard(path, trajs, compression="none")


def _set(name: str, value, index=1):
    def edit(f: h5py.File) -> None:
        f[name][index] = value
    return edit


def _replace(name: str, make):
    def edit(f: h5py.File) -> None:
        data = make(f[name][()])
        del f[name]
        f.create_dataset(name, data=data)
    return edit


def _attr(name: str, value):
    def edit(f: h5py.File) -> None:
        f.attrs[name] = value
    return edit


def _provenance(f: h5py.File) -> None:
    f["provenance"][0] = "{not json"


BAD = {  # case -> (edit of a good shard, the field the reason must name)
    "reward_nan": (_set("reward", np.nan), "reward"),
    "reward_inf": (_set("reward", np.inf), "reward"),
    "reward_1e300": (_set("reward", 1e300), "reward"),
    "component_1e300": (_set("reward_components/correct", 1e300), "reward component"),
    "component_inf": (_set("reward_components/correct", -np.inf), "reward component"),
    "timing_inf": (_set("timing/total", np.inf), "timing"),
    "token_negative": (_set("tokens", -3, 5), "tokens"),
    "token_float": (_replace("tokens", lambda a: a.astype(np.float64) + 0.5), "tokens"),
    "token_huge": (_set("tokens", 2**31 - 1, 5), "tokens"),
    "logprob_nan": (_set("logprobs", np.nan, 6), "logprobs"),
    "logprob_positive": (_set("logprobs", 3.0, 6), "logprobs"),
    "loss_mask_200": (_set("loss_mask", 200, 6), "loss_mask"),
    "loss_mask_int": (_replace("loss_mask", lambda a: a.astype(np.int64) - 1), "loss_mask"),
    "version_2e62": (_set("policy_version_last", 2**62), "policy_version_last"),
    "version_float": (_replace("policy_version_last", lambda a: a.astype(np.float64)), "policy_version_last"),
    "token_version_huge": (_set("token_versions", 2**31 - 1, 6), "token_versions"),
    "offsets_not_monotonic": (_set("offsets", 9, 1), "offsets"),
    "offsets_float": (_replace("offsets", lambda a: a.astype(np.float64)), "offsets"),
    "prompt_len_past_end": (_set("prompt_len", 99), "prompt_len"),
    "status_unknown": (_set("status", "great"), "status"),
    "provenance_not_json": (_provenance, "provenance"),
    "schema_version_float": (_attr("schema_version", 1.5), "schema_version"),
    "schema_version_text": (_attr("schema_version", "1"), "schema_version"),
    "schema_version_unknown": (_attr("schema_version", 0), "schema_version"),
}


def _forged(tmp_path, case: str):
    path = _good(tmp_path / f"{case}.h5")
    edit, field = BAD[case]
    with h5py.File(path, "r+", locking=False) as f:
        edit(f)
    return path, field


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_shard_with_a_bad_value_is_quarantined_with_the_field_named(tmp_path, case):
    path, field = _forged(tmp_path, case)
    _good(tmp_path / "zz-good.h5")  # reading continues after it
    got = read_folder(tmp_path)
    assert got.shards == 1 and len(got.trajectories) == 3 and len(got.quarantined) == 1 and not path.exists()
    reason = (tmp_path / "quarantine" / f"{path.name}.reason.txt").read_text().splitlines()[2]
    assert reason.startswith(("error: ShardError", "error: ShardSchemaError")) and field in reason, reason


@pytest.mark.parametrize("case", sorted(BAD))
def test_every_reader_refuses_a_bad_value_with_shard_error(tmp_path, case):
    from megatron_rl.data import ShardReader
    from megatron_rl.loop.dispatched import read_episodes

    path, field = _forged(tmp_path, case)
    for read in (read_shard, read_arrays):
        with pytest.raises(ShardError, match=field):
            read(path)
    try:  # random access checks the same values (a reader that opens at all)
        with ShardReader(path) as r:
            r[1]
    except ShardError as e:
        assert field in str(e) or "offsets" in str(e)
    else:
        assert case in ("token_negative", "token_huge", "logprob_nan", "logprob_positive", "loss_mask_200",
                        "token_version_huge", "provenance_not_json"), f"{case}: sample 1 read without complaint"
    skipped: list[str] = []
    assert read_episodes(tmp_path, {"g0-s0", "g0-s1", "g0-s2"}, skipped) == {}
    assert len(skipped) == 1 and field in skipped[0]


def test_token_ids_are_checked_against_the_vocabulary_when_known(tmp_path):
    path = _good(tmp_path / "a.h5")
    assert len(read_arrays(path, vocab_size=9)) == 3
    with pytest.raises(ShardError, match=r"tokens must be ids in \[0, 7\] \(vocabulary of 8\)"):
        read_arrays(path, vocab_size=8)
    assert len(read_folder(tmp_path, vocab_size=9).trajectories) == 3
    got = read_folder(tmp_path, vocab_size=8)
    assert got.trajectories == [] and len(got.quarantined) == 1 and "vocabulary of 8" in got.quarantined[0]


def test_the_writer_refuses_the_same_values(tmp_path):
    from megatron_rl.data import TrajectoryError

    base = dict(logprobs=np.zeros(2, np.float32), loss_mask=np.array([0, 1], np.uint8), prompt_len=1, group_id=0,
                policy_version_first=0, env="e", task_id="t", episode_id="x")
    bad = [dict(tokens=[1, -2], reward=0.0, policy_version_last=0), dict(tokens=[1, 2], reward=1e300,
                                                                        policy_version_last=0),
           dict(tokens=[1, 2], reward=0.0, policy_version_last=2**62),
           dict(tokens=[1, 2], reward=0.0, policy_version_last=0, reward_components={"c": 1e300})]
    for over in bad:
        with pytest.raises(TrajectoryError):
            Trajectory(**base, **over)
