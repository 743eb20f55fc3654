"""`data.prefetch.ShardPrefetch` on real shard files (the fetch copies a local shard, as a GET would write it; the
real object store and queue are in test_trajectory_store.py): a taken shard is the shard, its memory released;
the bound holds; failures, other checksums and odd announcements leave the read to fetch it itself."""
from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.data.prefetch import ShardPrefetch, columns_bytes
from megatron_rl.data.shards import ShardError, Trajectory, read_arrays, read_shard, rows_of, write_shard


def traj(eid: str, n: int = 8, top: int = 100) -> Trajectory:
    """n tokens below `top`, repeating (a shard of many tokens is small as an object, large parsed)."""
    return Trajectory(tokens=(np.arange(n) * 7919 % top).astype(np.int32), logprobs=np.full(n, -0.5, np.float32),
                      loss_mask=np.ones(n, np.uint8), prompt_len=0, reward=1.0, group_id=0, policy_version_first=0,
                      policy_version_last=0, env="countdown", task_id="t", episode_id=eid, status="ok")


class Bucket:
    """Shards written under tmp_path, keyed like objects; `fetch` copies one (as a GET writes it) and checks its
    sha256, as the s3 store's fetch does; `gate` (when set) holds every fetch until it is set."""

    def __init__(self, root: Path):
        self.root, self.files, self.fetched, self.gate = root, {}, [], None

    def put(self, key: str, trajs) -> dict:
        path = write_shard(self.root / key.replace("/", "_"), trajs)
        self.files[key] = path
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        return {"key": key, "folder": key.rsplit("/", 1)[0] + "/", "sha256": sha, "bytes": path.stat().st_size}

    def fetch(self, key: str, path: Path, sha: str) -> None:
        if self.gate is not None:
            self.gate.wait(30)
        self.fetched.append(key)
        shutil.copyfile(self.files[key], path)
        if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            raise ShardError(f"{key}: sha256 differs")


def settle(pre: ShardPrefetch) -> None:
    for shard in list(pre.held.values()):
        shard.future.result(30)


def test_a_taken_shard_is_the_shard_read_from_its_file_and_its_memory_is_released(tmp_path):
    bucket = Bucket(tmp_path)
    pre = ShardPrefetch(bucket.fetch, at_once=2, max_bytes=64 << 20, spool_dir=str(tmp_path / "spool"))
    (tmp_path / "spool").mkdir()
    try:
        notes = [bucket.put(f"run/rl/b0/s{i}.h5", [traj(f"e{i}a"), traj(f"e{i}b", n=30)]) for i in range(3)]
        for note in notes:
            pre.offer(note)
        settle(pre)
        assert pre.bytes == sum(columns_bytes(read_arrays(bucket.files[n["key"]])) for n in notes) > 0
        for note in notes:
            cols = pre.take(note["key"], note["folder"], note["sha256"])
            want = read_shard(bucket.files[note["key"]])
            got = rows_of(cols, note["key"])
            assert [t.episode_id for t in got] == [t.episode_id for t in want]
            assert all(np.array_equal(a.tokens, b.tokens) and np.array_equal(a.logprobs, b.logprobs)
                       for a, b in zip(got, want))
        assert pre.bytes == 0 and not pre.held  # released as taken
        assert pre.counts["hits"] == 3 and pre.counts["misses"] == 0
        assert pre.take(notes[0]["key"], notes[0]["folder"], notes[0]["sha256"]) is None  # taken once
        pre.offer(notes[0])  # a late duplicate announcement of a shard already read: not fetched again
        assert sorted(bucket.fetched) == sorted(n["key"] for n in notes)
        assert not list((tmp_path / "spool").iterdir())  # spool files removed at once
    finally:
        pre.close()


def test_the_callers_bounds_still_apply_to_a_prefetched_shard(tmp_path):
    bucket = Bucket(tmp_path)
    pre = ShardPrefetch(bucket.fetch, at_once=1, max_bytes=64 << 20)
    try:
        note = bucket.put("run/rl/b0/s.h5", [traj("e", top=100)])
        pre.offer(note)
        settle(pre)
        cols = pre.take(note["key"], note["folder"], note["sha256"])
        assert len(rows_of(cols, "s.h5", vocab_size=100)) == 1
        with pytest.raises(ShardError, match="s.h5: invalid values"):  # as read_shard(vocab_size=10) refuses it
            rows_of(cols, "s.h5", vocab_size=10)
        with pytest.raises(ShardError):
            read_shard(bucket.files[note["key"]], vocab_size=10)
    finally:
        pre.close()


