"""Prefetch of announced shards: the s3 store's trainer side fetches a shard while it waits for the batch.

    pre = ShardPrefetch(fetch, at_once=2, max_bytes=256 << 20, spool_dir="")
    pre.offer(announcement)           # the queue's "shard ready" (any thread): fetched now if the bound allows
    cols = pre.take(key, sha256)      # the trainer's read: the parsed columns (waits for one under way) or None

Without it the trainer learns of a batch's shards only when the batch is done, and then GETs and parses them
while it waits. With it, a shard's GET, checksum and parse (to columns, `data.shards.read_arrays`, default
bounds) run on `at_once` background threads as soon as its announcement arrives, overlapping the wait for the
rest of the batch; the read then only checks the columns against its own bounds (`data.shards.rows_of`).

It is a cache, never the record: announcements are still indexed and acked only by the store's durable consumer
(`S3Store.poll`), exactly as without it, and a shard that is not held (not announced while watched, no room,
a failed fetch, a checksum or parse error, another announcement's checksum) is fetched by the read as before, so
every error surfaces there as it did (retries, quarantine).

Bound: the bytes held -- a shard counts its object size from its announcement until it is parsed, then its
columns' size -- never exceed `max_bytes`: a shard that does not fit, when announced or once parsed, is not
kept (counted `full`), after evicting finished ones of folders the trainer has already read (late duplicates it
would never take). A shard's
memory is released when the trainer takes it. A shard taken or read once is not fetched again.
"""
from __future__ import annotations

import logging
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

TAKEN_KEPT = 65536
"""Keys of shards already read that are remembered (a late duplicate announcement of one is not fetched)."""


@dataclass
class Held:
    """One prefetched (or prefetching) shard."""

    folder: str
    """The announcement's folder key (its batch)."""
    sha256: str
    """The checksum its announcement carried (a read expecting another one ignores this copy)."""
    size: int
    """Bytes it counts against the bound: its object size until parsed, then its columns' size."""
    future: Future = field(default_factory=Future)
    """-> its TrajectoryColumns, or None when its fetch or parse failed (the read fetches it again)."""


