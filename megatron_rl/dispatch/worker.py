"""The rollout worker: run a batch of episodes and publish them as HDF5 trajectory shards.

    megatron-rl rollout-worker --spec spec.json            # one process (threads x sandbox pool)
    srun --mpi=pmix -n 4 megatron-rl rollout-worker --spec spec.json --mpi   # ranks share the batch

Episode token layout (DESIGN.md section 3): `<bos> + prompt` (loss_mask 0), then per turn the model's
tokens (loss_mask 1, behaviour log-probs from the generator) and the environment's observation tokens
(loss_mask 0); a multi-turn episode is one sequence, never re-tokenised.

Shards: every task attempt writes under a new name `<prefix>-r<round>-j<job>-q<restart>-k<rank>-p<part>-<uuid>.h5`
(atomic publish), so a retried or requeued task never overwrites or collides with an earlier attempt. An
episode counts as finished iff it is in a published shard; a retry gets only unfinished episodes.

With `--mpi` (several Slurm tasks under `srun --mpi=pmix`), rank 0 hands out episodes in small chunks and
every rank (rank 0 too, when MPI has thread support) asks for more when idle.

Its parts, one idea a module: `dispatch.generators` (where model turns come from), `dispatch.episode_rows` (one
episode as shard rows), `dispatch.publisher` (shards under names no retry reuses); here the batch runner, the
submitit task, the MPI split and the CLI.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.data.store import store_for
from megatron_rl.dispatch.episode_rows import episode_rows
from megatron_rl.dispatch.generators import GenerationError, build_generator
from megatron_rl.dispatch.publisher import ShardPublisher, _shard_stem
from megatron_rl.dispatch.spec import EpisodeSpec, WorkerSpec
from megatron_rl.slurm_env import SlurmEnv, submitit_local_task
from megatron_rl.tokenizer import Tokenizer, from_path

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------- batch
def _default_threads() -> int:
    senv = SlurmEnv.from_environ()
    if senv and senv.cpus_per_task:
        return senv.cpus_per_task
    return max(1, min(8, len(os.sched_getaffinity(0))))


@dataclass
class BatchResult:
    """What one worker (rank) did."""

    finished: list[str] = field(default_factory=list)
    """Episode ids published by this worker, in publish order."""
    shards: list[str] = field(default_factory=list)
    """Shard file names it published."""
    host: str = ""
    """Where it ran."""
    seconds: float = 0.0
    """Wall time of the batch."""
    failed: dict[str, str] = field(default_factory=dict)
    """Episode id -> 'status: reason' for episodes not published because of a retryable generation error
    (rollout server unreachable, timed out, 5xx); the dispatcher re-runs them."""


def env_factory(spec: WorkerSpec, tok: Tokenizer, workers: int):
    """The worker's environment factory: the run's mixture (`spec.worker.envs`) with its LLM judge, its budgets
    capped at the model's context, the domains' published images (opened here, once per node) and the run's
    tokenizer counting observation tokens; an environment not in the mixture gets the worker's max_turns."""
    from megatron_rl.envs.base import Budget
    from megatron_rl.envs.mixture import DomainConfig

    w = spec.worker
    unlisted = DomainConfig(max_turns=w.max_turns, max_observation_chars=Budget().max_observation_chars)
    factory = w.envs.factory(w.max_tokens, judge=w.envs.judge(spec.shard_dir), images=dict(w.images),
                             token_counter=lambda s: len(tok.encode(s)), unlisted=unlisted)
    for name in w.images:  # extract and mount every image before the first episode
        factory.sandbox(name, _Slots(workers))
    return factory


@dataclass
class _Slots:
    """Stands for the worker's sandbox pool when opening the image sandboxes: only its size is read."""

    workers: int