def test_the_bound_holds_and_unread_shards_of_a_read_folder_make_room(tmp_path):
    bucket = Bucket(tmp_path)
    bucket.put("probe/p.h5", [traj("p0", n=20000)])
    one = columns_bytes(read_arrays(bucket.files["probe/p.h5"]))  # each shard below holds as much parsed
    assert bucket.files["probe/p.h5"].stat().st_size < one / 2  # and less as an object (admitted, then dropped)
    pre = ShardPrefetch(bucket.fetch, at_once=1, max_bytes=int(2.5 * one))
    try:
        b0 = [bucket.put(f"run/rl/b0/s{i}.h5", [traj(f"a{i}", n=20000)]) for i in range(4)]
        for note in b0:
            pre.offer(note)
            settle(pre)
            assert pre.bytes <= pre.max_bytes
        assert pre.counts["full"] == 2 and len(pre.held) == 2  # two fit, two do not (fetched by the read)
        assert pre.counts["announced"] == 4 and pre.counts["offered"] == 4  # each admitted; two dropped once parsed
        assert pre.counts["peak_bytes"] <= pre.max_bytes
        assert pre.take(b0[0]["key"], b0[0]["folder"], b0[0]["sha256"]) is not None  # b0 is being read ...
        assert pre.take(b0[2]["key"], b0[2]["folder"], b0[2]["sha256"]) is None  # (not held: the read GETs it)
        b1 = [bucket.put(f"run/rl/b1/s{i}.h5", [traj(f"b{i}", n=20000)]) for i in range(2)]
        for note in b1:  # ... so its unread s1 (a late copy it will not ask for) makes room for b1's shards
            pre.offer(note)
            settle(pre)
        assert pre.counts["evicted"] == 1 and sorted(pre.held) == [n["key"] for n in b1]
        assert pre.counts["peak_bytes"] <= pre.max_bytes and pre.bytes == 2 * one
    finally:
        pre.close()


def test_a_failed_fetch_another_checksum_or_an_odd_announcement_leave_the_read_to_fetch_it(tmp_path):
    bucket = Bucket(tmp_path)
    pre = ShardPrefetch(bucket.fetch, at_once=2, max_bytes=64 << 20)
    try:
        bad = bucket.put("run/rl/b0/bad.h5", [traj("x")])
        pre.offer({**bad, "sha256": "0" * 64})  # the object is not what this announcement says: fetch fails
        good = bucket.put("run/rl/b0/good.h5", [traj("y")])
        pre.offer(good)
        for odd in ({"key": "run/rl/b0/good2.h5"}, {"key": "k", "folder": "f", "sha256": "s", "bytes": "many"}):
            pre.offer(odd)  # ignored (a duplicate publish by hand, a foreign message on the subject)
        settle(pre)
        assert pre.counts["failed"] == 1 and pre.counts["offered"] == 2 and pre.counts["announced"] == 2
        assert pre.bytes == columns_bytes(read_arrays(bucket.files[good["key"]]))  # the failed one released
        assert pre.take(bad["key"], bad["folder"], bad["sha256"]) is None
        assert pre.take(good["key"], good["folder"], "another-announcement") is None  # not the indexed copy
        assert pre.bytes == 0 and pre.counts["hits"] == 0 and pre.counts["misses"] == 2
    finally:
        pre.close()


def test_a_read_of_a_shard_under_way_waits_for_it_instead_of_fetching_it_twice(tmp_path):
    bucket = Bucket(tmp_path)
    bucket.gate = threading.Event()
    pre = ShardPrefetch(bucket.fetch, at_once=1, max_bytes=64 << 20)
    try:
        note = bucket.put("run/rl/b0/s.h5", [traj("z")])
        pre.offer(note)
        out = []
        t = threading.Thread(target=lambda: out.append(pre.take(note["key"], note["folder"], note["sha256"])))
        t.start()
        t.join(0.5)
        assert t.is_alive() and bucket.fetched == []  # the read waits for the fetch under way
        bucket.gate.set()
        t.join(30)
        assert out and out[0] is not None and bucket.fetched == [note["key"]] and pre.counts["hits"] == 1
        assert pre.bytes == 0
    finally:
        bucket.gate.set()
        pre.close()
