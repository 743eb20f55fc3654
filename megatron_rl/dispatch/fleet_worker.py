"""A long-lived fleet worker (one submitit job of the fleet's array): lease episodes from the driver's queue,
run them in one sandbox pool, publish one shard per lease, report it, ask again.

It finds the queue through `<fleet>/queue.json` (url, token, timing), re-read whenever the driver cannot be
reached, so a restarted driver (new port, new token) gets its workers back. A heartbeat thread extends the
lease; when the driver answers "lost" (the lease expired and was re-queued) the worker stops that lease and
publishes nothing of it; before publishing it commits the lease (/commit), and publishes only if the driver
says it still holds it. It exits when told to stop (the run is over, the fleet shrank) or when the driver
has been unreachable for `orphan_exit_s`. On Slurm's time-limit or preemption signal (submitit
Checkpointable) it publishes what is finished, reports it (the rest goes back to the queue) and requeues.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from megatron_rl import http_auth
from megatron_rl.config import from_dict
from megatron_rl.dispatch.spec import EpisodeSpec, WorkerConfig, WorkerSpec

log = logging.getLogger(__name__)


class Orphaned(RuntimeError):
    """The driver has been unreachable for longer than orphan_exit_s."""


class FleetWorker:
    """See the module docstring."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.cfg = from_dict(WorkerConfig, json.loads((self.folder / "worker.json").read_text()))
        self.job = _job_id()
        self.id = f"{self.job}@{socket.gethostname()}:{os.getpid()}"
        self.queue = self._read_queue()
        self.runner = None
        self.lease: dict | None = None
        self.lost = threading.Event()
        """The current lease was revoked by the driver: publish nothing of it."""
        self.stopping = threading.Event()
        self._lock = threading.RLock()  # also taken by the preemption handler (main thread, any time)
        self._finishing = False
        self.stats = {"leases": 0, "episodes": 0, "shards": 0, "fenced": 0}

    # ------------------------------------------------------------------------------------------ transport
    def _read_queue(self) -> dict:
        return json.loads((self.folder / "queue.json").read_text())

    def _post(self, path: str, body: dict, timeout: float) -> dict:
        """POST to the driver; on connection errors re-read queue.json and retry until orphan_exit_s."""
        first_fail, delay = None, 0.5
        while True:
            q = self.queue
            me = {"worker": self.id, "job": self.job, "host": socket.gethostname(), "pid": os.getpid()}
            req = urllib.request.Request(q["url"] + path, data=json.dumps({**me, **body}).encode(),
                                         headers={"Content-Type": "application/json", **http_auth.bearer(q["token"])})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return json.loads(r.read())
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
                # HTTPException: e.g. IncompleteRead, the driver died while answering (a kill -9, a requeue)
                now = time.monotonic()
                first_fail = first_fail or now
                if now - first_fail > float(q.get("orphan_exit_s", 300)):
                    raise Orphaned(f"fleet queue {q['url']} unreachable for {now - first_fail:.0f}s: {e}") from e
                time.sleep(delay)
                delay = min(delay * 2, float(q.get("wait_s", 10.0)))  # back in within wait_s of a restart
                try:
                    self.queue = self._read_queue()  # a restarted driver publishes its new address here
                except (OSError, ValueError):
                    pass

    # ------------------------------------------------------------------------------------------ main loop
    def run(self) -> dict:
        threading.Thread(target=self._heartbeats, name="fleet-heartbeat", daemon=True).start()
        self._warm_up()
        reason = "stopped"
        try:
            while not self.stopping.is_set():
                wait = float(self.queue.get("wait_s", 10.0))
                r = self._post("/lease", {"max": int(self.queue.get("episodes_per_lease", 8)), "wait_s": wait},
                               timeout=wait + 30)
                if "stop" in r:
                    reason = r["stop"]
                    break
                if "lease" in r:
                    self._run_lease(r["lease"])
        except Orphaned as e:
            reason = str(e)
            log.warning("fleet worker %s: %s; exiting", self.id, e)
        finally:
            if self.runner is not None:
                self.runner.close()
        log.info("fleet worker %s exits (%s): %s", self.id, reason, self.stats)
        return {"worker": self.id, "reason": reason, **self.stats}

    def _warm_up(self) -> None:
        """Build the episode runner (tokenizer, sandbox pool, threads) before the first lease, while the driver
        still sets up its step 0, instead of inside that step's rollout time. A failure here is retried at the
        first lease (and reported there, against its episodes)."""
        from megatron_rl.data.store import store_for

        t0 = time.monotonic()
        store_for(self.cfg).warm()  # the store's clients (boto3, NATS) now, not in the first lease's publish
        try:
            self._runner(self._spec({"episodes": [], "shard_dir": str(self.folder), "batch": "warm-up", "attempt": 0,
                                     "url": self.cfg.generator.url}))
        except Exception:
            log.exception("fleet worker %s: building the episode runner failed; retried at the first lease", self.id)
            self.runner = None
            return
        log.info("fleet worker %s: episode runner ready in %.2fs", self.id, time.monotonic() - t0)

    def _heartbeats(self) -> None:
        while not self.stopping.wait(float(self.queue.get("heartbeat_s", 5.0))):
            with self._lock:
                ids = [self.lease["id"]] if self.lease else []
            try:
                r = self._post("/heartbeat", {"leases": ids}, timeout=30)
            except Orphaned:
                return
            if ids and ids[0] in r.get("lost", []):
                log.warning("fleet worker %s: lease %s revoked by the driver; abandoning it", self.id, ids[0])
                self.lost.set()
                if self.runner is not None:
                    self.runner.stop.set()

    def _run_lease(self, lease: dict) -> None:
        from megatron_rl.data.store import store_for
        from megatron_rl.dispatch.publisher import ShardPublisher

        spec = self._spec(lease)
        runner = self._runner(spec)
        publisher = ShardPublisher(spec.shard_dir, f"{lease['batch']}-{lease['id']}-a{lease['attempt']}-w"
                                   f"{self.job.replace('_', 'x')}", every=0, store=store_for(self.cfg))
        runner.reset(spec, publisher)
        self.lost.clear()
        with self._lock:
            self.lease = lease
        error = ""
        try:
            runner.run(iter(spec.episodes))
        except Exception as e:  # one broken episode must not take the worker down; the queue retries it
            error = f"{type(e).__name__}: {e}"
            log.exception("fleet worker %s: lease %s failed", self.id, lease["id"])
        self._finish(lease, publisher, runner, spec, error)

    def _finish(self, lease: dict, publisher, runner, spec: WorkerSpec, error: str) -> None:
        self._finishing = True
        try:
            self._report(lease, publisher, runner, spec, error)
        finally:
            self._finishing = False

    def _report(self, lease: dict, publisher, runner, spec: WorkerSpec, error: str) -> None:
        if not self.lost.is_set() and not self._commit(lease):
            self.lost.set()
        published = publisher.discard() if self.lost.is_set() else publisher.freeze()  # fenced: publish nothing
        self.stats["fenced"] += self.lost.is_set()
        failed = dict(runner.failed)
        failed.update({e.episode_id: error for e in spec.episodes if error and e.episode_id not in published})
        with self._lock:
            self.lease = None
        self.stats["leases"] += 1
        self.stats["episodes"] += len(published)
        self.stats["shards"] += len(publisher.shards)
        if not self.lost.is_set():
            self._post("/done", {"lease": lease["id"], "published": published, "failed": failed}, timeout=60)

    def _commit(self, lease: dict) -> bool:
        """Ask the driver whether the lease is still this worker's before its shard is published."""
        try:
            return bool(self._post("/commit", {"lease": lease["id"]}, timeout=30).get("ok"))
        except Orphaned:
            return False

    def _spec(self, lease: dict) -> WorkerSpec:
        worker = dataclasses.replace(self.cfg, generator=dataclasses.replace(self.cfg.generator, url=lease["url"]))
        return WorkerSpec(episodes=[from_dict(EpisodeSpec, e) for e in lease["episodes"]],
                          shard_dir=lease["shard_dir"], shard_prefix=lease["batch"], round=int(lease["attempt"]),
                          worker=worker)

    def _runner(self, spec: WorkerSpec):
        """The one EpisodeRunner (threads, sandbox pool, environments) of the worker's life, built at the first
        call; each lease `reset`s it."""
        from megatron_rl.dispatch.publisher import ShardPublisher
        from megatron_rl.dispatch.worker import EpisodeRunner

        if self.runner is None:
            self.runner = EpisodeRunner(spec, ShardPublisher(spec.shard_dir, "unused", 0, store=_NoStore()))
        return self.runner

    def preempted(self) -> None:
        """Slurm's time-limit/preemption signal: publish what is finished, report it, stop."""
        self.stopping.set()
        with self._lock:
            lease = self.lease
        if lease is None or self.runner is None or self._finishing:  # interrupted while reporting: the driver
            return                                                    # settles the lease from the shards
        self.runner.stop.set()
        self._finish(lease, self.runner.publisher, self.runner, self.runner.spec, "worker preempted")


