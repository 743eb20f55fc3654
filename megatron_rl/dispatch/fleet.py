"""A persistent rollout fleet: long-lived workers (one submitit job array per fleet) pull episodes from the
driver's queue, run them in their sandbox pool and publish shards.

    fleet = Fleet(FleetConfig(executor="slurm", size=8), worker_cfg, run_dir / "fleet").start()
    report = fleet.run_batch("g0000000-g0000007", episodes, shard_dir, engine_url)   # every step
    fleet.resize(16); ...; fleet.close()

Why a queue served over HTTP by the driver (not files on the shared filesystem): leases need one arbiter
(atomic hand-out without file locks, which NFS/Lustre do not give reliably), a long-polled /lease hands a warm
worker the next step's episodes within milliseconds, and it creates no file per episode or lease. The queue
holds nothing that the published shards do not: a restarted driver rebuilds it from the episodes its loop
asks for minus those already published, and workers find the new driver through `<folder>/queue.json`.

Exactly once: an episode is done iff it is in a published shard. A lease not heartbeated within `lease_s`, or
whose worker's job ended (scheduler), is revoked: the shards are checked and what is unpublished goes back to
the queue; the old holder's next heartbeat hears "lost" and it publishes nothing of it (fencing). A copy
published anyway in the race is dropped by episode id when read (first copy wins) and counted.

Hung workers: one silent for `lease_s` is dropped and its leases re-queued; still silent after `silent_s`
(stopped, deadlocked, cut off), or holding a lease unpublished for `hung_s` while its heartbeats go on (an
episode that never ends), its job is cancelled (scancel; a local job's controller kills it) so that the next
top-up replaces it; if it wakes up, it is told to stop and may not publish. Workers of executor `external`
(started by the job script) are dropped the same way but neither cancelled nor replaced.

Scheduler: one submission per fleet (a job array of `size` workers); a replacement array only when workers
were lost or the fleet grew. Job states are queried (one sacct for all) only while some submitted worker has
not joined or some joined worker went silent, at most every `poll_s`, backing off x2 to `poll_max_s`.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.dispatch.fleet_server import FleetState, serve
from megatron_rl.dispatch.lease_queue import Lease, LeaseQueue
from megatron_rl.dispatch.spec import WorkerConfig

log = logging.getLogger(__name__)


@dataclass
class FleetConfig:
    """Size, resources and timing of a persistent rollout fleet (`episodes.fleet`)."""

    executor: str = "local"
    """How workers start: local (submitit processes here), slurm (one submitit job array), or external (started
    by the job script, e.g. the CPU component of slurm/rl_hetjob.sbatch; none are submitted or replaced)."""
    size: int = 2
    """Workers wanted; a file `<folder>/size` holding a number overrides it while the run goes on."""
    folder: str = ""
    """Fleet folder (queue.json, token, jobs.json, submitit logs); '' = <run>/fleet."""
    partition: str = "cpu"
    """Slurm partition of the workers."""
    account: str = ""
    """Slurm account ('' = the user's default)."""
    qos: str = ""
    """Slurm QOS ('' = the default)."""
    time_min: int = 240
    """Time limit of a worker job, minutes; on the limit (or preemption) it requeues itself."""
    cpus_per_task: int = 1
    """CPUs per worker; it runs that many episodes at once (or episodes.worker_threads)."""
    mem_gb: float = 2.0
    """Memory per worker, GB."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before a worker starts (module load, venv activation)."""
    episodes_per_lease: int = 8
    """Episodes handed out at once; a worker publishes one shard per lease (small episodes are batched)."""
    lease_s: float = 30.0
    """A lease not heartbeated for this long is revoked and its unpublished episodes re-queued."""
    heartbeat_s: float = 5.0
    """Seconds between a worker's heartbeats."""
    wait_s: float = 10.0
    """A worker's /lease waits this long for work (long poll) before asking again."""
    poll_s: float = 5.0
    """Fewest seconds between two scheduler queries (sacct); idle queries back off x2 up to poll_max_s."""
    poll_max_s: float = 60.0
    """Most seconds between scheduler queries while one is needed."""
    silent_s: float = 120.0
    """A worker silent this long (dropped after lease_s, its leases re-queued) whose job still runs -- stopped,
    deadlocked, cut off from the driver -- has its job cancelled and replaced; a requeued worker that rejoins
    sooner is kept."""
    hung_s: float = 3600.0
    """A worker holding a lease this long unpublished (alive and heartbeating, but no progress) is hung: its
    job is cancelled and replaced, the lease re-queued (0 = off; set it above the slowest lease's episodes)."""
    orphan_exit_s: float = 300.0
    """A worker exits when the driver has been unreachable this long."""
    max_attempts: int = 3
    """Times an episode is handed out at most; after that it is given up (a missing sample)."""
    max_num_timeout: int = 20
    """Requeues of a worker job after its time limit or preemption."""
    signal_delay_s: int = 60
    """Slurm sends the requeue signal this many seconds before the time limit."""
    serve_host: str = ""
    """Address workers use to reach the queue ('' = 127.0.0.1 for local, this host's name for slurm)."""

    def validate(self) -> None:
        if self.executor not in ("local", "slurm", "external"):
            raise ConfigError(f"episodes.fleet.executor must be local, slurm or external, got {self.executor!r}")
        if self.size < 1 or self.episodes_per_lease < 1 or self.cpus_per_task < 1 or self.max_attempts < 1:
            raise ConfigError("episodes.fleet.size, episodes_per_lease, cpus_per_task, max_attempts must be >= 1")
        if not 0 < self.heartbeat_s < self.lease_s:
            raise ConfigError(f"episodes.fleet.heartbeat_s ({self.heartbeat_s}) must be > 0 and below lease_s "
                              f"({self.lease_s}), or every lease expires between two heartbeats")
        if self.poll_s < 1.0 or self.poll_max_s < self.poll_s:
            raise ConfigError(f"episodes.fleet.poll_s must be >= 1 s (scheduler queries) and poll_max_s >= poll_s; "
                              f"got {self.poll_s}, {self.poll_max_s}")
        if self.silent_s < self.lease_s:
            raise ConfigError(f"episodes.fleet.silent_s ({self.silent_s}) must be >= lease_s ({self.lease_s}): a "
                              "worker is dropped after lease_s of silence, and cancelled only later")
        if self.hung_s and self.hung_s <= self.lease_s:
            raise ConfigError(f"episodes.fleet.hung_s ({self.hung_s}) must be 0 (off) or above lease_s "
                              f"({self.lease_s}): a lease is heartbeated for at least lease_s before it can hang")
        if self.wait_s <= 0 or self.orphan_exit_s <= self.wait_s:
            raise ConfigError("episodes.fleet.wait_s must be > 0 and orphan_exit_s > wait_s")


class Fleet:
    """The driver side of a fleet; see the module docstring. Thread-safe; `run_batch` may run concurrently."""

    def __init__(self, config: FleetConfig, worker: WorkerConfig, folder: str | Path, store=None):
        """store: where the workers' shards are published (`data.store`; None = the worker config's)."""
        from megatron_rl.data.store import store_for

        config.validate()
        self.config, self.worker = config, worker
        self.store = store if store is not None else store_for(worker)
        self.folder = Path(config.folder or folder).resolve()
        self.state = FleetState(LeaseQueue(config.lease_s, config.max_attempts))
        self.state.size = config.size
        self.jobs: dict[str, object] = {}
        """job id -> submitit job of a worker submitted (or adopted) by this driver."""
        self._adopted: list[str] = []
        self.counters = {"scheduler_queries": 0, "submissions": 0, "workers_submitted": 0, "workers_lost": 0,
                         "workers_hung": 0}
        self._poll, self._next_query, self._stop = config.poll_s, 0.0, threading.Event()
        self._executor = None
        self._failed_starts = 0
        self._dropped: dict[str, tuple[str, float]] = {}
        """Worker dropped for silence -> (its job, when last heard, pid): cancelled after silent_s unless it returns."""
        self.broken = ""
        """Why the fleet gave up (workers that die before joining, `size` times in a row); run_batch raises it."""
        self.httpd = None
        self.url = ""

    # ----------------------------------------------------------------------------------------- lifecycle
    def start(self) -> Fleet:
        """Serve the queue, publish its address, adopt an earlier driver's workers, submit the rest."""
        self.folder.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(24)
        bind, public = self._hosts()
        self.httpd = serve(self.state, token, bind)
        self.url = f"http://{public}:{self.httpd.server_address[1]}"
        c = self.config
        _write_private(self.folder / "queue.json", json.dumps({
            "url": self.url, "token": token, "pid": os.getpid(), "heartbeat_s": c.heartbeat_s, "wait_s": c.wait_s,
            "orphan_exit_s": c.orphan_exit_s, "episodes_per_lease": c.episodes_per_lease}))
        _write_private(self.folder / "worker.json", json.dumps(_plain(self.worker)))
        self._adopt()
        self._top_up()
        threading.Thread(target=self._monitor, name="fleet-monitor", daemon=True).start()
        log.info("fleet: queue at %s, %d workers wanted (%s), folder %s", self.url, self.config.size,
                 self.config.executor, self.folder)
        return self

    def resize(self, size: int) -> None:
        if size < 1:
            raise ConfigError(f"fleet size must be >= 1, got {size}")
        with self.state.cond:
            self.state.size = size
        self._top_up()

    def close(self, grace_s: float = 30.0) -> None:
        """Tell every worker to stop (their next request hears it; the queue serves until each live worker
        has), then cancel jobs still alive."""
        self._stop.set()
        with self.state.cond:
            self.state.closing = True
            self.state.cond.notify_all()
        end = time.monotonic() + grace_s
        while time.monotonic() < end and self.state.unaware(self.config.lease_s):
            time.sleep(0.2)
        while time.monotonic() < end and any(not _done(j) for j in self.jobs.values()):
            time.sleep(0.5)
        for j in self.jobs.values():
            if not _done(j):
                j.cancel(check=False)
        (self.folder / "jobs.json").unlink(missing_ok=True)  # every worker was told to stop: nothing to adopt
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()

    # ----------------------------------------------------------------------------------------- batches
    def run_batch(self, batch: str, episodes: list, shard_dir: Path, url: str, timeout_s: float | None = None
                  ) -> dict:
        """Queue `episodes` (those not yet published in `shard_dir`) and wait until each is published or given
        up. Returns counters: queued, recovered, given_up (id -> reason), first_lease_s, seconds."""
        from megatron_rl.dispatch.dispatcher import published_episode_ids

        t0 = time.monotonic()
        self.store.prepare(shard_dir)
        done = {e for ids in published_episode_ids(shard_dir, store=self.store).values() for e in ids}
        meta = {"shard_dir": str(shard_dir.resolve()), "url": url}
        with self.state.cond:
            self.state.queue.put(batch, episodes, meta, published=done)
            self.state.cond.notify_all()
            while not self.state.queue.done(batch):
                if self.broken:
                    self.state.queue.pop(batch)
                    raise RuntimeError(self.broken)
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    self.state.queue.pop(batch)
                    raise TimeoutError(f"fleet: batch {batch} not finished after {timeout_s}s ({self.status()})")
                self.state.cond.wait(1.0)
            b = self.state.queue.pop(batch)
        first = None if b.first_lease_at is None else round(b.first_lease_at - t0, 4)
        return {"queued": len(episodes) - len(done & {e.episode_id for e in episodes}),
                "recovered": len(done & {e.episode_id for e in episodes}), "given_up": dict(b.given_up),
                "first_lease_s": first, "seconds": round(time.monotonic() - t0, 3)}

    def status(self) -> dict:
        return {**self.state.status(), **self.counters, "jobs": sorted(self.jobs)}

    # ----------------------------------------------------------------------------------------- monitor
    def _monitor(self) -> None:
        while not self._stop.wait(min(1.0, self.config.heartbeat_s)):
            try:
                self._tick()
            except Exception:  # the monitor must not die: leases would never expire
                log.exception("fleet: monitor tick failed")

    def _tick(self) -> None:
        self._read_size_file()
        now = time.monotonic()
        with self.state.cond:
            expired = self.state.queue.expired(now)
            silent = [k for k, w in self.state.workers.items()
                      if now - w["last_seen"] > self.config.lease_s and k not in self.state.surplus]
            stuck = self.state.queue.overdue(now, self.config.hung_s) - set(silent) if self.config.hung_s else set()
            for k in [*silent, *stuck]:  # gone or hung: its leases expired above (or below); it no longer counts
                w = self.state.workers.pop(k)
                log.warning("fleet: worker %s %s; dropped", k, f"silent for {now - w['last_seen']:.0f}s"
                            if k in silent else f"hung: a lease unpublished after hung_s={self.config.hung_s:g}s")
                expired += self.state.queue.revoke_worker(k)
                self.counters["workers_lost"] += 1
                self._dropped[k] = (w["job"], w["last_seen"], w.get("pid", 0))
                if k in stuck:  # heartbeating, so alive: stuck
                    self._cancel_hung(w["job"], k, "no progress", w.get("pid", 0))
            for k in [k for k in self._dropped if k in self.state.workers]:
                del self._dropped[k]  # it talked again (a requeued worker back, a network blip over)
            for k, (job, seen, pid) in list(self._dropped.items()):
                if now - seen > self.config.silent_s:  # still silent: stopped, deadlocked or cut off
                    del self._dropped[k]
                    self._cancel_hung(job, k, f"silent for {now - seen:.0f}s", pid)
        self._settle(expired, "lease expired")
        if self._query_needed() and now >= self._next_query:
            changed = self._query()
            self._poll = self.config.poll_s if changed else min(self._poll * 2, self.config.poll_max_s)
            self._next_query = now + self._poll
        self._top_up()

    def _cancel_hung(self, job_id: str, worker: str, why: str, pid: int = 0) -> None:
        """A dropped worker's job may still run (stopped, deadlocked, cut off from the driver): cancel it
        (scancel; a local job's controller kills it), so that it stops counting towards the size and the next
        top-up replaces it. Its job is marked ended: if it wakes up, it is told to stop and may not publish."""
        job = self.jobs.get(job_id)
        if job is not None and _done(job):
            return  # it died (kill -9, node lost): the next scheduler query reports it ended
        self.state.ended_jobs.add(job_id)
        self.jobs.pop(job_id, None)
        if job is None and job_id in self._adopted:  # a local worker of an earlier driver: its controller's pid
            self._adopted.remove(job_id)
            _signal_pid(job_id, signal.SIGINT)
        elif job is not None:
            try:
                job.cancel(check=False)
            except Exception as e:  # scancel failed: the scheduler ends it at its time limit
                log.warning("fleet: cancelling job %s of hung worker %s failed: %s", job_id, worker, e)
        else:
            return  # not a job of this driver (an adopted Slurm job is in self.jobs)
        if self.config.executor == "local" and pid:
            # submitit cancels a local job with SIGINT to its controller, which a driver started in the background
            # (`cmd &` in a script: SIGINT ignored, inherited) never acts on: kill the worker itself (this host)
            _signal_pid(str(pid), signal.SIGKILL)
        self.counters["workers_hung"] += 1
        self._save_jobs()
        log.warning("fleet: cancelled job %s of worker %s (%s); a replacement follows", job_id, worker, why)

    def _settle(self, leases: list[Lease], reason: str) -> None:
        """Re-queue the unpublished episodes of revoked leases (published ones are done). The store is asked
        without holding the queue's lock: it may retry for minutes while its server restarts, and the workers'
        requests (heartbeats, leases, reports) must go on meanwhile. The leases are removed already, so nothing
        else settles them; a batch abandoned meanwhile is skipped by `requeue`."""
        if not leases:
            return
        with self.state.cond:
            dirs = {le.id: self.state.queue.batches[le.batch].meta["shard_dir"] for le in leases
                    if le.batch in self.state.queue.batches}
        known = {d: self._published(d, reason) for d in set(dirs.values())}
        with self.state.cond:
            for le in leases:
                if le.id not in dirs:
                    continue
                published = known[dirs[le.id]]
                log.warning("fleet: %s of worker %s (%s): %d episodes re-queued", le.id, le.worker, reason,
                            sum(e.episode_id not in published for e in le.episodes))
                self.state.queue.requeue(le, published, reason)
            self.state.cond.notify_all()

    def _published(self, shard_dir: str, reason: str) -> set[str]:
        """Episode ids published in `shard_dir`; none when the store cannot tell (all redone: a copy is dropped
        by episode id when read)."""
        from megatron_rl.dispatch.dispatcher import published_episode_ids

        try:
            return {e for ids in published_episode_ids(Path(shard_dir), store=self.store).values() for e in ids}
        except Exception as e:
            log.warning("fleet: published shards of %s unknown (%s; settling: %s); its leases' episodes re-queued",
                        shard_dir, e, reason)
            return set()

    def _query_needed(self) -> bool:
        """A scheduler query helps only while a submitted worker has not joined yet (pending, or dead before
        joining) or a joined worker's job may have ended."""
        with self.state.cond:
            joined = {w["job"] for w in self.state.workers.values()}
        return any(job not in joined for job in self.jobs)

    def _query(self) -> bool:
        """One scheduler query for every job; drops the ended ones. True when something changed."""
        self.counters["scheduler_queries"] += 1
        jobs = list(self.jobs.values())
        if not jobs:
            return False
        if self.config.executor == "slurm":
            jobs[0].done(force_check=True)  # one sacct refreshes the shared watcher for all jobs
        ended = [k for k, j in self.jobs.items() if _done(j)]
        for k in ended:
            job = self.jobs.pop(k)
            log.warning("fleet: worker job %s ended (%s)", k, _state(job))
            self._count_start(k, job)
            with self.state.cond:
                self.state.ended_jobs.add(k)
                lost = [w for w, v in self.state.workers.items() if v["job"] == k]
                leases = [le for w in lost for le in self.state.queue.revoke_worker(w)]
                for w in lost:
                    del self.state.workers[w]
                self.counters["workers_lost"] += len(lost)
            self._settle(leases, f"job {k} ended")
        if ended:
            self._save_jobs()
        return bool(ended)

    def _count_start(self, job_id: str, job) -> None:
        """A job that ended before any worker of it joined is a failed start; `size` in a row break the fleet
        (no endless resubmission of a worker that cannot start)."""
        if job_id in self.state.joined_jobs:
            self._failed_starts = 0
            return
        self._failed_starts += 1
        if self._failed_starts >= self.config.size and not self.broken:
            try:
                text = job.stderr()
            except Exception as e:  # log on a node's local disk, folder gone
                text = f"(stderr log unreadable: {e})"
            tail = "\n".join((text or "(no stderr log: the job ended before its worker started)").splitlines()[-30:])
            self.broken = (f"fleet: {self._failed_starts} worker jobs in a row ended before joining the queue "
                           f"(last: {job_id}, {_state(job)}); fix the worker environment (episodes.fleet.setup, "
                           f"partition, memory) -- its stderr:\n{tail}")
            log.error("%s", self.broken)
            with self.state.cond:
                self.state.cond.notify_all()

    def _read_size_file(self) -> None:
        """`<folder>/size` (an operator's `echo 16 > run/fleet/size`) resizes the fleet during the run."""
        path = self.folder / "size"
        try:
            size = int(path.read_text().strip())
        except FileNotFoundError:
            return
        except ValueError:
            log.warning("fleet: %s does not hold a number; ignored", path)
            return
        if size >= 1 and size != self.state.size:
            log.info("fleet: size %d -> %d (from %s)", self.state.size, size, path)
            with self.state.cond:
                self.state.size = size

    # ----------------------------------------------------------------------------------------- workers
    def _alive(self) -> int:
        """Workers that count towards the size: joined and not surplus, plus submitted ones not joined yet."""
        with self.state.cond:
            active = [self.state.workers[k]["job"] for k in self.state.active()]
        waiting = [k for k in self.jobs if k not in active]
        adopted = [k for k in self._adopted if k not in active and _pid_alive(k)]
        return len(active) + len(waiting) + len(adopted)

    def _top_up(self) -> None:
        if self._stop.is_set() or self.broken or self.config.executor == "external":
            return
        with self.state.cond:
            size = self.state.size
        missing = size - self._alive()
        if missing > 0:
            self._submit(missing)

    def _submit(self, n: int) -> None:
        from megatron_rl.dispatch.fleet_worker import FleetWorkerTask

        if self._executor is None:
            self._executor = self._build_executor()
        jobs = self._executor.map_array(FleetWorkerTask(), [str(self.folder)] * n)  # one submission
        self.counters["submissions"] += 1
        self.counters["workers_submitted"] += n
        for j in jobs:
            self.jobs[str(j.job_id)] = j
        self._save_jobs()
        self._poll, self._next_query = self.config.poll_s, time.monotonic() + self.config.poll_s
        log.info("fleet: submitted %d workers (%s)", n, ", ".join(str(j.job_id) for j in jobs))

    def _build_executor(self):
        from megatron_rl.dispatch.executor import submitit_executor

        return submitit_executor(self.config, self.folder / "submitit", "mrl-fleet", max(self.config.size, 1) * 4)

    def _save_jobs(self) -> None:
        _write_private(self.folder / "jobs.json", json.dumps(sorted(self.jobs)))

    def _adopt(self) -> None:
        """Workers an earlier driver submitted (it died; a clean close removes jobs.json): Slurm jobs are
        watched again; local ones (not re-attachable; their job id is the controller's pid) count while that
        process lives, and rejoin within wait_s."""
        path = self.folder / "jobs.json"
        if not path.is_file():
            return
        ids = json.loads(path.read_text())
        if self.config.executor == "slurm":
            import submitit

            for k in ids:
                self.jobs[k] = submitit.SlurmJob(folder=self.folder / "submitit" / "%j", job_id=k)
        else:
            self._adopted = list(ids)
        log.info("fleet: adopted %d workers of an earlier driver", len(ids))

    def _hosts(self) -> tuple[str, str]:
        if self.config.executor == "local":
            return "127.0.0.1", self.config.serve_host or "127.0.0.1"
        from megatron_rl.dispatch.net import node_address

        public = self.config.serve_host or socket.gethostname()
        return node_address(public), public


def _done(job) -> bool:
    try:
        return bool(job.done())
    except Exception:  # an adopted job whose folder is gone, sacct hiccups: treat as alive until known
        return False


def _pid_alive(job_id: str) -> bool:
    """A local worker (job id = its submitit controller's pid on this machine) still runs."""
    try:
        os.kill(int(job_id), 0)
    except (ValueError, ProcessLookupError, PermissionError):
        return False
    return True


def _signal_pid(job_id: str, sig: int) -> None:
    try:
        os.kill(int(job_id), sig)
    except (ValueError, ProcessLookupError, PermissionError):
        pass


def _state(job) -> str:
    try:
        return str(job.state)
    except Exception as e:
        return f"unknown ({e})"


def _plain(worker: WorkerConfig) -> dict:
    from megatron_rl.config import to_dict

    return to_dict(worker)


def _write_private(path: Path, text: str) -> None:
    """Atomic write, mode 600 (the token is in queue.json)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
