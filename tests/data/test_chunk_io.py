"""The shards' parallel chunk codec (megatron_rl/data/chunk_io.py): files stay what HDF5's own Blosc filter
writes and reads, in both directions; what the fast reader cannot decode goes through HDF5; corrupt chunks
are errors that name the dataset and chunk; writer threads never outlive the writer."""
from __future__ import annotations

import threading

import h5py
import hdf5plugin
import numpy as np
import pytest

from megatron_rl.config import ConfigError
from megatron_rl.data import (
    ShardReader,
    ShardWriter,
    ShardWriterConfig,
    TrajectoryColumns,
    chunk_io,
    read_arrays,
    write_shard,
)
from megatron_rl.data.shards import MIN_CHUNK_ELEMS, SHUFFLE, ShardError
from tests.data.test_shards import assert_same, make_traj

PER_TOKEN = ("tokens", "logprobs", "loss_mask", "token_versions")
BLOSC_FLAGS = {hdf5plugin.Blosc.NOSHUFFLE: 0, hdf5plugin.Blosc.SHUFFLE: 0x1, hdf5plugin.Blosc.BITSHUFFLE: 0x4}


def columns(n: int, length: int = 700, seed: int = 0) -> TrajectoryColumns:
    return TrajectoryColumns.from_trajectories([make_traj(i, length=length, seed=seed) for i in range(n)])


def stored_chunks(ds: h5py.Dataset) -> list[bytes]:
    return [ds.id.read_direct_chunk(ds.id.get_chunk_info(i).chunk_offset)[1] for i in range(ds.id.get_num_chunks())]


@pytest.mark.parametrize("compression", ["blosc-lz4", "none"])
def test_direct_chunks_read_back_through_hdf5s_own_filter(tmp_path, compression):
    cols = columns(40)  # 28,000 tokens in 4096-token chunks: 7 chunks, the last one partial
    write_shard(tmp_path / "s.h5", cols, compression=compression, chunk_elems=4096, buffer_elems=8192)
    with h5py.File(tmp_path / "s.h5", "r") as f:
        for name in PER_TOKEN:
            ds = f[name]
            np.testing.assert_array_equal(ds[()], getattr(cols, name), err_msg=name)  # HDF5's filter pipeline
            assert ds.id.get_num_chunks() == 7 and ds.chunks == (4096,)
            if compression == "none":
                assert ds.id.get_create_plist().get_nfilters() == 0
                continue
            code, _, params, _ = ds.id.get_create_plist().get_filter(0)
            assert code == chunk_io.BLOSC_FILTER and params[5] == SHUFFLE[name], name
            for chunk in stored_chunks(ds):  # every chunk is the Blosc buffer the declared filter would write
                version, _, flags, typesize, nbytes, _, cbytes = chunk_io.BLOSC_HEADER.unpack_from(chunk)
                assert (typesize, nbytes, cbytes) == (ds.dtype.itemsize, 4096 * ds.dtype.itemsize, len(chunk))
                assert flags & 0x5 == BLOSC_FLAGS[SHUFFLE[name]], (name, flags)


@pytest.mark.parametrize("shuffle", [hdf5plugin.Blosc.SHUFFLE, hdf5plugin.Blosc.BITSHUFFLE])
def test_shards_written_by_hdf5s_filter_take_the_fast_path(tmp_path, shuffle):
    cols = columns(30, seed=1)
    write_shard(tmp_path / "s.h5", cols)
    with h5py.File(tmp_path / "s.h5", "a") as f:  # per-token datasets re-written by HDF5 itself
        for name in PER_TOKEN:
            data = f[name][()]
            del f[name]
            f.create_dataset(name, data=data, chunks=(3000,), maxshape=(None,),
                             **hdf5plugin.Blosc(cname="lz4", clevel=9, shuffle=shuffle))
    with ShardReader(tmp_path / "s.h5") as r, chunk_io.ChunkReader(r.path, 2) as chunks:
        waits = {name: chunks.submit(r.h5[name]) for name in PER_TOKEN}
        assert all(w is not None for w in waits.values())  # decoded by chunk_io, not HDF5
        for name, wait in waits.items():
            np.testing.assert_array_equal(wait(), getattr(cols, name), err_msg=name)
    for a, b in zip(cols.to_trajectories(), read_arrays(tmp_path / "s.h5").to_trajectories()):
        assert_same(a, b)


def test_what_the_fast_reader_cannot_decode_goes_through_hdf5(tmp_path):
    cols = columns(12, seed=2)
    write_shard(tmp_path / "s.h5", cols)
    with h5py.File(tmp_path / "s.h5", "a") as f:
        tokens, logprobs = f["tokens"][()], f["logprobs"][()]
        del f["tokens"], f["logprobs"]
        f.create_dataset("tokens", data=tokens, chunks=(1000,), compression="gzip")  # another filter
        lp = f.create_dataset("logprobs", shape=logprobs.shape, dtype=">f4", chunks=(1000,))  # big-endian
        lp[...] = logprobs
        f["token_versions"][:1000] = f["token_versions"][:1000]  # still whole chunks: fast path
    with ShardReader(tmp_path / "s.h5") as r, chunk_io.ChunkReader(r.path, 2) as chunks:
        assert chunks.submit(r.h5["tokens"]) is None and chunks.submit(r.h5["logprobs"]) is None
        assert chunks.submit(r.h5["loss_mask"]) is not None
    back = read_arrays(tmp_path / "s.h5")
    for name in PER_TOKEN:
        np.testing.assert_array_equal(getattr(back, name), getattr(cols, name), err_msg=name)


