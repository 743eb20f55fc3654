"""Dispatch episodes to a fleet of rollout workers with submitit (Slurm job arrays, or local processes).

    report = Dispatcher(DispatchConfig(executor="slurm", partition="cpu"), worker_cfg, shard_dir).run(episodes)

Before the first round the shard folder is scanned: an episode already published there (by an earlier run over
the same folder, e.g. a driver that was restarted) is not dispatched again; the report counts it as
`recovered`. Rounds: the unfinished episodes are cut into batches of `episodes_per_task`, submitted as one job array
(`executor.map_array`), and watched. After every task of the round has ended (finished, failed, cancelled as
a straggler, killed), the shard folder is scanned: an episode is finished iff it is in a published shard.
The rest go into the next round, at most `max_retries` more rounds. A round never starts before the
previous one's tasks are over, so a retried episode cannot also be published by its first attempt: no
duplicates by construction. If a "dead" task publishes anyway (a node that was unreachable, not stopped),
its duplicate is dropped by the loop's reader (`data.consume.read_folder`, episode-id dedup) and counted in the report.

Errors are visible: for every failed task the report carries submitit's error (with the worker's traceback)
and the tail of its stderr log; they are logged as warnings too.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.dispatch.spec import EpisodeSpec, WorkerConfig, WorkerSpec

log = logging.getLogger(__name__)

EXECUTORS = ("local", "slurm", "debug")


@dataclass
class DispatchConfig:
    """Where and how episode batches run: submitit executor, Slurm resources, batching, retries."""

    executor: str = "local"
    """submitit executor: local (processes on this machine), slurm (job arrays), debug (in-process)."""
    folder: str = "runs/dispatch"
    """Root for submitit logs and pickles; every Dispatcher run gets a fresh sub-folder."""
    partition: str = "cpu"
    """Slurm partition of the rollout fleet."""
    account: str = ""
    """Slurm account (empty: the user's default)."""
    qos: str = ""
    """Slurm QOS (empty: the default)."""
    time_min: int = 30
    """Time limit per array task, minutes (also the local executor's timeout)."""
    cpus_per_task: int = 1
    """CPUs per array task; the worker runs that many episodes at once with as many sandbox slots."""
    mem_gb: float = 2.0
    """Memory per array task, GB."""
    array_parallelism: int = 256
    """Most array tasks running at once (Slurm's %N)."""
    episodes_per_task: int = 16
    """Episodes batched into one array task."""
    max_retries: int = 2
    """Extra rounds for episodes whose task failed, was lost or cancelled."""
    straggler_deadline_s: float = 0.0
    """Cancel a task running longer than this and re-dispatch its unfinished episodes (0: no deadline)."""
    max_num_timeout: int = 3
    """Requeues of a task that hit its time limit (submitit Checkpointable) before it counts as failed."""
    signal_delay_s: int = 60
    """Slurm sends the checkpoint signal this many seconds before the time limit."""
    poll_s: float = 0.5
    """Seconds between state polls (Slurm: one sacct call per poll for all tasks)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before each task (e.g. `module load ...`, `source venv/bin/activate`)."""

    def validate(self) -> None:
        if self.executor not in EXECUTORS:
            raise ConfigError(f"dispatch.executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.episodes_per_task < 1 or self.cpus_per_task < 1 or self.time_min < 1:
            raise ConfigError("dispatch.episodes_per_task, cpus_per_task and time_min must be >= 1")
        if self.max_retries < 0 or self.straggler_deadline_s < 0:
            raise ConfigError("dispatch.max_retries and straggler_deadline_s must be >= 0")

    def build_executor(self, folder: Path):
        """The submitit executor for one dispatch run, logs under `folder`."""
        from megatron_rl.dispatch.executor import submitit_executor

        return submitit_executor(self, folder, "mrl-rollout", self.array_parallelism)


@dataclass
class DispatchReport:
    """What a dispatch run produced."""

    finished: list[str]
    """Episode ids found in published shards (each once), sorted."""
    missing: list[str]
    """Episode ids still unfinished after all retries."""
    duplicates: int
    """Episode ids published in more than one shard (the consumer drops the extra copies)."""
    shards: list[str]
    """Shard file names holding these episodes (this run's, and earlier runs' for recovered episodes)."""
    rounds: list[dict]
    """Per round: episodes, tasks, failed, stragglers cancelled, seconds."""
    failures: list[dict]
    """Per failed task: round, job id, state, error (with the worker's traceback) and stderr tail."""
    seconds: float
    """Wall time of the run."""
    folder: str
    """submitit folder of this run (logs)."""
    episode_failures: dict[str, str] = field(default_factory=dict)
    """Episode id -> 'round N: status: reason' (latest) for episodes a worker left unpublished after a
    retryable generation error (rollout server down, timeouts); those still unfinished are in `missing`."""
    recovered: int = 0
    """Episodes already published in the shard folder before this run (not dispatched again)."""

    @property
    def ok(self) -> bool:
        return not self.missing

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def published_episode_ids(shard_dir: Path, cache: dict[str, list[str]] | None = None,
                          prefix: str = "", store=None) -> dict[str, list[str]]:
    """shard name -> episode ids, for every readable published shard in `shard_dir`, as `store` (the run's
    trajectory store, `data.store`; None = the shared filesystem) knows them."""
    from megatron_rl.data.store import FsStore

    return (store or FsStore()).published(shard_dir, cache, prefix)


def _tail(text: str | None, n: int = 40) -> str:
    return "\n".join((text or "").splitlines()[-n:])


class Dispatcher:
    """Runs episodes on a submitit fleet until each is published exactly once (or retries run out)."""

    def __init__(self, config: DispatchConfig, worker: WorkerConfig, shard_dir: str | Path, prefix: str = "",
                 store=None):
        """store: where shards are published and read back (`data.store`; None = the worker config's)."""
        from megatron_rl.data.store import store_for

        config.validate()
        self.config, self.worker, self.shard_dir = config, worker, Path(shard_dir)
        self.store = store if store is not None else store_for(worker)
        self.run_id = prefix or f"d{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.folder = Path(config.folder).resolve() / self.run_id
        self.jobs: list = []
        """submitit jobs of the current round (tests look at them to kill or cancel one)."""

    def _task(self):
        from megatron_rl.dispatch.worker import EpisodeBatchTask

        return EpisodeBatchTask()

    def run(self, episodes: list[EpisodeSpec]) -> DispatchReport:
        t0 = time.perf_counter()
        ids = [e.episode_id for e in episodes]
        if len(ids) != len(set(ids)):
            dup = [k for k, c in Counter(ids).items() if c > 1][:5]
            raise ValueError(f"dispatch: episode ids must be unique; repeated: {dup}")
        self.store.prepare(self.shard_dir)
        self.folder.mkdir(parents=True, exist_ok=True)
        executor = self.config.build_executor(self.folder)
        cache: dict[str, list[str]] = {}
        before = {e for ids in published_episode_ids(self.shard_dir, cache, store=self.store).values() for e in ids}
        pending = [e for e in episodes if e.episode_id not in before]  # published earlier: never run twice
        if len(pending) < len(episodes):
            log.info("dispatch %s: %d of %d episodes already published in %s; dispatching the other %d",
                     self.run_id, len(episodes) - len(pending), len(episodes), self.shard_dir, len(pending))
        recovered, rounds, failures, episode_failures = len(episodes) - len(pending), [], [], {}
        for rnd in range(self.config.max_retries + 1):
            if not pending:
                break
            rounds.append(self._round(executor, rnd, pending, failures, episode_failures))
            published = published_episode_ids(self.shard_dir, cache, store=self.store)
            done = {e for names in published.values() for e in names}
            pending = [e for e in pending if e.episode_id not in done]
            rounds[-1]["left"] = len(pending)
            log.info("dispatch %s round %d: %s", self.run_id, rnd, rounds[-1])
        published = published_episode_ids(self.shard_dir, cache, store=self.store)
        wanted = set(ids)
        counts = Counter(e for names in published.values() for e in names if e in wanted)
        mine = sorted(n for n, names in published.items() if any(e in wanted for e in names))
        return DispatchReport(
            finished=sorted(counts), missing=sorted(wanted - set(counts)),
            duplicates=sum(c - 1 for c in counts.values()), shards=mine, rounds=rounds, failures=failures,
            seconds=time.perf_counter() - t0, folder=str(self.folder), episode_failures=episode_failures,
            recovered=recovered)

    def _round(self, executor, rnd: int, pending: list[EpisodeSpec], failures: list[dict],
               episode_failures: dict[str, str]) -> dict:
        t0 = time.perf_counter()
        n = self.config.episodes_per_task
        specs = [WorkerSpec(episodes=pending[i:i + n], shard_dir=str(self.shard_dir.resolve()),
                            shard_prefix=self.run_id, round=rnd, worker=self.worker)
                 for i in range(0, len(pending), n)]
        self.jobs = executor.map_array(self._task(), specs)
        stragglers = self._wait(self.jobs)
        failed, episodes_failed = 0, 0
        for job in self.jobs:
            if self.config.executor == "local" or str(job.state).startswith("CANCELLED"):
                # submitit waits up to 15 s for a missing result file in case a shared filesystem lags; the local
                # executor writes to this machine's disk and a cancelled task writes none, so a missing file is final
                job._results_timeout_s = 0
            try:
                result = job.result()
            except Exception as e:  # a failed, killed or cancelled task: its unfinished episodes are retried
                failed += 1
                failures.append(self._failure(rnd, job, e, job.job_id in stragglers))
                continue
            for eid, reason in getattr(result, "failed", {}).items():  # retryable generation errors
                episodes_failed += 1
                episode_failures[eid] = f"round {rnd}: {reason}"
                log.warning("dispatch: episode %s (round %d, task %s) not finished: %s", eid, rnd, job.job_id,
                            reason)
        return {"round": rnd, "episodes": len(pending), "tasks": len(specs), "failed": failed,
                "episodes_failed": episodes_failed, "stragglers_cancelled": len(stragglers),
                "seconds": round(time.perf_counter() - t0, 3)}

    def _wait(self, jobs: list) -> set[str]:
        """Until every job has ended; cancels those running past the straggler deadline."""
        deadline, running_since, cancelled = self.config.straggler_deadline_s, {}, set()
        while True:
            live = self._live(jobs)
            if not live:
                return cancelled
            now = time.monotonic()
            for j in live:
                if not deadline or j.job_id in cancelled:
                    continue
                if j.state in ("RUNNING", "COMPLETING"):
                    started = running_since.setdefault(j.job_id, now)
                    if now - started > deadline:
                        log.warning("dispatch: task %s running %.0fs > straggler deadline %.0fs; cancelling",
                                    j.job_id, now - started, deadline)
                        j.cancel(check=False)
                        cancelled.add(j.job_id)
            time.sleep(self.config.poll_s)

    def _live(self, jobs: list) -> list:
        """Jobs not ended yet. submitit's watcher backs off to one state poll a minute, which would hide a
        failed task (no result file) for up to 60 s; force one refresh per poll instead (for Slurm one `sacct`
        covers every job of the watcher)."""
        live = [j for j in jobs if not j.paths.result_pickle.exists()]
        if live and self.config.executor == "slurm":
            live[0].done(force_check=True)                    # refreshes the shared watcher's cache
            return [j for j in live if not j.done()]
        return [j for j in live if not j.done(force_check=True)]

    @staticmethod
    def _failure(rnd: int, job, error: BaseException, straggler: bool) -> dict:
        try:
            stderr = job.stderr()
        except Exception as e:  # logs on a dead node's local disk etc.
            stderr = f"(stderr log unreadable: {e})"
        entry = {"round": rnd, "job_id": job.job_id, "state": job.state, "straggler": straggler,
                 "error": f"{type(error).__name__}: {error}"[-6000:], "stderr_tail": _tail(stderr)}
        log.warning("dispatch: task %s (round %d) failed: %s\n%s", job.job_id, rnd, entry["error"],
                    entry["stderr_tail"])
        return entry


def episodes_from_tasks(tasks, samples_per_task: int = 1, sampling: dict | None = None, prefix: str = "ep",
                        seed: int = 0) -> list[EpisodeSpec]:
    """EpisodeSpecs for `tasks` (envs.Task), `samples_per_task` each sharing a group id."""
    out = []
    for g, task in enumerate(tasks):
        for s in range(samples_per_task):
            out.append(EpisodeSpec(episode_id=f"{prefix}-{task.domain}-{task.id}-{s}", env=task.domain,
                                   task=task.to_dict(), sampling=dict(sampling or {}), group_id=g,
                                   seed=seed * 1_000_003 + g * 1009 + s))
    return out