class ShardPrefetch:
    """Announced shards fetched and parsed in the background, held until the trainer takes them (see module)."""

    def __init__(self, fetch: Callable[[str, Path, str], None], at_once: int, max_bytes: int, spool_dir: str = ""):
        """fetch(key, path, sha256): the shard's object into `path`, checked against `sha256` (raises on any
        failure, one attempt). at_once: fetches under way at once; max_bytes: the bound on what is held."""
        self.fetch, self.max_bytes, self.spool_dir = fetch, max_bytes, spool_dir
        self.pool = ThreadPoolExecutor(at_once, thread_name_prefix="shard-prefetch")
        self.held: dict[str, Held] = {}  # key -> shard, in arrival order
        self.taken: OrderedDict[str, None] = OrderedDict()
        self.read_folders: set[str] = set()
        self.bytes = 0
        self.counts = {"announced": 0, "offered": 0, "hits": 0, "misses": 0, "full": 0, "failed": 0, "evicted": 0,
                       "peak_bytes": 0}
        """announced: announcements seen; offered: announcements fetched (one may still be dropped as `full`
        once parsed); hits/misses: reads served from / not from here; full: not fetched or
        dropped for the bound; failed: fetches or parses that failed; evicted: unread shards dropped for room;
        peak_bytes: the most bytes held at once."""
        self._lock = threading.Lock()
        self._closed = False

    def offer(self, note: dict) -> None:
        """An announcement (`S3Store.publish`'s JSON: key, folder, sha256, bytes) seen on the queue: its shard is
        fetched now if it is new and fits. Anything else is ignored (this is a hint, never the record)."""
        try:
            key, folder, sha, size = str(note["key"]), str(note["folder"]), str(note["sha256"]), int(note["bytes"])
        except (KeyError, TypeError, ValueError):
            return
        with self._lock:
            self.counts["announced"] += 1
            if self._closed or key in self.held or key in self.taken:
                return
            if not self._room(size):
                self.counts["full"] += 1
                return
            shard = self.held[key] = Held(folder, sha, size)
            self._count(size)
            self.counts["offered"] += 1
            self.pool.submit(self._fetch, key, shard)

    def take(self, key: str, folder: str, sha256: str):
        """The shard's columns if it is held (waiting for a fetch under way), its memory released; None when it
        is not held or is not the announced `sha256` (the caller fetches it itself)."""
        with self._lock:
            shard = self.held.pop(key, None)
            self._remember(key, folder)
            if shard is None:
                self.counts["misses"] += 1
                return None
        cols = shard.future.result()
        hit = cols is not None and shard.sha256 == sha256
        with self._lock:
            self.bytes -= shard.size
            self.counts["hits" if hit else "misses"] += 1
        return cols if hit else None

    def close(self) -> None:
        """Stop: fetches under way finish (their spool files removed), queued ones are dropped, memory freed."""
        with self._lock:
            self._closed = True
        self.pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for shard in self.held.values():
                if not shard.future.done():  # its fetch was dropped before it started
                    shard.future.set_result(None)
            self.held.clear()
            self.bytes = 0

    # ----------------------------------------------------------------------------------------- internals
    def _fetch(self, key: str, shard: Held) -> None:
        """On a pool thread: GET, checksum, parse; then the shard counts its columns' size (dropped if that
        breaks the bound)."""
        from megatron_rl.data.shards import read_arrays

        try:
            with tempfile.TemporaryDirectory(dir=self.spool_dir or None, prefix="mrl-prefetch-") as tmp:
                path = Path(tmp) / Path(key).name
                self.fetch(key, path, shard.sha256)
                cols = read_arrays(path, threads=1)  # off the critical path: no parallel decode beside the others
        except BaseException as e:  # noqa: BLE001  the read fetches it again and meets the error there
            log.debug("store: prefetch of %s failed (%s: %s); read on demand", key, type(e).__name__, e)
            with self._lock:
                self.counts["failed"] += 1
                self._drop(key, shard)
            shard.future.set_result(None)
            return
        size = columns_bytes(cols)
        with self._lock:
            self.bytes += size - shard.size
            shard.size = size
            if not self._room(0):  # parsed, it is larger than its object and does not fit: the read GETs it
                self.counts["full"] += 1
                cols = None
                self._drop(key, shard)
            self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self.bytes)
        shard.future.set_result(cols)

    def _room(self, size: int) -> bool:
        """Whether `size` more bytes fit, evicting finished shards of folders already read (oldest first) as
        needed."""
        for key in [k for k, s in self.held.items() if s.folder in self.read_folders and s.future.done()]:
            if self.bytes + size <= self.max_bytes:
                break
            self.bytes -= self.held.pop(key).size
            self.counts["evicted"] += 1
        return self.bytes + size <= self.max_bytes

    def _drop(self, key: str, shard: Held) -> None:
        """Release a shard that will not be served (also when a read waits for it: it then gets None)."""
        if self.held.get(key) is shard:
            del self.held[key]
        self.bytes -= shard.size
        shard.size = 0

    def _count(self, size: int) -> None:
        self.bytes += size
        self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self.bytes)

    def _remember(self, key: str, folder: str) -> None:
        self.read_folders.add(folder)
        self.taken[key] = None
        if len(self.taken) > TAKEN_KEPT:
            self.taken.popitem(last=False)


def columns_bytes(cols) -> int:
    """Memory held by a shard's columns: their arrays, plus the characters of their string columns."""
    out = 0
    for value in vars(cols).values():
        for a in (value.values() if isinstance(value, dict) else [value]):
            if isinstance(a, np.ndarray):
                out += a.nbytes + (sum(len(str(x)) for x in a) if a.dtype == object else 0)
    return out
