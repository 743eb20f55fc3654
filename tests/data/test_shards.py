"""HDF5 trajectory shards: round trip, CSR layout, atomic publish under SIGKILL, quarantine and dedup by the one
shard consumer (`data.consume.read_folder`), inspect. Real h5py/hdf5plugin files in tmp_path; the crash tests
SIGKILL real writer processes."""
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest

from megatron_rl.data import (
    SCHEMA,
    ShardError,
    ShardReader,
    ShardSchemaError,
    ShardWriter,
    Trajectory,
    TrajectoryColumns,
    TrajectoryError,
    read_arrays,
    read_shard,
    write_shard,
)
from megatron_rl.data import inspect as shard_inspect
from megatron_rl.data.consume import read_folder

REPO = Path(__file__).resolve().parents[2]


def make_traj(i: int, length: int | None = None, version: int = 3, seed: int = 0, **over) -> Trajectory:
    """Deterministic sample i; odd samples have component 'format', samples divisible by 3 per-token versions."""
    rng = np.random.default_rng([seed, i])
    n = int(rng.integers(1, 60)) if length is None else length
    p = int(rng.integers(0, n + 1))
    mask = np.zeros(n, np.uint8)
    mask[p:] = 1
    kw = dict(tokens=rng.integers(0, 150_000, n), logprobs=np.where(mask, -rng.exponential(1.0, n), 0.0),
              loss_mask=mask, prompt_len=p, reward=float(rng.normal()), group_id=i // 4,
              policy_version_first=version, policy_version_last=version + (i % 3 == 0), env=["math", "code"][i % 2],
              task_id=f"task-{i}", episode_id=f"ep-{seed}-{i}", status=["ok", "ok", "truncated", "timeout"][i % 4],
              reward_components={"correct": float(i % 2)} | ({"format": 0.5 * i} if i % 2 else {}),
              timings={"generate": 0.1 * i, "total": 0.2 * i} if i % 5 else {"total": 1.0},
              provenance={"verifier": "v1.2"} if i % 2 else {"judge": "qwen-72b", "judge_version": "2"})
    if i % 3 == 0:
        kw["token_versions"] = np.where(np.arange(n) < n // 2, version, version + 1)
    kw.update(over)
    return Trajectory(**kw)


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for name in ("tokens", "logprobs", "loss_mask"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"{a.episode_id} {name}")
    assert (a.token_versions is None) == (b.token_versions is None), a.episode_id
    if a.token_versions is not None:
        np.testing.assert_array_equal(a.token_versions, b.token_versions)
    for name in ("prompt_len", "reward", "group_id", "policy_version_first", "policy_version_last", "env",
                 "task_id", "episode_id", "status", "reward_components", "timings", "provenance"):
        assert getattr(a, name) == getattr(b, name), (a.episode_id, name)


def write_range(path: Path, start: int, stop: int, **kw) -> list[Trajectory]:
    trajs = [make_traj(i, **kw) for i in range(start, stop)]
    write_shard(path, trajs)
    return trajs


# ----------------------------------------------------------------------------------------- trajectory


@pytest.mark.parametrize("change, message", [
    (dict(logprobs=np.zeros(3)), "differ in length"),
    (dict(tokens=np.ones(5) * 0.5), "must hold integers"),
    (dict(tokens=np.ones((5, 1), np.int32)), "must be 1-D"),
    (dict(loss_mask=np.full(5, 2)), "loss_mask must be 0/1"),
    (dict(status="crashed"), "status 'crashed' not one of"),
    (dict(prompt_len=6), "prompt_len 6 not in"),
    (dict(policy_version_first=4, policy_version_last=3), "policy_version_first <= policy_version_last"),
    (dict(reward=float("nan")), "not finite"),
    (dict(reward_components={"a/b": 1.0}), "without '/'"),
    (dict(reward_components={"x": float("nan")}), "not finite"),
    (dict(token_versions=np.zeros(4, np.int32)), "differ in length"),
    (dict(episode_id=""), "episode_id must be a non-empty"),
    (dict(provenance={"judge": 3}), "provenance must map str -> str"),
])
def test_trajectory_validation_names_the_problem(change, message):
    with pytest.raises(TrajectoryError, match=message):
        make_traj(1, length=5, **change)


def test_trajectory_coerces_dtypes():
    t = make_traj(0, length=4, tokens=[1, 2, 3, 4], logprobs=[0, 0, -1, -2], loss_mask=[False, False, True, True])
    assert (t.tokens.dtype, t.logprobs.dtype, t.loss_mask.dtype) == (np.int32, np.float32, np.uint8)
    assert t.token_versions.dtype == np.int32


# ----------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("compression", ["blosc-lz4", "none"])
def test_round_trip_all_fields(tmp_path, compression):
    trajs = [make_traj(i) for i in range(40)]
    path = tmp_path / "s.h5"
    # tiny chunks and buffer: many flushes, tails carried between them, token_versions appearing mid-stream
    write_shard(path, trajs, compression=compression, chunk_elems=16, buffer_elems=48)
    back = read_shard(path)
    assert len(back) == len(trajs)
    for a, b in zip(trajs, back):
        assert_same(a, b)
    with ShardReader(path) as r:
        assert_same(trajs[7], r[7])
        assert_same(trajs[-1], r[-1])
        filters = [r.h5["tokens"].id.get_create_plist().get_filter(k)[0]
                   for k in range(r.h5["tokens"].id.get_create_plist().get_nfilters())]
        assert (hdf5plugin.BLOSC_ID in filters) == (compression == "blosc-lz4")
        assert r.h5["tokens"].chunks == (16,)
        attrs = r.attrs
    assert attrs["schema"] == SCHEMA and attrs["schema_version"] == 1
    assert attrs["num_samples"] == 40 and attrs["num_tokens"] == sum(len(t) for t in trajs)
    assert attrs["min_policy_version"] == 3 and attrs["max_policy_version"] == 4
    assert attrs["writer_pid"] == os.getpid() and attrs["compression"] == compression


def test_missing_components_are_nan_in_file_and_absent_on_read(tmp_path):
    trajs = [make_traj(i) for i in range(4)]
    write_shard(tmp_path / "s.h5", trajs)
    with h5py.File(tmp_path / "s.h5") as f:
        fmt = f["reward_components/format"][()]
        tv = f["token_versions"][()]
        offsets = f["offsets"][()]
    assert np.isnan(fmt[0]) and fmt[1] == 0.5 and np.isnan(fmt[2]) and fmt[3] == 1.5
    assert np.all(tv[offsets[1]:offsets[2]] == -1)  # sample 1 recorded no per-token versions
    assert "format" not in read_shard(tmp_path / "s.h5")[0].reward_components


def test_csr_offsets(tmp_path):
    trajs = [make_traj(i) for i in range(25)] + [make_traj(25, length=0)]
    write_shard(tmp_path / "s.h5", trajs, chunk_elems=32, buffer_elems=64)
    with h5py.File(tmp_path / "s.h5") as f:
        offsets, tokens, mask = f["offsets"][()], f["tokens"][()], f["loss_mask"][()]
        assert offsets.dtype == np.int64 and f["tokens"].dtype == np.int32 and f["logprobs"].dtype == np.float32
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum([len(t) for t in trajs])]))
    for i, t in enumerate(trajs):
        np.testing.assert_array_equal(tokens[offsets[i]:offsets[i + 1]], t.tokens)
        np.testing.assert_array_equal(mask[offsets[i]:offsets[i + 1]], t.loss_mask)
    cols = read_arrays(tmp_path / "s.h5")
    picked = cols.select(np.array([5, 0, 25, 3]))
    for j, i in enumerate([5, 0, 25, 3]):
        assert_same(trajs[i], picked.trajectory(j))


