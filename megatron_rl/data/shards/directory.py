"""ShardDirectory: a trainer's view of a folder of shards (staleness, quarantine, episode-id dedup, one consumer per
folder)."""
from __future__ import annotations

import fcntl
import itertools
import logging
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import hdf5plugin  # noqa: F401  (registers the blosc filter; readers need it to decompress)
import numpy as np

from megatron_rl.config import ConfigError
from megatron_rl.data.shards.columns import TrajectoryColumns
from megatron_rl.data.shards.reader import ShardReader
from megatron_rl.data.shards.schema import SHARD_SUFFIXES, ShardError

logger = logging.getLogger(__name__)

@dataclass
class ShardDirectoryConfig:
    """Where and how the trainer picks up shards; `build()` returns a ShardDirectory."""

    root: str = "runs/shards"
    """Folder the rollout workers publish shards into."""
    max_staleness: int | None = None
    """Keep samples with policy_version_first >= current - max_staleness; None keeps all (0 = on-policy)."""
    prefetch: bool = True
    """Read the next shard in a background thread while the trainer works."""
    quarantine_dir: str = "quarantine"
    """Sub-folder of `root` that unreadable shards are moved into, each with a `<name>.reason.txt`."""
    dedup_window: int = 1_000_000
    """Episode ids remembered for duplicate dropping (the most recent ones; retries re-publish recent episodes)."""
    read_threads: int = 0
    """Threads decoding a shard's per-token chunks (data/chunk_io.py); 0 = one per usable core, at most 4."""
    vocab_size: int | None = None
    """The policy's vocabulary: a shard holding a token id >= it is quarantined (None: ids up to MAX_TOKEN_ID)."""
    max_version_ahead: int | None = None
    """Quarantine a shard with a policy version more than this above the current one (0: none above it); None:
    only the absolute bound MAX_POLICY_VERSION (a trainer restarted from an older checkpoint legitimately finds
    shards of versions it has not reached again yet)."""

    def validate(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"shard max_staleness {self.max_staleness} must be >= 0 or None")
        if self.dedup_window < 1:
            raise ConfigError(f"shard dedup_window {self.dedup_window} must be >= 1")
        if self.read_threads < 0:
            raise ConfigError(f"shard read_threads {self.read_threads} must be >= 0 (0 = one per core, at most 4)")
        if not self.quarantine_dir or "/" in self.quarantine_dir:
            raise ConfigError(f"shard quarantine_dir {self.quarantine_dir!r} must be a plain folder name")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"shard vocab_size {self.vocab_size} must be >= 1 (or None: not checked)")
        if self.max_version_ahead is not None and self.max_version_ahead < 0:
            raise ConfigError(f"shard max_version_ahead {self.max_version_ahead} must be >= 0 (or None: off)")

    def build(self) -> ShardDirectory:
        self.validate()
        return ShardDirectory(self.root, self.max_staleness, prefetch=self.prefetch,
                              quarantine_dir=self.quarantine_dir, dedup_window=self.dedup_window,
                              read_threads=self.read_threads, vocab_size=self.vocab_size,
                              max_version_ahead=self.max_version_ahead)


@dataclass
class ShardStats:
    """Counts, per shard (ShardBatch.stats) or cumulative (ShardDirectory.stats)."""

    shards: int = 0
    """Shards read successfully."""
    samples_read: int = 0
    """Samples found in those shards."""
    samples_kept: int = 0
    """Samples returned to the trainer."""
    dropped_stale: int = 0
    """Samples older than current_version - max_staleness."""
    dropped_duplicate: int = 0
    """Samples whose episode_id was already consumed (dispatch retries)."""
    quarantined: int = 0
    """Shards moved to quarantine."""

    def add(self, other: ShardStats) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class ShardBatch:
    """The kept samples of one shard."""

    path: Path
    """The shard they came from."""
    columns: TrajectoryColumns
    """Kept samples, columnar."""
    stats: ShardStats
    """What was read, kept and dropped in this shard."""


CONSUMER_LOCK = ".consumer.lock"
"""File in a shard folder that its one consumer holds an exclusive flock on (and names itself in)."""


