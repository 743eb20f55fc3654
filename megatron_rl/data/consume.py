"""The one consumer of worker shards: a batch folder's published shards read through its trajectory store.

    got = read_folder(folder, store, vocab_size=tok.vocab_size)   # the loop's read-back (loop.dispatched)
    got.trajectories   # every readable row, first copy of an episode id wins (a retried or re-leased publish)
    got.duplicates, got.quarantined, got.skipped   # what was dropped, each counted and logged with its reason

Rules (DESIGN.md section 3, "a shard that fails to open is quarantined with a logged reason, never crashes the
trainer"):
- A shard that cannot be read or whose values break the shard contract (`ShardReader`'s checks: token ids below
  `vocab_size`, finite bounded rewards, a valid CSR layout; on s3 its sha256 against its announcement) is
  quarantined by the store (`store.quarantine`: moved into `<folder>/quarantine/` with `<name>.reason.txt` on the
  filesystem, marked in the index on s3) with a warning, and its episodes count as missing (the dispatcher's
  next look finds them unfinished).
- A shard the store cannot fetch now (the object store down past its retries) is skipped, not quarantined: it
  is whole and is read on the next look.
- Rows are deduplicated by episode id in shard-name order (first copy wins).
- The store says how many shards are read at once (`store.reads_at_once`: 1 on the filesystem; on s3 the GETs
  overlap); the results are taken, quarantined and deduplicated in name order, on the caller's thread.
- Staleness is the trainer's bound on policy versions, applied to the step's batch (`loop.handoff.fresh_rows`),
  where it is counted (`dropped_stale`).
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class FolderRead:
    """What `read_folder` found in one folder."""

    trajectories: list = field(default_factory=list)
    """The kept rows (`Trajectory`), shard by shard in name order, each episode id once."""
    shards: int = 0
    """Shards read."""
    duplicates: int = 0
    """Rows dropped because an earlier row had their episode id."""
    quarantined: list[str] = field(default_factory=list)
    """'<where>: <reason>' of each shard quarantined."""
    skipped: list[str] = field(default_factory=list)
    """'<where>: <reason>' of each shard the store could not fetch now (read again next time)."""


def read_folder(folder: str | Path, store=None, vocab_size: int | None = None) -> FolderRead:
    """Every published shard of `folder` through `store` (None: the shared filesystem); see the module rules."""
    from megatron_rl.data.store import FsStore

    store = store or FsStore()
    out, seen = FolderRead(), set()
    names = store.shards(folder)
    at_once = min(store.reads_at_once, len(names))
    if at_once <= 1:
        for name in names:
            _take(out, seen, store, folder, name, None, vocab_size)
        return out
    with ThreadPoolExecutor(at_once, thread_name_prefix="shard-read") as pool:
        reads = [pool.submit(store.read, folder, name, vocab_size=vocab_size) for name in names]
        for name, read in zip(names, reads):
            _take(out, seen, store, folder, name, read, vocab_size)
    return out


def _take(out: FolderRead, seen: set, store, folder, name: str, read, vocab_size: int | None) -> None:
    """One shard's rows into `out` (`read`: its read under way, None: read it now); see the module rules."""
    from botocore.exceptions import BotoCoreError, ClientError

    from megatron_rl.data.shards import ShardError
    from megatron_rl.data.store import StoreError

    where = store.where(folder, name)
    try:
        trajs = read.result() if read is not None else store.read(folder, name, vocab_size=vocab_size)
    except (BotoCoreError, ClientError, StoreError) as e:  # the object store, not the shard
        log.warning("shards: %s could not be fetched, skipped for now: %s", where, e)
        out.skipped.append(f"{where}: {e}")
        return
    except (ShardError, OSError) as e:
        store.quarantine(folder, name, e)
        out.quarantined.append(f"{where}: {type(e).__name__}: {e}")
        return
    out.shards += 1
    for t in trajs:
        if t.episode_id in seen:
            out.duplicates += 1
            continue
        seen.add(t.episode_id)
        out.trajectories.append(t)