def test_columns_write_path_mixed_with_rows(tmp_path):
    rows_a = [make_traj(i) for i in range(0, 7)]
    block = [make_traj(i, seed=1, reward_components={"style": 0.25 * i}) for i in range(5)]  # other components
    rows_b = [make_traj(i, seed=2) for i in range(1, 3)]  # no per-token versions in these
    cols = TrajectoryColumns.from_trajectories(block)
    with ShardWriter(tmp_path / "s.h5", chunk_elems=16, buffer_elems=40) as w:
        w.extend(rows_a)
        w.add_columns(cols)
        w.extend(rows_b)
        assert len(w) == 14
    back = read_shard(tmp_path / "s.h5")
    for a, b in zip(rows_a + block + rows_b, back):
        assert_same(a, b)
    write_shard(tmp_path / "c.h5", read_arrays(tmp_path / "s.h5"))  # a shard re-written from its columns
    for a, b in zip(back, read_shard(tmp_path / "c.h5")):
        assert_same(a, b)


@pytest.mark.parametrize("field, value, message", [
    ("offsets", np.array([0, 3, 2, 9]), "offsets must be"),
    ("tokens", np.zeros(9, np.int64), "per-token arrays must be"),
    ("loss_mask", np.full(9, 3, np.uint8), "loss_mask must be 0/1"),
    ("status", np.array(["ok", "bad", "ok"], object), "status values \\['bad'\\]"),
    ("reward", np.array([0.0, np.inf, 1.0]), "reward must be finite"),
    ("prompt_len", np.array([0, 99, 0]), "prompt_len must be in"),
    ("episode_id", np.array(["a", "", "c"], object), "episode_id must be non-empty"),
])
def test_columns_validation(tmp_path, field, value, message):
    cols = TrajectoryColumns.from_trajectories([make_traj(i, length=3) for i in range(3)])
    setattr(cols, field, value)
    with pytest.raises(TrajectoryError, match=message):
        write_shard(tmp_path / "s.h5", cols)
    assert list(tmp_path.iterdir()) == []


