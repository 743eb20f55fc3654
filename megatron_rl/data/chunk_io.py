"""Parallel chunk codec for the shards' per-token datasets: HDF5 direct chunk I/O, Blosc on a thread pool.

Why: HDF5 runs a dataset's filter pipeline (here Blosc lz4 with a shuffle) chunk by chunk on the calling
thread and copies every chunk through its chunk cache. A 160 MB shard wrote at 0.51x and read at 0.59x the
speed of raw np.save / np.load of the same arrays (`benchmarks/shard_io.py`, before this module). Here the
same work runs in parallel and without the extra copies:

- write: a writer thread has whole chunks compressed on a thread pool (python-blosc releases the GIL and
  calls c-blosc's re-entrant `*_ctx` functions) and stores them in order with `H5Dwrite_chunk`, while the
  shard writer goes on (more samples, the per-sample columns); disk writeback starts as chunks are stored;
- read: each chunk's file extent comes from `H5Dchunk_iter`; pool threads `pread` it and decompress it
  straight into the output array, while the calling thread reads the other datasets.

The file format does not change: every chunk is the Blosc buffer that HDF5's own Blosc filter (filter 32001,
registered by hdf5plugin) writes and reads, so h5py + hdf5plugin, h5dump and earlier megatron-rl read these
shards as before, and this reader reads shards written through the filter (tests/data/test_chunk_io.py checks
both directions). A dataset this reader does not know (another filter, a non-native byte order, a chunk missing
or skipped by a filter it cannot undo) is left to HDF5's own path: `ChunkReader.submit` returns None.

Pool threads run only `os.pread` and Blosc on plain buffers; h5py is called by the reader's calling thread,
and by the shard writer and its chunk-writer thread (h5py serialises them). No thread outlives one shard
read or one shard writer (joined at close or abort).
"""
from __future__ import annotations

import ctypes
import functools
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import blosc
import h5py
import numpy as np

BLOSC_FILTER = 32001
"""HDF5 filter id of Blosc (what `hdf5plugin.Blosc` registers)."""
MAX_AUTO_THREADS = 4
"""`threads=0` means one thread per core this process may run on, at most this many."""

blosc.set_releasegil(True)  # with the GIL released, python-blosc calls the re-entrant blosc_*_ctx functions
blosc.set_nthreads(1)       # parallelism is ours, across chunks; Blosc's own threads would oversubscribe


class ChunkError(ValueError):
    """A stored chunk that does not decode to the bytes its dataset needs (a corrupt or foreign file)."""


def codec_threads(requested: int = 0) -> int:
    """Threads for the chunk codec: `requested` if > 0, else the usable cores (at most MAX_AUTO_THREADS)."""
    if requested > 0:
        return requested
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_AUTO_THREADS, cores))


class ChunkPool:
    """An ordered `map` on `threads` threads (inline for 1); a context manager that joins its threads."""

    def __init__(self, threads: int):
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="shard-codec") if threads > 1 else None

    def __enter__(self) -> ChunkPool:
        return self

    def __exit__(self, *exc) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def map(self, fn: Callable, items: Iterable) -> Iterator:
        return self._executor.map(fn, items) if self._executor is not None else map(fn, items)


# ------------------------------------------------------------------------------------------------------ write


def _pieces(arr: np.ndarray, chunk: int, fill) -> list[np.ndarray]:
    """`arr` [n] as whole chunks: views of the full ones, the tail padded with the fill value (as HDF5 does)."""
    n_full = len(arr) // chunk
    pieces = [arr[i * chunk:(i + 1) * chunk] for i in range(n_full)]    # each [chunk], views
    if len(arr) % chunk:
        tail = np.full(chunk, fill, arr.dtype)                           # [chunk]
        tail[:len(arr) - n_full * chunk] = arr[n_full * chunk:]
        pieces.append(tail)
    return pieces


BLOSC_COMPRESSORS = {0: "blosclz", 1: "lz4", 2: "lz4hc", 3: "snappy", 4: "zlib", 5: "zstd"}
"""Compressor codes in the Blosc filter's parameters (hdf5-blosc cd_values[6]) -> python-blosc names."""


def _filters(ds: h5py.Dataset) -> list[tuple[int, tuple]]:
    plist = ds.id.get_create_plist()
    return [plist.get_filter(i)[0:3:2] for i in range(plist.get_nfilters())]  # (filter id, parameters)