class _ConsumerLock:
    """Exclusive, non-blocking flock on `<root>/.consumer.lock`, taken by a ShardDirectory on first read, so a
    second consumer of the same folder fails loudly instead of taking episodes twice or stealing them."""

    _warned: set[str] = set()

    def __init__(self, root: Path):
        self.root = root
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        fd = os.open(self.root / CONSUMER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "holder unknown"
            os.close(fd)
            raise ShardError(f"shard folder {self.root} is already read by another consumer ({holder}); give "
                             f"each trainer its own folder (one consumer per folder keeps every episode exactly "
                             f"once)") from None
        except OSError as e:  # a file system without flock (some NFS/Lustre mounts): the rule is not enforced
            os.close(fd)
            if str(self.root) not in self._warned:
                self._warned.add(str(self.root))
                logger.warning("shard folder %s: cannot lock %s (%s); one consumer per folder is not enforced",
                               self.root, CONSUMER_LOCK, e)
            self._fd = -1
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None


class ShardDirectory:
    """The trainer's view of a shard folder: new shards in publish order, each consumed exactly once.

    A shard counts as consumed when `next_batch` returns it; checkpoint `state_dict()` together with any
    samples the trainer still buffers. Only one consumer per folder: the first read takes a lock on the folder
    (`.consumer.lock`, released by `close()`, or when the object or its process goes), and a second
    ShardDirectory on the same folder raises ShardError naming the holder. Unreadable shards, and shards whose
    values break the contract (ShardReader's checks; with `max_version_ahead`, a policy version too far above the
    current one), are quarantined
    with the reason and skipped, never raised. Files ending in `.tmp` (unfinished writers) are ignored. Consumed
    shards are remembered by file name, so writers must use a new name per write attempt; an episode re-written by a
    retry under another name is dropped as a duplicate by its episode_id (the last `dedup_window` kept ids
    are remembered, so memory stays bounded on long runs).
    """

    def __init__(self, root: str | os.PathLike, max_staleness: int | None = None, *, prefetch: bool = True,
                 quarantine_dir: str = "quarantine", dedup_window: int = 1_000_000, read_threads: int = 0,
                 vocab_size: int | None = None, max_version_ahead: int | None = None):
        self.root = Path(root)
        self.read_threads = read_threads
        self.vocab_size, self.max_version_ahead = vocab_size, max_version_ahead
        self.max_staleness = max_staleness
        self.prefetch = prefetch
        self.quarantine_root = self.root / quarantine_dir
        self.stats = ShardStats()
        self._consumed: set[str] = set()
        self.dedup_window = dedup_window
        self._seen_ids: dict[str, None] = {}  # insertion-ordered: the oldest ids leave first
        self._prefetched: tuple[str, queue.Queue] | None = None
        self._lock = _ConsumerLock(self.root)

    def close(self) -> None:
        """Let another consumer read this folder (e.g. a restarted trainer in the same process)."""
        self._lock.release()

    def __enter__(self) -> ShardDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_lock"):
            self._lock.release()

    # -- listing and state
    def list_new(self) -> list[Path]:
        """Unconsumed shards, oldest first (by modification time, then name)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in os.scandir(self.root):
            if entry.is_file() and entry.name.endswith(SHARD_SUFFIXES) and entry.name not in self._consumed:
                try:
                    found.append((entry.stat().st_mtime_ns, entry.name))
                except FileNotFoundError:  # quarantined or removed meanwhile
                    continue
        return [self.root / name for _, name in sorted(found)]

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: consumed shard names, seen episode ids, cumulative stats."""
        return {"version": 1, "consumed": sorted(self._consumed), "seen_episode_ids": list(self._seen_ids),
                "stats": dict(vars(self.stats))}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"ShardDirectory state version {state.get('version')!r} unknown (expected 1)")
        self._consumed = set(state["consumed"])
        self._seen_ids = {}
        self._remember(state["seen_episode_ids"])
        self.stats = ShardStats(**state["stats"])
        self._prefetched = None

    # -- reading
    def next_batch(self, current_version: int) -> ShardBatch | None:
        """The next readable shard's kept samples, or None when no new shard is there now."""
        if self.root.is_dir():
            self._lock.acquire()
        while True:
            pending = self.list_new()
            if not pending:
                return None
            path = pending[0]
            columns = self._take(path)
            if self.prefetch and len(pending) > 1:
                self._start_prefetch(pending[1])
            self._consumed.add(path.name)
            if not isinstance(columns, BaseException) and self.max_version_ahead is not None:
                columns = _not_ahead(path, columns, current_version + self.max_version_ahead)
            if isinstance(columns, BaseException):
                self._quarantine(path, columns)
                continue
            return self._filter(path, columns, current_version)

    def __iter__(self) -> Iterator[ShardBatch]:
        raise TypeError("iterate with next_batch(current_version): staleness depends on the current version")

    def _take(self, path: Path) -> TrajectoryColumns | BaseException:
        if self._prefetched is not None and self._prefetched[0] == path.name:
            result = self._prefetched[1].get()
            self._prefetched = None
            return result
        return _load(path, self.read_threads, self.vocab_size)

    def _start_prefetch(self, path: Path) -> None:
        box: queue.Queue = queue.Queue(maxsize=1)
        threading.Thread(target=lambda: box.put(_load(path, self.read_threads, self.vocab_size)),
                         name=f"shard-prefetch-{path.name}", daemon=True).start()
        self._prefetched = (path.name, box)

    def _filter(self, path: Path, cols: TrajectoryColumns, current_version: int) -> ShardBatch:
        n = len(cols)
        stats = ShardStats(shards=1, samples_read=n)
        keep = np.ones(n, bool)
        batch_ids: set[str] = set()
        for i, eid in enumerate(cols.episode_id):
            if eid in self._seen_ids or eid in batch_ids:
                keep[i] = False
                stats.dropped_duplicate += 1
            batch_ids.add(eid)
        if self.max_staleness is not None:
            stale = keep & (cols.policy_version_first < current_version - self.max_staleness)
            stats.dropped_stale = int(stale.sum())
            keep &= ~stale
        kept = cols.select(keep)
        self._remember(kept.episode_id.tolist())
        stats.samples_kept = len(kept)
        self.stats.add(stats)
        return ShardBatch(path, kept, stats)

    def _remember(self, ids) -> None:
        for eid in ids:
            self._seen_ids[eid] = None
        for eid in list(itertools.islice(self._seen_ids, max(0, len(self._seen_ids) - self.dedup_window))):
            del self._seen_ids[eid]

    def _quarantine(self, path: Path, error: BaseException) -> None:
        self.quarantine_root.mkdir(parents=True, exist_ok=True)
        target = self.quarantine_root / path.name
        if target.exists():
            target = self.quarantine_root / f"{path.stem}.{time.time_ns()}{path.suffix}"
        reason = (f"time: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\nshard: {path}\n"
                  f"error: {type(error).__name__}: {error}\n\n"
                  + "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        try:
            os.replace(path, target)
            target.with_name(target.name + ".reason.txt").write_text(reason)
        except OSError as e:
            logger.warning("shard %s is unreadable and could not be quarantined (%s); skipping it", path, e)
        else:
            logger.warning("quarantined shard %s -> %s: %s: %s", path, target, type(error).__name__, error)
        self.stats.quarantined += 1


def _load(path: Path, threads: int = 0, vocab_size: int | None = None) -> TrajectoryColumns | BaseException:
    """Read a whole shard; any failure is returned (to be quarantined), never raised."""
    try:
        with ShardReader(path, threads, vocab_size=vocab_size) as r:
            return r.read_arrays()
    except Exception as e:  # corrupt input of any kind must not crash the trainer
        return e


def _not_ahead(path: Path, cols: TrajectoryColumns, limit: int) -> TrajectoryColumns | ShardError:
    """`cols`, or the error to quarantine them with when a policy version is above `limit` (no policy that new
    exists: the shard lies about where its tokens came from)."""
    for name in ("policy_version_last", "token_versions"):
        a = getattr(cols, name)
        if a is not None and len(a) and int(a.max()) > limit:
            return ShardError(f"shard {path}: invalid values: {name} {int(a.max())} is above {limit} (the current "
                              f"policy version plus max_version_ahead)")
    return cols