class EpisodeRunner:
    """Runs episodes from an iterator on `threads` threads sharing one sandbox (pool), generator and environment
    factory. Built once per task (or per fleet worker's life); `reset(spec, publisher)` points it at the next
    batch (a fleet lease) without rebuilding the tokenizer, sandbox pool, judge or images."""

    def __init__(self, spec: WorkerSpec, publisher: ShardPublisher):
        import dataclasses

        self.spec, self.publisher = spec, publisher
        w = spec.worker
        w.validate()
        self.threads = w.threads or _default_threads()
        self.tok = from_path(w.tokenizer, w.vocab_size)
        self.generator = build_generator(w.generator, self.tok, w.max_tokens)
        workers = max(w.sandbox.workers, self.threads)
        self.sandbox = dataclasses.replace(w.sandbox, workers=workers).build()
        self.make_env = env_factory(spec, self.tok, workers)
        self._done = 0
        self._lock = threading.Lock()
        self.stop = threading.Event()
        self.failed: dict[str, str] = {}
        """Episode id -> 'status: reason' of episodes left unpublished by a retryable generation error."""

    def reset(self, spec: WorkerSpec, publisher: ShardPublisher) -> None:
        """Run the episodes of `spec` next, publishing into `publisher`: the failures and the stop are cleared
        and the generator follows the spec's engine URL (a colocated engine serves on a new port every step).
        The rest of the worker config (sandbox, tokenizer, environments) stays the one it was built with."""
        if spec.worker.generator != self.spec.worker.generator:
            self.generator = build_generator(spec.worker.generator, self.tok, spec.worker.max_tokens)
        self.spec, self.publisher, self.failed = spec, publisher, {}
        self.stop.clear()

    def _one(self, ep: EpisodeSpec) -> None:
        f = self.spec.worker.faults
        if f.delay_s and (not f.delay_in_rounds or self.spec.round in f.delay_in_rounds):
            time.sleep(f.delay_s)
        if self.stop.is_set():
            return
        try:
            env = self.make_env(ep.env, self.sandbox)
            rows = episode_rows(ep, env, self.generator, self.tok, self.spec.worker.max_tokens, state=(
                self.publisher.store, self.spec.shard_dir, self.spec.worker.checkpoint_turns))
        except GenerationError as e:  # retryable: not published; the dispatcher's next round re-runs it
            log.warning("episode %s not finished (%s, retryable): %s", ep.episode_id, e.status, e)
            with self._lock:
                self.failed[ep.episode_id] = f"{e.status}: {e}"
            return
        self.publisher.add(*rows)  # a split episode's rows in one shard
        with self._lock:
            self._done += 1
            if self.spec.round in f.raise_in_rounds and self._done >= f.raise_after:
                self.publisher.flush()
                raise RuntimeError(f"injected test fault: worker raises after {self._done} episodes "
                                   f"(round {self.spec.round})")

    def run(self, episodes: Iterator[EpisodeSpec]) -> None:
        """Run until `episodes` is exhausted; the first episode error stops the batch and is raised."""
        errors: queue.SimpleQueue = queue.SimpleQueue()
        lock = threading.Lock()

        def loop() -> None:
            while not self.stop.is_set():
                with lock:
                    ep = next(episodes, None)
                if ep is None:
                    return
                try:
                    self._one(ep)
                except BaseException as e:
                    errors.put(e)
                    self.stop.set()
                    return

        with ThreadPoolExecutor(self.threads, thread_name_prefix="episode") as pool:
            for fut in [pool.submit(loop) for _ in range(self.threads)]:
                fut.result()
        if not errors.empty():
            raise errors.get()

    def close(self) -> None:
        self.sandbox.close()


def run_episode_batch(spec: WorkerSpec, rank: int = 0, episodes: Iterator[EpisodeSpec] | None = None,
                      runner_hook=None) -> BatchResult:
    """Run `spec.episodes` (or the given iterator), publishing shards; returns what was published.

    On an error, episodes already finished are published first, then the error propagates (the dispatcher
    retries the unfinished ones).
    """
    t0 = time.perf_counter()
    publisher = ShardPublisher(spec.shard_dir, _shard_stem(spec, rank), spec.worker.episodes_per_shard,
                               store_for(spec.worker))
    runner = EpisodeRunner(spec, publisher)
    if runner_hook is not None:
        runner_hook(runner)
    try:
        runner.run(iter(spec.episodes) if episodes is None else episodes)
    finally:
        publisher.flush()
        runner.close()
    return BatchResult(publisher.published_ids, publisher.shards, socket.gethostname(), time.perf_counter() - t0,
                       dict(runner.failed))


# ------------------------------------------------------------------------------------ submitit entry point
def _end_with_local_controller() -> None:
    """A task of submitit's local executor ends with its controller (Linux: PR_SET_PDEATHSIG). submitit cancels
    a local job (a straggler) with SIGINT to the controller, which then kills the tasks it started; a SIGINT that
    lands while the controller is still starting its task (inside Popen, seconds on a loaded machine) leaves that
    task running on its own, and it published episodes that the dispatcher's next round had run again. A task
    whose controller is gone already (its parent is no submitit controller) exits at once."""
    if not submitit_local_task() or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    try:
        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        parent = b""
    if b"submitit.local._local" not in parent:
        log.warning("rollout task: its submitit controller is gone (cancelled while starting it); exiting")
        logging.shutdown()
        os._exit(1)