def test_empty_shard(tmp_path):
    write_shard(tmp_path / "e.h5", [])
    assert read_shard(tmp_path / "e.h5") == []
    cols = read_arrays(tmp_path / "e.h5")
    assert len(cols) == 0 and cols.num_tokens == 0
    with ShardReader(tmp_path / "e.h5") as r:
        assert r.attrs["num_samples"] == 0 and r.attrs["min_policy_version"] == -1
    assert shard_inspect.summarize(tmp_path / "e.h5")["num_samples"] == 0


def test_published_shard_reads_while_a_descriptor_holds_a_lock(tmp_path):
    """A forked child (a sandbox spawn on another thread) can briefly hold the writer's descriptor and its
    exclusive flock; a published shard is immutable, so readers must not take HDF5's lock (CI saw EAGAIN)."""
    import fcntl

    write_shard(tmp_path / "s.h5", [make_traj(i) for i in range(3)])
    fd = os.open(tmp_path / "s.h5", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(OSError):  # what HDF5's default locking does in this situation
            h5py.File(tmp_path / "s.h5", "r").close()
        assert len(read_arrays(tmp_path / "s.h5")) == 3
    finally:
        os.close(fd)


def test_writer_exception_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path / "s.h5") as w:
            w.add(make_traj(0))
            assert (tmp_path / "s.h5.tmp").exists() and not (tmp_path / "s.h5").exists()
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_spool_shard_skips_the_fsyncs_and_is_still_published_whole(tmp_path, monkeypatch):
    """durable=False (the s3 store's local copy before its upload) publishes by rename without fsyncing the file
    or its folder; the default fsyncs both."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    rows = [make_traj(i) for i in range(4)]
    write_shard(tmp_path / "spool.h5", rows, durable=False)
    assert synced == [] and sorted(p.name for p in tmp_path.iterdir()) == ["spool.h5"]
    for a, b in zip(rows, read_shard(tmp_path / "spool.h5"), strict=True):
        assert_same(a, b)
    write_shard(tmp_path / "kept.h5", rows)
    assert len(synced) == 2  # the shard, then its folder after the rename


def test_writer_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="reserved for unfinished"):
        ShardWriter(tmp_path / "x.h5.tmp")
    with pytest.raises(ValueError, match="compression 'zip' unknown"):
        ShardWriter(tmp_path / "x.h5", compression="zip")
    with pytest.raises(FileNotFoundError, match="create it before writing"):
        ShardWriter(tmp_path / "nope" / "x.h5")
    with ShardWriter(tmp_path / "x.h5") as w, pytest.raises(TypeError, match="takes a Trajectory"):
        w.add({"tokens": [1]})


# ------------------------------------------------------------------------------------- crash safety

CHILD = r"""
import sys
from tests.data.test_shards import make_traj
from megatron_rl.data import ShardWriter, write_shard
root, mode = sys.argv[1], sys.argv[2]
if mode == "one-big":
    write_shard(f"{root}/done.h5", [make_traj(i) for i in range(10)])
    print("published", flush=True)
    w = ShardWriter(f"{root}/big.h5", buffer_elems=65536)
    i = 0
    while True:  # never finishes: killed mid-write
        w.add(make_traj(i, length=4000))
        i += 1
        if i == 40:
            print("writing", flush=True)