class _NoStore:
    """The placeholder publisher's store: every lease resets the runner with a real publisher first."""

    def prepare(self, folder) -> None:
        pass


def _job_id() -> str:
    try:
        import submitit

        return str(submitit.JobEnvironment().job_id)
    except Exception:  # not inside a submitit job (a worker started by hand)
        from megatron_rl.slurm_env import SlurmEnv

        senv = SlurmEnv.from_environ()
        return str(senv.job_id) if senv else f"pid{os.getpid()}"


class FleetWorkerTask:
    """The callable a fleet submits (one per array task): `FleetWorkerTask()(fleet_folder)`. Checkpointable:
    on the time limit or preemption it reports its lease and requeues itself (same job id, new process)."""

    def __init__(self) -> None:
        self._worker: FleetWorker | None = None

    def __call__(self, folder: str) -> dict:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._worker = FleetWorker(Path(folder))
        return self._worker.run()

    def checkpoint(self, folder: str):
        import submitit

        if self._worker is not None:
            self._worker.preempted()
        log.warning("fleet worker: time limit or preemption; requeueing")
        return submitit.helpers.DelayedSubmission(FleetWorkerTask(), folder)

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_rl.dispatch.fleet_worker FLEET_FOLDER`: one worker started by a job script (fleet
    executor `external`, e.g. the CPU component of slurm/rl_hetjob.sbatch). It waits for the driver's
    queue.json, works until told to stop, and prints one JSON line: worker, reason, counts, Slurm partition, job."""
    import argparse
    import signal
    import sys

    from megatron_rl.slurm_env import SlurmEnv

    p = argparse.ArgumentParser(prog="python -m megatron_rl.dispatch.fleet_worker", description=main.__doc__)
    p.add_argument("folder", help="the fleet folder (episodes.fleet.folder of the run)")
    p.add_argument("--start-timeout-s", type=float, default=3600.0,
                   help="give up when the driver has not published its queue (queue.json) within this long")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The batch script forwards USR1 (time limit) to every step: the driver checkpoints and tells its workers
    # to stop; a worker killed by the signal would lose its lease's work instead.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    folder, end = Path(args.folder), time.monotonic() + args.start_timeout_s
    while not all((folder / n).is_file() for n in ("queue.json", "worker.json")):
        if time.monotonic() > end:
            print(f"fleet worker: no queue.json and worker.json in {folder} after {args.start_timeout_s:.0f}s: is "
                  "the driver running with episodes.fleet.folder set to this folder?", file=sys.stderr)
            return 2
        time.sleep(1.0)
    out = FleetWorker(folder).run()
    senv = SlurmEnv.from_environ()
    print(json.dumps({**out, "partition": senv.partition if senv else None, "job": senv.job_id if senv else None,
                      "het_job": senv.het_job_id if senv else None}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