class EpisodeBatchTask:
    """The callable the dispatcher submits (one per array task). Checkpointable: on Slurm's time-limit or
    preemption signal it publishes what is finished and requeues itself with only the remaining episodes."""

    def __init__(self) -> None:
        self._publisher: ShardPublisher | None = None
        self._runner: EpisodeRunner | None = None
        self._spec: WorkerSpec | None = None

    def __call__(self, spec: WorkerSpec) -> BatchResult:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        _end_with_local_controller()
        self._spec = spec
        log.info("rollout task: %d episodes, round %d, shards -> %s", len(spec.episodes), spec.round, spec.shard_dir)

        def hook(runner: EpisodeRunner) -> None:
            self._runner, self._publisher = runner, runner.publisher

        return run_episode_batch(spec, runner_hook=hook)

    def checkpoint(self, spec: WorkerSpec):
        import dataclasses

        import submitit

        done = set(self._publisher.freeze()) if self._publisher else set()
        if self._runner is not None:
            self._runner.stop.set()
        left = [e for e in spec.episodes if e.episode_id not in done]
        log.warning("checkpoint: %d episodes published, %d left; requeueing", len(done), len(left))
        return submitit.helpers.DelayedSubmission(EpisodeBatchTask(), dataclasses.replace(spec, episodes=left))

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()


# --------------------------------------------------------------------------------------------------- MPI
_REQ, _WORK = 11, 12


def run_mpi(spec: WorkerSpec, chunk: int = 1) -> dict:
    """Share `spec.episodes` among the ranks of MPI_COMM_WORLD; rank 0 hands out chunks on request."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
    if rank == 0:
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(0, len(spec.episodes), chunk):
            todo.put(spec.episodes[i:i + chunk])
        server = threading.Thread(target=_serve_chunks, args=(comm, todo, size - 1), daemon=True)
        server.start()
        result = (run_episode_batch(spec, 0, _local_chunks(todo)) if threaded or size == 1
                  else BatchResult(host=socket.gethostname()))
        server.join()
    else:
        result = run_episode_batch(spec, rank, _remote_chunks(comm))
    results = comm.gather(result, root=0)
    if rank != 0:
        return {}
    return {"ranks": size, "threaded_rank0": threaded,
            "per_rank": [{"rank": i, "host": r.host, "episodes": len(r.finished), "shards": r.shards,
                          "failed": r.failed} for i, r in enumerate(results)],
            "finished": [e for r in results for e in r.finished]}


def _serve_chunks(comm, todo: queue.SimpleQueue, workers: int) -> None:
    from mpi4py import MPI

    while workers:
        status = MPI.Status()
        comm.recv(source=MPI.ANY_SOURCE, tag=_REQ, status=status)
        try:
            work = todo.get_nowait()
        except queue.Empty:
            work = None
            workers -= 1
        comm.send(work, dest=status.Get_source(), tag=_WORK)


def _local_chunks(todo: queue.SimpleQueue) -> Iterator[EpisodeSpec]:
    while True:
        try:
            yield from todo.get_nowait()
        except queue.Empty:
            return


def _remote_chunks(comm) -> Iterator[EpisodeSpec]:
    while True:
        comm.send(None, dest=0, tag=_REQ)
        work = comm.recv(source=0, tag=_WORK)
        if work is None:
            return
        yield from work


# --------------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megatron-rl rollout-worker",
                                description="Run a batch of environment episodes and write HDF5 shards.")
    p.add_argument("spec_file", nargs="?", metavar="SPEC", help="same as --spec")
    p.add_argument("--spec", help="WorkerSpec as JSON or YAML (episodes, shard_dir, worker)")
    p.add_argument("--mpi", action="store_true",
                   help="share the episodes among MPI ranks (srun --mpi=pmix -n N ...); rank 0 hands out work")
    p.add_argument("--chunk", type=int, default=1, help="episodes per hand-out with --mpi")
    p.add_argument("--report", help="write a JSON summary here (rank 0)")
    args = p.parse_args(argv)
    if not (args.spec or args.spec_file):
        p.error("give the worker spec: --spec FILE (JSON or YAML WorkerSpec)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = WorkerSpec.load(args.spec or args.spec_file)
    except ConfigError as e:
        print(f"megatron-rl rollout-worker: {e}", file=sys.stderr)
        return 2
    if args.mpi:
        summary = run_mpi(spec, args.chunk)
    else:
        r = run_episode_batch(spec)
        summary = {"ranks": 1, "per_rank": [{"rank": 0, "host": r.host, "episodes": len(r.finished),
                                             "shards": r.shards, "failed": r.failed}], "finished": r.finished}
    if summary:
        text = json.dumps(summary)
        if args.report:
            Path(args.report).write_text(text)
        brief = {k: v for k, v in summary.items() if k != "finished"}
        print(json.dumps(brief | {"episodes": len(summary["finished"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
