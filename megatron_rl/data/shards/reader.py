"""ShardReader: opens a published shard, checks its schema and values, reads it back as trajectories or columns."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  (registers the blosc filter; readers need it to decompress)
import numpy as np

from megatron_rl.data.chunk_io import ChunkReader, codec_threads
from megatron_rl.data.shards.columns import TrajectoryColumns
from megatron_rl.data.shards.schema import (
    INT_COLUMNS,
    KNOWN_SCHEMA_VERSIONS,
    RAGGED,
    SCHEMA,
    STR_COLUMNS,
    ShardError,
    ShardSchemaError,
)
from megatron_rl.data.shards.trajectory import Trajectory

logger = logging.getLogger(__name__)

def _read_full(ds: h5py.Dataset) -> np.ndarray:
    """The whole dataset in native byte order (HDF5 converts: a big-endian float32 reads back as float32)."""
    out = np.empty(ds.shape, ds.dtype.newbyteorder("="))
    if out.size:
        ds.read_direct(out)
    return out


class ShardReader:
    """Opens a shard read-only and checks its schema and layout; a context manager. What it returns is checked
    as the writer checks it (`TrajectoryColumns.validate`: dtypes, finite and bounded rewards, token ids in the
    vocabulary, 0/1 loss mask, monotonic offsets, sane policy versions): a shard is written by a worker, which
    runs the policy's episodes, so its values are not trusted.

    Raises ShardSchemaError for another schema or an unknown schema version, ShardError for anything else that
    makes the shard unusable (the message names the file and the field).
    """

    REQUIRED = RAGGED + ("offsets", "reward") + INT_COLUMNS + STR_COLUMNS

    def __init__(self, path: str | os.PathLike, threads: int = 0, vocab_size: int | None = None,
                 max_version: int | None = None):
        """`vocab_size`: token ids must be below it (None: <= MAX_TOKEN_ID); `max_version`: policy versions must
        not exceed it (None: <= MAX_POLICY_VERSION)."""
        self.path = Path(path)
        self.threads = threads  # chunk decoding threads, 0 = one per usable core (at most 4)
        self.vocab_size, self.max_version = vocab_size, max_version
        try:
            self._file = h5py.File(self.path, "r", locking=False)  # published shards are immutable: see H5_LOCKING
        except OSError as e:
            raise ShardError(f"shard {self.path}: cannot open as HDF5 ({e})") from e
        try:
            self._check_schema()
            self._check_layout()
        except ShardError:
            self._file.close()
            raise
        except Exception as e:  # odd objects where datasets belong, unreadable attributes...
            self._file.close()
            raise ShardError(f"shard {self.path}: unreadable layout ({type(e).__name__}: {e})") from e

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    @property
    def h5(self) -> h5py.File:
        """The open, read-only h5py.File, for tools that read single datasets (e.g. `inspect`)."""
        return self._file

    @property
    def attrs(self) -> dict:
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in self._file.attrs.items()}

    def _check_schema(self) -> None:
        schema = self._file.attrs.get("schema")
        schema = schema.decode() if isinstance(schema, bytes) else schema
        if schema != SCHEMA:
            raise ShardSchemaError(f"shard {self.path}: schema attribute is {schema!r}, expected {SCHEMA!r}")
        version = self._file.attrs.get("schema_version")
        known = isinstance(version, (int, np.integer)) and not isinstance(version, (bool, np.bool_))
        if not known or int(version) not in KNOWN_SCHEMA_VERSIONS:
            raise ShardSchemaError(
                f"shard {self.path}: schema_version {int(version) if known else repr(version)} but this megatron-rl "
                f"reads versions {min(KNOWN_SCHEMA_VERSIONS)}..{max(KNOWN_SCHEMA_VERSIONS)}; upgrade megatron-rl to "
                "read it (or re-write the shard)")

    def _check_layout(self) -> None:
        f = self._file
        missing = [k for k in self.REQUIRED if k not in f]
        if missing:
            raise ShardError(f"shard {self.path}: missing datasets {missing} (not a finished shard)")
        n = f["offsets"].shape[0] - 1
        if n < 0 or int(f.attrs.get("num_samples", -1)) != n:
            raise ShardError(f"shard {self.path}: offsets has {n + 1} entries, attribute num_samples="
                             f"{f.attrs.get('num_samples')}")
        per_sample = [k for k in ("reward",) + INT_COLUMNS + STR_COLUMNS if f[k].shape != (n,)]
        per_sample += [f"{g}/{k}" for g in ("reward_components", "timing") if g in f
                       for k in f[g] if f[g][k].shape != (n,)]
        ragged = {k: f[k].shape for k in RAGGED + ("token_versions",) if k in f}
        if "routed_experts" in f:
            ragged["routed_experts"] = f["routed_experts"].shape[:1]
        if per_sample or len(set(ragged.values())) != 1:
            raise ShardError(f"shard {self.path}: inconsistent shapes (per-sample {per_sample}, per-token {ragged})")

    def __len__(self) -> int:
        return int(self._file["offsets"].shape[0] - 1)

    def _offsets(self) -> np.ndarray:
        offsets = _read_full(self._file["offsets"])
        t = self._file["tokens"].shape[0]
        if offsets.dtype.kind not in "iu" or offsets[0] != 0 or offsets[-1] != t or np.any(np.diff(offsets) < 0):
            raise ShardError(f"shard {self.path}: offsets are not a valid CSR over {t} tokens (integers, starting "
                             f"at 0, non-decreasing, ending at {t})")
        return offsets

    def read_arrays(self) -> TrajectoryColumns:
        """Everything, columnar: the trainer's fast path. The per-token datasets are decoded on a thread pool
        (data/chunk_io.py) while this thread reads the per-sample columns."""
        f = self._file
        try:
            with ChunkReader(self.path, codec_threads(self.threads)) as chunks:
                waits = {k: chunks.submit(f[k]) for k in RAGGED + ("token_versions",) if k in f}
                per_sample = self._per_sample()
                per_token = {k: _read_full(f[k]) if wait is None else wait() for k, wait in waits.items()}
            tv = per_token.pop("token_versions", None)
            cols = TrajectoryColumns(**per_token, offsets=self._offsets(), token_versions=tv, **per_sample,
                                     routed_experts=self._routes())
        except ShardError:
            raise
        except Exception as e:  # OSError, a decode error, odd dtypes: whatever it is, the shard is unusable
            raise ShardError(f"shard {self.path}: read failed ({type(e).__name__}: {e})") from e
        self._validate(cols)
        return cols

    def _validate(self, cols: TrajectoryColumns) -> None:
        _validate(cols, self.path, self.vocab_size, self.max_version)

    def _routes(self, s: int = 0, e: int | None = None) -> np.ndarray | None:
        """routed_experts [e - s, L_moe, k] as int16 with -1 where not recorded; None when the shard has none."""
        ds = self._file.get("routed_experts")
        if ds is None:
            return None
        raw = _read_full(ds) if s == 0 and e is None else ds[s:e]
        out = raw.astype(np.int16)  # ids <= ROUTE_MAX fit; the missing marker becomes -1 below
        out[raw == ds.attrs["missing"]] = -1
        return out

    def _per_sample(self) -> dict:
        f = self._file
        return {**{k: _read_full(f[k]) for k in INT_COLUMNS + ("reward",)},
                **{k: f[k].asstr()[()] if len(self) else np.zeros(0, object) for k in STR_COLUMNS},
                "reward_components": self._group("reward_components"), "timings": self._group("timing")}

    def _group(self, name: str) -> dict[str, np.ndarray]:
        g = self._file.get(name)
        return {} if g is None else {k: _read_full(g[k]).astype(np.float64) for k in g}

    def __getitem__(self, i: int) -> Trajectory:
        """Random access to one sample without reading the rest."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"shard {self.path} has {n} samples, index {i}")
        i %= n
        try:
            cols = self._one(i)
        except ShardError:
            raise
        except Exception as e:  # odd dtypes where strings or numbers belong
            raise ShardError(f"shard {self.path}: read failed ({type(e).__name__}: {e})") from e
        self._validate(cols)
        return self._rows(cols)[0]

    def _one(self, i: int) -> TrajectoryColumns:
        s, e = (int(x) for x in self._offsets()[i:i + 2])
        one = np.array([0, e - s], np.int64)
        f = self._file
        return TrajectoryColumns(
            **{k: f[k][s:e] for k in RAGGED}, offsets=one,
            token_versions=f["token_versions"][s:e] if "token_versions" in f else None,
            **{k: f[k][i:i + 1] for k in INT_COLUMNS + ("reward",)},
            **{k: f[k].asstr()[i:i + 1] for k in STR_COLUMNS},
            reward_components={k: v[i:i + 1] for k, v in f.get("reward_components", {}).items()},
            timings={k: v[i:i + 1] for k, v in f.get("timing", {}).items()}, routed_experts=self._routes(s, e))

    def read(self) -> list[Trajectory]:
        return self._rows(self.read_arrays())

    def _rows(self, cols: TrajectoryColumns) -> list[Trajectory]:
        return _rows(cols, self.path)