def _encoder(ds: h5py.Dataset) -> Callable[[np.ndarray], bytes | np.ndarray]:
    """Chunk encoder that matches `ds`'s own filter pipeline: none, or Blosc with the dataset's compressor,
    level and shuffle (hdf5-blosc parameters: [4] level, [5] shuffle, [6] compressor)."""
    filters = _filters(ds)
    if not filters:
        return lambda piece: piece  # H5Dwrite_chunk takes the array's buffer as is
    if len(filters) != 1 or filters[0][0] != BLOSC_FILTER or len(filters[0][1]) < 7:
        raise ValueError(f"dataset {ds.name}: filters {filters} cannot be written chunk by chunk here "
                         f"(only none or Blosc, filter {BLOSC_FILTER})")
    clevel, shuffle, code = filters[0][1][4:7]
    cname = BLOSC_COMPRESSORS[code]

    def encode(piece: np.ndarray) -> bytes:
        return blosc.compress_ptr(piece.__array_interface__["data"][0], piece.size, piece.dtype.itemsize,
                                  clevel, shuffle, cname)
    return encode


def _sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
WRITEBACK_BYTES = 32 << 20
"""Stored bytes between two `start_writeback` calls while chunks are written."""


def start_writeback(fd: int) -> None:
    """Start writing `fd`'s dirty pages to disk now, without waiting (Linux sync_file_range WRITE), so the
    publishing fsync has less left to do. Best effort: a no-op where the call does not exist or fails."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE, whole file


def _chunk_work(jobs: list[tuple[h5py.Dataset, int, np.ndarray]]) -> list[tuple]:
    """(ds, start, arr) jobs -> (ds, first element, whole chunk, encoder) in file order."""
    work = []
    for ds, start, arr in jobs:
        chunk = ds.chunks[0]
        if start % chunk:
            raise ValueError(f"dataset {ds.name}: chunk writes must start on a chunk boundary, got {start}")
        fill = ds.fillvalue if ds.fillvalue is not None else 0
        encode = _encoder(ds)
        work += [(ds, start + i * chunk, piece, encode) for i, piece in enumerate(_pieces(arr, chunk, fill))]
    return work


class ChunkWriter:
    """Stores whole chunks in the background, in submission order.

    `submit(jobs)` queues (ds, start, arr) jobs and returns: each `ds` is 1-D, chunked, already resized to hold
    `start + len(arr)` elements, `start` is a chunk boundary, and `arr` is not modified afterwards. A writer
    thread encodes the chunks on the pool exactly as each dataset's own filter would (none, or Blosc with its
    compressor, level and shuffle) and stores them with H5Dwrite_chunk (h5py serialises it with the caller's
    own h5py calls), starting disk writeback every WRITEBACK_BYTES when given the file's descriptor.
    `join()` waits for everything and raises the first error; `abort()` drops what is queued. Both end the
    threads; the file may be closed after either.
    """

    def __init__(self, threads: int, writeback_fd: int | None = None):
        self._threads = threads
        self._writeback_fd = writeback_fd
        self._queue: queue.Queue = queue.Queue(maxsize=2)  # bounds the memory held by pending flushes
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._aborted = False

    def submit(self, jobs: list[tuple[h5py.Dataset, int, np.ndarray]]) -> None:
        self._raise()
        work = _chunk_work(jobs)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shard-chunk-writer", daemon=True)
            self._thread.start()
        self._queue.put(work)

    def join(self) -> None:
        self._stop()
        self._raise()

    def abort(self) -> None:
        self._aborted = True
        self._stop()

    def _stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        with ChunkPool(self._threads) as pool:
            while (work := self._queue.get()) is not None:
                if self._error is None and not self._aborted:
                    try:
                        self._write(work, pool)
                    except BaseException as e:  # handed to the caller's next submit/join
                        self._error = e

    def _write(self, work: list, pool: ChunkPool) -> None:
        unsynced = 0
        for (ds, offset, _, _), data in zip(work, pool.map(lambda job: job[3](job[2]), work)):
            if self._aborted:
                return
            ds.id.write_direct_chunk((offset,), data)
            unsynced += memoryview(data).nbytes
            if self._writeback_fd is not None and unsynced >= WRITEBACK_BYTES:
                start_writeback(self._writeback_fd)
                unsynced = 0


# ------------------------------------------------------------------------------------------------------- read


def _codec(ds: h5py.Dataset) -> str | None:
    """'blosc' or 'none' when this module can decode `ds` itself, else None (HDF5's path)."""
    if ds.ndim != 1 or ds.chunks is None or not ds.dtype.isnative or ds.dtype.hasobject:
        return None
    return {(): "none", (BLOSC_FILTER,): "blosc"}.get(tuple(code for code, _ in _filters(ds)))


def _extents(ds: h5py.Dataset) -> list[tuple[int, int, int, int]]:
    """(first element, filter mask, byte offset, stored size) of every stored chunk of `ds`."""
    found: list[tuple[int, int, int, int]] = []
    add = lambda info: found.append((info.chunk_offset[0], info.filter_mask, info.byte_offset, info.size))  # noqa: E731
    try:
        ds.id.chunk_iter(add)
    except (AttributeError, NotImplementedError):  # HDF5 < 1.14: one call per chunk
        for i in range(ds.id.get_num_chunks()):
            add(ds.id.get_chunk_info(i))
    return found


BLOSC_HEADER = struct.Struct("<4BIII")
"""Blosc 1 chunk header: version, codec version, flags, typesize, nbytes, blocksize, cbytes (little endian)."""
BLOSC_MAX_OVERHEAD = 16
"""Most bytes Blosc adds to an incompressible buffer (its header)."""


def _read_stored(fd: int, buf: memoryview, size: int, offset: int, name: str, first: int) -> memoryview:
    """`size` stored bytes at file `offset` into `buf` (re-used by the thread: no allocation per chunk)."""
    view = buf[:size]
    got = os.preadv(fd, [view], offset)
    if got != size:
        raise ChunkError(f"dataset {name}: chunk at {first} ends past the end of the file ({got} of {size} bytes)")
    return view


def _decode_into(out: np.ndarray, stored: memoryview, name: str, first: int) -> None:
    """Decompress one stored Blosc chunk into `out` [chunk] (a view of the result, or scratch for the tail),
    after checking that its header promises exactly out.nbytes from exactly len(stored) bytes."""
    if len(stored) < BLOSC_HEADER.size:
        raise ChunkError(f"dataset {name}: chunk at {first} is {len(stored)} bytes, too short for Blosc")
    nbytes, _, cbytes = BLOSC_HEADER.unpack_from(stored)[4:]
    if nbytes != out.nbytes or cbytes != len(stored):
        raise ChunkError(f"dataset {name}: chunk at {first}: Blosc header says {nbytes} bytes from {cbytes}, "
                         f"expected {out.nbytes} from {len(stored)} (corrupt chunk)")
    try:
        blosc.decompress_ptr(stored, out.__array_interface__["data"][0])
    except Exception as e:
        raise ChunkError(f"dataset {name}: chunk at {first} does not decompress ({e})") from e


class ChunkReader:
    """Reads whole 1-D datasets of one file on a thread pool; a context manager owning the pool and a descriptor.

    `submit(ds)` looks up the chunks (h5py, this thread) and queues their decoding; it returns a function that
    waits for the array, or None when HDF5 must read that dataset itself. Between the two the calling thread is
    free for other reads (the shard reader reads the per-sample columns meanwhile).
    """

    def __init__(self, path: str | os.PathLike, threads: int):
        self.threads = threads
        self._fd = os.open(path, os.O_RDONLY)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="shard-codec")

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        os.close(self._fd)

    def submit(self, ds: h5py.Dataset) -> Callable[[], np.ndarray] | None:
        codec = _codec(ds)
        if codec is None:
            return None
        n, chunk = ds.shape[0], ds.chunks[0]
        extents = sorted(_extents(ds))
        if [e[0] for e in extents] != list(range(0, n, chunk)) or any(mask for _, mask, _, _ in extents):
            return None  # a chunk never written (fill value) or stored unfiltered: HDF5 knows how
        most = chunk * ds.dtype.itemsize + (BLOSC_MAX_OVERHEAD if codec == "blosc" else 0)
        for first, _, _, size in extents:
            if size > most:  # a corrupt chunk index must not make us allocate its size
                raise ChunkError(f"dataset {ds.name}: chunk at {first} stores {size} bytes, more than a "
                                 f"{chunk}-element chunk can ({most}; corrupt chunk index)")
        out = np.empty(n, ds.dtype)                                      # [n]
        decode = functools.partial(self._decode, out, chunk, codec, ds.name)
        futures = [self._executor.submit(decode, extents[i::self.threads]) for i in range(self.threads)]

        def result() -> np.ndarray:
            for future in futures:
                future.result()
            return out
        return result

    def _decode(self, out: np.ndarray, chunk: int, codec: str, name: str,
                part: list[tuple[int, int, int, int]]) -> None:
        """Read and decode the chunks in `part` into `out` [n] (pool thread: no h5py here). One read per chunk,
        threads taking every other chunk: measured faster cold than batched reads of adjacent chunks or
        contiguous halves per thread, which defeat the kernel's read-ahead or the read/decode overlap."""
        n = len(out)
        has_tail = bool(part) and part[-1][0] + chunk > n
        scratch = np.empty(chunk if has_tail else 0, out.dtype)          # [chunk]: for the tail chunk
        buf = memoryview(bytearray(max((e[3] for e in part), default=0)))
        for first, _, byte_offset, size in part:
            whole = first + chunk <= n
            target = out[first:first + chunk] if whole else scratch      # [chunk]
            if codec == "none":  # stored bytes are the elements: read them in place
                if size != target.nbytes:
                    raise ChunkError(f"dataset {name}: chunk at {first} holds {size} bytes, expected {target.nbytes}")
                _read_stored(self._fd, memoryview(target).cast("B"), size, byte_offset, name, first)
            else:
                _decode_into(target, _read_stored(self._fd, buf, size, byte_offset, name, first), name, first)
            if not whole:
                out[first:] = scratch[:n - first]