def test_versions_appearing_mid_shard_leave_unwritten_chunks_at_minus_one(tmp_path):
    plain = [make_traj(i, length=300, seed=3, token_versions=None) for i in range(1, 30, 3)]  # 3000 tokens
    versioned = [make_traj(i, length=300, seed=3) for i in range(0, 30, 3)]  # all carry token_versions
    with ShardWriter(tmp_path / "s.h5", chunk_elems=1024, buffer_elems=1024) as w:
        w.extend(plain)      # flushed (chunks 0-1) before token_versions exists: never stored
        w.extend(versioned)
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert f["token_versions"].id.get_num_chunks() < f["tokens"].id.get_num_chunks()
    back = read_arrays(tmp_path / "s.h5")
    for a, b in zip(plain + versioned, back.to_trajectories()):
        assert_same(a, b)  # plain samples read back without versions (-1 fill), the others with theirs


def test_small_shard_gets_one_chunk_of_its_own_size(tmp_path):
    write_shard(tmp_path / "small.h5", columns(3, length=1000))  # 3000 tokens
    write_shard(tmp_path / "big.h5", columns(5, length=1000), chunk_elems=2048)
    with h5py.File(tmp_path / "small.h5", "r") as small, h5py.File(tmp_path / "big.h5", "r") as big:
        assert small["tokens"].chunks == (MIN_CHUNK_ELEMS,) and small["tokens"].id.get_num_chunks() == 1
        assert small.attrs["chunk_elems"] == MIN_CHUNK_ELEMS
        assert big["tokens"].chunks == (2048,) and big["tokens"].id.get_num_chunks() == 3


def test_chunk_bytes_do_not_depend_on_the_thread_count(tmp_path):
    cols = columns(60, seed=4)
    for threads in (1, 3):
        write_shard(tmp_path / f"t{threads}.h5", cols, chunk_elems=4096, threads=threads)
    with h5py.File(tmp_path / "t1.h5", "r") as a, h5py.File(tmp_path / "t3.h5", "r") as b:
        for name in PER_TOKEN:
            assert stored_chunks(a[name]) == stored_chunks(b[name]), name
    for threads in (1, 4):
        with ShardReader(tmp_path / "t1.h5", threads=threads) as r:
            np.testing.assert_array_equal(r.read_arrays().tokens, cols.tokens)


def test_bad_header_and_short_chunk_name_dataset_and_chunk(tmp_path, monkeypatch):
    write_shard(tmp_path / "s.h5", columns(30, seed=5), chunk_elems=4096)
    with h5py.File(tmp_path / "s.h5", "r") as f:
        info = f["logprobs"].id.get_chunk_info(2)
    raw = bytearray((tmp_path / "s.h5").read_bytes())
    raw[info.byte_offset + 12:info.byte_offset + 16] = (info.size + 7).to_bytes(4, "little")  # header cbytes
    (tmp_path / "bad.h5").write_bytes(raw)
    with pytest.raises(ShardError, match=r"/logprobs: chunk at 8192: Blosc header says 16384 bytes from"):
        read_arrays(tmp_path / "bad.h5")
    end = len(raw)  # an index entry whose chunk runs past the end of the file: a short read, not garbage
    real = chunk_io._extents
    monkeypatch.setattr(chunk_io, "_extents", lambda ds: [(f, m, end - 10 if f == 4096 else o, s)
                                                          for f, m, o, s in real(ds)])
    with pytest.raises(ShardError, match=r"/tokens: chunk at 4096 ends past the end of the file \(10 of \d+ bytes"):
        read_arrays(tmp_path / "s.h5")


def test_writer_threads_end_with_close_and_abort(tmp_path):
    def codec_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(("shard-chunk-writer", "shard-codec"))]
    cols = columns(40, seed=6)
    w = ShardWriter(tmp_path / "a.h5", chunk_elems=4096, buffer_elems=4096, threads=2)
    w.add_columns(cols)  # flushes: the chunk writer is running
    assert "shard-chunk-writer" in codec_threads()
    w.abort()
    assert codec_threads() == [] and not list(tmp_path.iterdir())
    with ShardWriter(tmp_path / "b.h5", chunk_elems=4096, buffer_elems=4096, threads=2) as w:
        w.add_columns(cols)
    assert codec_threads() == []
    np.testing.assert_array_equal(read_arrays(tmp_path / "b.h5").logprobs, cols.logprobs)


def test_chunk_writer_error_reaches_the_writer_and_nothing_is_published(tmp_path, monkeypatch):
    def broken(ds):
        def encode(piece):
            raise OSError(f"disk full while encoding {ds.name}")
        return encode
    monkeypatch.setattr(chunk_io, "_encoder", broken)
    with pytest.raises(OSError, match="disk full while encoding /tokens"):
        write_shard(tmp_path / "s.h5", columns(20, seed=7), chunk_elems=4096)
    assert not list(tmp_path.iterdir())


def test_threads_config_is_validated():
    with pytest.raises(ConfigError, match="threads -1 must be >= 0"):
        ShardWriterConfig(threads=-1).validate()
    assert chunk_io.codec_threads(3) == 3 and 1 <= chunk_io.codec_threads(0) <= chunk_io.MAX_AUTO_THREADS


def test_a_chunk_index_claiming_huge_chunks_is_refused_before_allocating(tmp_path, monkeypatch):
    write_shard(tmp_path / "s.h5", columns(10, seed=8), chunk_elems=4096)
    real = chunk_io._extents
    monkeypatch.setattr(chunk_io, "_extents", lambda ds: [(f, m, o, 1 << 40) for f, m, o, _ in real(ds)])
    with pytest.raises(ShardError, match=r"/tokens: chunk at 0 stores 1099511627776 bytes, more than a 4096-element"):
        read_arrays(tmp_path / "s.h5")