def _validate(cols: TrajectoryColumns, where, vocab_size: int | None, max_version: int | None) -> None:
    try:
        cols.validate(vocab_size, max_version)
    except Exception as e:  # TrajectoryError names the field; anything else is just as fatal
        raise ShardError(f"shard {where}: invalid values: {e}") from e


def _rows(cols: TrajectoryColumns, where) -> list[Trajectory]:
    try:
        return cols.to_trajectories()
    except Exception as e:  # a value the column checks let through but the row checks refuse
        raise ShardError(f"shard {where}: invalid values: {e}") from e


def read_shard(path: str | os.PathLike, **checks) -> list[Trajectory]:
    """All trajectories of a shard; `checks`: vocab_size, max_version (ShardReader)."""
    with ShardReader(path, **checks) as r:
        return r.read()


def read_arrays(path: str | os.PathLike, **checks) -> TrajectoryColumns:
    """All trajectories of a shard, columnar; `checks`: vocab_size, max_version (ShardReader)."""
    with ShardReader(path, **checks) as r:
        return r.read_arrays()


def rows_of(cols: TrajectoryColumns, where: str, vocab_size: int | None = None, max_version: int | None = None
            ) -> list[Trajectory]:
    """A shard's columns read earlier (`read_arrays`, e.g. by a prefetch before the caller's bounds were known),
    checked against `vocab_size`/`max_version` and turned into trajectories: what `read_shard` with those checks
    returns. ShardError names `where`."""
    _validate(cols, where, vocab_size, max_version)
    return _rows(cols, where)