else:
    k = 0
    while True:  # small shards back to back: the kill lands anywhere, publish included
        write_shard(f"{root}/s{k:05d}.h5", [make_traj(i, seed=k) for i in range(20)], buffer_elems=256)
        k += 1
        if k == 3:
            print("writing", flush=True)
"""


def run_and_kill(root: Path, mode: str, delay: float) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), mode], stdout=subprocess.PIPE, env=env,
                            cwd=REPO, text=True)
    try:
        deadline = time.monotonic() + 120
        while proc.stdout.readline().strip() != "writing":
            assert proc.poll() is None and time.monotonic() < deadline, "writer child died or hung"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_mid_write_leaves_no_visible_shard(tmp_path):
    run_and_kill(tmp_path, "one-big", delay=0.2)
    assert not (tmp_path / "big.h5").exists()
    assert (tmp_path / "big.h5.tmp").exists()  # the unfinished file only ever has the .tmp name
    got = read_folder(tmp_path)
    assert got.shards == 1 and not got.quarantined and not got.skipped
    for i, t in enumerate(got.trajectories):
        assert_same(make_traj(i), t)
    assert not (tmp_path / "quarantine").exists() and (tmp_path / "big.h5.tmp").exists()


@pytest.mark.parametrize("delay", [0.0, 0.011, 0.023, 0.05, 0.09])
def test_sigkill_at_any_moment_every_visible_shard_is_whole(tmp_path, delay):
    run_and_kill(tmp_path, "loop", delay)
    visible = sorted(tmp_path.glob("*.h5"))
    assert len(visible) >= 3
    for path in visible:
        k = int(path.stem[1:])
        back = read_shard(path)
        assert len(back) == 20
        for i, t in enumerate(back):
            assert_same(make_traj(i, seed=k), t)
    assert len(list(tmp_path.glob("*.tmp"))) <= 1
    got = read_folder(tmp_path)
    assert got.shards == len(visible) and not got.quarantined


# ------------------------------------------------------------------------------------------ directory


def corrupt_shards(root: Path) -> dict[str, str]:
    """Writes bad files next to good ones; returns name -> expected reason text."""
    write_range(root / "trunc.h5", 0, 30, length=500)
    data = (root / "trunc.h5").read_bytes()
    (root / "trunc.h5").write_bytes(data[: len(data) // 2])
    (root / "garbage.h5").write_bytes(np.random.default_rng(0).bytes(5000))
    write_range(root / "schema.h5", 0, 3)
    with h5py.File(root / "schema.h5", "a") as f:
        f.attrs["schema_version"] = 7
    write_range(root / "foreign.h5", 0, 3)
    with h5py.File(root / "foreign.h5", "a") as f:
        f.attrs["schema"] = "someone-else/v1"
    write_range(root / "nooffsets.h5", 0, 3)
    with h5py.File(root / "nooffsets.h5", "a") as f:
        del f["offsets"]
    write_range(root / "shapes.h5", 0, 3)
    with h5py.File(root / "shapes.h5", "a") as f:
        del f["reward"]
        f["reward"] = np.zeros(4)
    write_range(root / "csr.h5", 0, 3, length=5)
    with h5py.File(root / "csr.h5", "a") as f:
        f["offsets"][...] = [0, 10, 5, 15]
    write_range(root / "chunk.h5", 0, 30, length=500)
    with h5py.File(root / "chunk.h5", "r") as f:
        stored = f["tokens"].id.get_chunk_info(0)  # StoreInfo(chunk_offset, filter_mask, byte_offset, size)
    with open(root / "chunk.h5", "r+b") as f:  # the Blosc header of the first token chunk claims 2 GB
        f.seek(stored.byte_offset + 4)
        f.write((2**31).to_bytes(4, "little"))
    return {"trunc.h5": "ShardError", "garbage.h5": "cannot open as HDF5", "schema.h5": "schema_version 7",
            "chunk.h5": "chunk at 0: Blosc header says 2147483648 bytes",
            "foreign.h5": "someone-else/v1", "nooffsets.h5": "missing datasets ['offsets']",
            "shapes.h5": "inconsistent shapes (per-sample ['reward']", "csr.h5": "offsets are not a valid CSR"}


def test_bad_shards_are_quarantined_and_reading_continues(tmp_path, caplog):
    good_a = write_range(tmp_path / "a-good.h5", 0, 10, seed=1)
    bad = corrupt_shards(tmp_path)
    good_z = write_range(tmp_path / "z-good.h5", 0, 10, seed=2)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.store"):
        got = read_folder(tmp_path)
    assert got.shards == 2 and len(got.quarantined) == len(bad) and not got.skipped
    for a, b in zip(good_a + good_z, got.trajectories, strict=True):
        assert_same(a, b)
    for name, reason in bad.items():
        assert not (tmp_path / name).exists() and (tmp_path / "quarantine" / name).exists()
        text = (tmp_path / "quarantine" / f"{name}.reason.txt").read_text()
        assert reason in text and "time: " in text, (name, text)
        assert any(name in r.getMessage() and "quarantined" in r.getMessage() for r in caplog.records)
    again = read_folder(tmp_path)  # the quarantined ones are gone from the folder: read once, counted once
    assert again.shards == 2 and not again.quarantined


def test_a_quarantined_name_taken_again_keeps_both_files(tmp_path):
    (tmp_path / "x.h5").write_bytes(b"torn")
    assert len(read_folder(tmp_path).quarantined) == 1
    (tmp_path / "x.h5").write_bytes(b"torn again")
    assert len(read_folder(tmp_path).quarantined) == 1
    kept = sorted(p.name for p in (tmp_path / "quarantine").iterdir() if not p.name.endswith(".reason.txt"))
    assert len(kept) == 2 and kept[-1] == "x.h5"


def test_newer_schema_error_names_file_and_versions(tmp_path):
    write_range(tmp_path / "s.h5", 0, 2)
    with h5py.File(tmp_path / "s.h5", "a") as f:
        f.attrs["schema_version"] = 2
    with pytest.raises(ShardSchemaError, match=r"s\.h5: schema_version 2 but this megatron-rl reads versions 1\.\.1"):
        read_shard(tmp_path / "s.h5")
    with pytest.raises(ShardError, match="cannot open as HDF5"):
        (tmp_path / "g.h5").write_bytes(b"x" * 100)
        read_shard(tmp_path / "g.h5")


def test_duplicate_episode_ids_dropped_across_and_within_shards(tmp_path):
    write_range(tmp_path / "a.h5", 0, 5)
    write_shard(tmp_path / "b.h5", [make_traj(i) for i in (3, 4, 5, 6, 6)])  # a retry re-wrote 3 and 4
    got = read_folder(tmp_path)
    assert [t.episode_id for t in got.trajectories] == [f"ep-0-{i}" for i in range(7)]
    assert got.duplicates == 3 and got.shards == 2
    for i in (3, 4):  # the first copy (a.h5's) is the one kept
        assert_same(read_shard(tmp_path / "a.h5")[i], got.trajectories[i])


def test_a_store_that_reads_shards_at_once_overlaps_them_and_keeps_name_order_dedup_and_quarantine(tmp_path):
    """`store.reads_at_once` > 1 (the s3 store's downloads): the reads of a folder are under way together (each
    waits here until all three have started: one after another, the first would time out), and the result is
    the one of one-by-one reading: name order, first copy wins, the torn shard quarantined."""
    import threading

    from megatron_rl.data.store import FsStore

    write_range(tmp_path / "a.h5", 0, 5)
    (tmp_path / "b.h5").write_bytes(b"torn")
    write_shard(tmp_path / "c.h5", [make_traj(i) for i in (3, 4, 5, 6)])
    together = threading.Barrier(3, timeout=20)

    class AtOnce(FsStore):
        reads_at_once = 3

        def read(self, folder, name, vocab_size=None):
            together.wait()
            return super().read(folder, name, vocab_size=vocab_size)

    got = read_folder(tmp_path, AtOnce())
    assert [t.episode_id for t in got.trajectories] == [f"ep-0-{i}" for i in range(7)]
    assert got.shards == 2 and got.duplicates == 2 and [q.split(":")[0] for q in got.quarantined] == [
        str(tmp_path / "b.h5")]
    assert (tmp_path / "quarantine" / "b.h5").exists()


# -------------------------------------------------------------------------------------------- inspect


def test_inspect_summary_numbers(tmp_path):
    trajs = [make_traj(i) for i in range(30)]
    path = tmp_path / "s.h5"
    write_shard(path, trajs)
    s = shard_inspect.summarize(path, bins=5)
    lengths = np.array([len(t) for t in trajs])
    rewards = np.array([t.reward for t in trajs])
    fmt = np.array([t.reward_components["format"] for t in trajs if "format" in t.reward_components])
    assert s["num_samples"] == 30 and s["num_tokens"] == lengths.sum()
    assert s["num_model_tokens"] == sum(int(t.loss_mask.sum()) for t in trajs)
    assert s["status_counts"] == {"ok": 16, "truncated": 7, "timeout": 7}
    assert s["envs"] == {"math": 15, "code": 15}
    assert s["reward"]["mean"] == pytest.approx(rewards.mean()) and s["reward"]["std"] == pytest.approx(rewards.std())
    assert (s["reward"]["min"], s["reward"]["max"]) == (rewards.min(), rewards.max())
    assert s["reward_components"]["format"]["count"] == 15
    assert s["reward_components"]["format"]["mean"] == pytest.approx(fmt.mean())
    assert s["length"]["histogram"]["counts"] == np.histogram(lengths, bins=5)[0].tolist()
    assert (s["length"]["min"], s["length"]["max"]) == (lengths.min(), lengths.max())
    assert s["policy_version"] == {"min": 3, "max": 4, "samples_per_version_first": {"3": 30},
                                   "shards_with_token_versions": 1}
    n, t = 30, int(lengths.sum())
    raw = t * (4 + 4 + 1 + 4) + 8 * (n + 1) + 8 * n * (4 + 1) + 8 * n * (2 + 2)  # ragged, offsets, ints+reward,
    assert s["bytes"]["raw"] == raw                                               # 2 components + 2 timings
    assert s["bytes"]["compression_ratio"] == pytest.approx(raw / path.stat().st_size)
    assert s["schema_versions"] == [1]
    text = shard_inspect.render(s)
    assert "samples  30" in text and "#" in text and "format" in text


def test_inspect_main_json_and_errors(tmp_path, capsys):
    write_range(tmp_path / "a.h5", 0, 8)
    assert shard_inspect.main(["--json", str(tmp_path / "a.h5")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_samples"] == 8 and out["kind"] == "shard"
    (tmp_path / "bad.h5").write_bytes(b"not hdf5")
    write_range(tmp_path / "b.h5", 8, 12)
    assert shard_inspect.main(["--json", str(tmp_path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["num_samples"] == 12 and out["shards"] == ["a.h5", "b.h5"] and "bad.h5" in out["errors"]
    assert (tmp_path / "bad.h5").exists()  # inspect never quarantines
    assert shard_inspect.main([str(tmp_path / "missing.h5")]) == 2
    with pytest.raises(SystemExit) as e:
        shard_inspect.main(["--help"])
    assert e.value.code == 0 and "--json" in capsys.readouterr().out
