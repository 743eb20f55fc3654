"""The fleet's episode queue: leases with deadlines, heartbeats, fencing. Pure bookkeeping (no I/O, no clock).

    q = LeaseQueue(lease_s=30)
    q.put("g0000000-g0000003", episodes, meta={"shard_dir": ..., "url": ...})
    lease = q.lease("w1", max_episodes=8, now=t)   # episodes of one batch, deadline t + lease_s
    q.heartbeat("w1", [lease.id], now)          # extends the worker's leases; returns the ids it no longer holds
    q.commit("w1", lease.id, now)                 # may I publish? (False: it was revoked; publish nothing)
    q.complete(lease.id, published_ids, now)      # the rest of the lease goes back to the queue
    for lease in q.expired(now): ...              # the caller re-queues what is not published (`requeue`)
    q.overdue(now, limit_s=600)                   # workers whose lease is out that long unpublished: hung

An episode is in exactly one place: pending, leased (to one lease), published or given up. A lease that
expired (no heartbeat within `lease_s`) or whose worker is known lost is gone: its worker's heartbeat hears
"lost" and must not publish it (fencing); the caller checks the published shards and re-queues the rest.
Before publishing, a worker commits the lease: a committed lease is not revoked when its worker is found
lost, only at its deadline (the worker had `lease_s` to rename its shard into place), so a worker that is
still alive after its job was cancelled cannot publish episodes that were already handed to another.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Lease:
    """Episodes of one batch held by one worker until `deadline`."""

    id: str
    """Unique lease id (also in the shard names the worker publishes)."""
    worker: str
    """Worker id that holds it."""
    batch: str
    """Batch the episodes belong to."""
    episodes: list
    """EpisodeSpecs leased."""
    deadline: float
    """Expires at this time unless a heartbeat extends it."""
    attempt: int = 0
    """Highest earlier attempt count among its episodes (0 = first time out)."""
    committed: bool = False
    """The worker was allowed to publish it: it is settled only at its deadline (from the shards)."""
    granted: float = 0.0
    """When it was handed out (heartbeats extend `deadline`, never this)."""


@dataclass
class _Batch:
    meta: dict
    pending: deque = field(default_factory=deque)
    leased: set[str] = field(default_factory=set)
    published: set[str] = field(default_factory=set)
    given_up: dict[str, str] = field(default_factory=dict)
    first_lease_at: float | None = None


class LeaseQueue:
    """See the module docstring. Not thread-safe: the server holds one lock around every call."""

    def __init__(self, lease_s: float, max_attempts: int = 3):
        self.lease_s, self.max_attempts = lease_s, max_attempts
        self.batches: dict[str, _Batch] = {}
        self.leases: dict[str, Lease] = {}
        self.attempts: dict[str, int] = {}
        """episode id -> times leased so far."""
        self.counters = {"leases": 0, "leases_expired": 0, "episodes_requeued": 0, "episodes_given_up": 0,
                         "fenced_heartbeats": 0}
        self._ids = itertools.count()

    # ------------------------------------------------------------------------------------------- batches
    def put(self, batch: str, episodes: list, meta: dict, published: set[str] = frozenset()) -> None:
        """Add a batch; episodes already in `published` count as done (a restarted driver's queue)."""
        if batch in self.batches:
            raise ValueError(f"fleet queue: batch {batch!r} is already queued")
        b = self.batches[batch] = _Batch(dict(meta))
        for e in episodes:
            (b.published.add(e.episode_id) if e.episode_id in published else b.pending.append(e))

    def done(self, batch: str) -> bool:
        b = self.batches[batch]
        return not b.pending and not b.leased

    def pop(self, batch: str) -> _Batch:
        """Forget a finished (or abandoned) batch; its leases are revoked."""
        for lid in [lid for lid, le in self.leases.items() if le.batch == batch]:
            del self.leases[lid]
        return self.batches.pop(batch)

    def pending(self) -> int:
        return sum(len(b.pending) for b in self.batches.values())

    # -------------------------------------------------------------------------------------------- leases
    def lease(self, worker: str, max_episodes: int, now: float) -> Lease | None:
        """Up to `max_episodes` pending episodes of the oldest batch with work, or None."""
        for name, b in self.batches.items():
            if not b.pending:
                continue
            eps = [b.pending.popleft() for _ in range(min(max_episodes, len(b.pending)))]
            attempt = max(self.attempts.get(e.episode_id, 0) for e in eps)
            for e in eps:
                self.attempts[e.episode_id] = self.attempts.get(e.episode_id, 0) + 1
            le = Lease(f"L{next(self._ids)}", worker, name, eps, now + self.lease_s, attempt, granted=now)
            self.leases[le.id] = le
            b.leased.update(e.episode_id for e in eps)
            b.first_lease_at = now if b.first_lease_at is None else b.first_lease_at
            self.counters["leases"] += 1
            return le
        return None

    def heartbeat(self, worker: str, lease_ids: list[str], now: float) -> list[str]:
        """Extend `worker`'s leases; returns those of `lease_ids` it no longer holds (it must not publish them)."""
        lost = []
        for lid in lease_ids:
            le = self.leases.get(lid)
            if le is None or le.worker != worker:
                lost.append(lid)
                continue
            le.deadline = now + self.lease_s
        self.counters["fenced_heartbeats"] += len(lost)
        return lost

    def commit(self, worker: str, lease_id: str, now: float) -> bool:
        """The worker asks to publish the lease: True (and `lease_s` more to do it) iff it still holds it. A
        committed lease is never re-queued before its deadline, and then only what is not in a shard."""
        le = self.leases.get(lease_id)
        if le is None or le.worker != worker:
            return False
        le.committed, le.deadline = True, now + self.lease_s
        return True

    def complete(self, lease_id: str, published: list[str], failed: dict[str, str] | None = None) -> bool:
        """The worker published `published` of the lease; its other episodes go back to the queue (retryable
        failures). False when the lease was no longer held (expired: the caller already re-queued it)."""
        le = self.leases.pop(lease_id, None)
        if le is None:
            return False
        b = self.batches[le.batch]
        done = set(published)
        b.published |= done & {e.episode_id for e in le.episodes}
        self._return(le, [e for e in le.episodes if e.episode_id not in done], failed or {})
        return True

    def expired(self, now: float) -> list[Lease]:
        """Remove and return the leases past their deadline (the caller re-queues what is unpublished)."""
        out = [le for le in self.leases.values() if le.deadline < now]
        for le in out:
            del self.leases[le.id]
        self.counters["leases_expired"] += len(out)
        return out

    def overdue(self, now: float, limit_s: float) -> set[str]:
        """Workers holding an uncommitted lease handed out more than `limit_s` ago: alive (heartbeating) but
        making no progress. Nothing is removed (the caller revokes the worker)."""
        return {le.worker for le in self.leases.values() if not le.committed and now - le.granted > limit_s}

    def revoke_worker(self, worker: str) -> list[Lease]:
        """A worker known lost (its job ended): remove and return its leases at once, except committed ones
        (it may be writing their shard): those settle at their deadline."""
        out = [le for le in self.leases.values() if le.worker == worker and not le.committed]
        for le in out:
            del self.leases[le.id]
        self.counters["leases_expired"] += len(out)
        return out

    def requeue(self, le: Lease, published: set[str], reason: str) -> None:
        """Settle a removed lease: its published episodes are done, the rest pending again (or given up)."""
        b = self.batches.get(le.batch)
        if b is None:
            return
        b.published |= published & {e.episode_id for e in le.episodes}
        rest = [e for e in le.episodes if e.episode_id not in published]
        self._return(le, rest, {e.episode_id: f"{reason} (attempt {self.attempts.get(e.episode_id, 0)})"
                                for e in rest})

    def _return(self, le: Lease, episodes: list, failed: dict[str, str]) -> None:
        b = self.batches[le.batch]
        b.leased -= {e.episode_id for e in le.episodes}
        for e in reversed(episodes):  # to the front: the oldest work first
            if self.attempts.get(e.episode_id, 0) >= self.max_attempts:
                b.given_up[e.episode_id] = failed.get(e.episode_id, "lease lost or episode failed "
                                                      f"{self.attempts[e.episode_id]} times")
                self.counters["episodes_given_up"] += 1
                continue
            b.pending.appendleft(e)
            self.counters["episodes_requeued"] += 1
