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
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from megatron_rl.config import ConfigError
from megatron_rl.dispatch.spec import EpisodeSpec, GeneratorConfig, WorkerSpec
from megatron_rl.slurm_env import SlurmEnv
from megatron_rl.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- generators
class Generator(Protocol):
    """Token in, token out: `generate(prompt_ids, sampling) -> (token_ids, logprobs, policy_version)`.

    `episode` is passed for context; a real model ignores it (only the scripted test policy reads it).
    """

    def generate(self, prompt_ids: list[int], sampling: dict, episode: EpisodeSpec | None = None
                 ) -> tuple[list[int], list[float], int]: ...


class ScriptedGenerator:
    """A TEST POLICY, NOT A MODEL: answers from the task's hidden reference data (countdown's
    `payload['solution']`), or a deliberately wrong answer for a seeded fraction of episodes. Its
    log-probs are fixed made-up numbers. It exists so dispatch and shards can be tested without a GPU."""

    def __init__(self, config: GeneratorConfig, tokenizer: ByteTokenizer):
        self.config, self.tok = config, tokenizer

    def _wrong(self, episode: EpisodeSpec) -> bool:
        rng = np.random.default_rng([episode.seed, 7919])
        return bool(rng.random() < self.config.wrong_fraction)

    def answer_text(self, episode: EpisodeSpec) -> str:
        payload = episode.task.get("payload", {})
        answer = payload.get("solution") or payload.get("answer") or ""
        if self._wrong(episode) or not answer:
            return "<think>test policy: wrong on purpose</think><answer>0</answer>"
        return f"<think>test policy</think><answer>{answer}</answer>"

    def generate(self, prompt_ids, sampling, episode=None):
        if episode is None:
            raise ValueError("ScriptedGenerator (test policy) needs the episode to answer from")
        ids = self.tok.encode(self.answer_text(episode)) + [self.tok.eos_id]
        logprobs = [-0.1 * (1 + i % 5) for i in range(len(ids))]  # made-up, deterministic
        return ids, logprobs, self.config.policy_version


class HttpGenerator:
    """The rollout engine over HTTP through `megatron_rl.rollout.client` (token ids in and out)."""

    def __init__(self, config: GeneratorConfig):
        try:
            from megatron_rl.rollout import client as client_mod
        except ImportError as e:
            raise RuntimeError("generator.kind=http needs megatron_rl.rollout.client (the rollout engine's "
                               f"HTTP client), which is not importable here: {e}") from e
        cls = getattr(client_mod, "RolloutClient", None)
        if cls is None:
            raise RuntimeError("megatron_rl.rollout.client has no RolloutClient; cannot use generator.kind=http")
        self.client = cls(config.url, timeout=config.timeout_s)

    def generate(self, prompt_ids, sampling, episode=None):
        out = self.client.generate(list(prompt_ids), sampling)
        if isinstance(out, tuple):
            return out
        return list(out.token_ids), list(out.logprobs), int(out.policy_version)


def build_generator(config: GeneratorConfig, tokenizer: ByteTokenizer) -> Generator:
    config.validate()
    return ScriptedGenerator(config, tokenizer) if config.kind == "scripted" else HttpGenerator(config)


# ------------------------------------------------------------------------------------------------- episode
def run_episode(ep: EpisodeSpec, env, generator: Generator, tok: ByteTokenizer):
    """One episode -> Trajectory: reset, [generate -> step]* until done."""
    from envs.base import Task
    from megatron_rl.data.shards import Trajectory

    t0 = time.perf_counter()
    timings = {"generate": 0.0, "env": 0.0}
    task = Task(**{k: v for k, v in ep.task.items() if k in ("id", "domain", "prompt", "payload", "split")})
    obs = env.reset(task)
    tokens = [tok.bos_id, *tok.encode(obs.text)]                        # prompt: loss_mask 0
    prompt_len = len(tokens)
    logprobs, mask = [0.0] * prompt_len, [0] * prompt_len
    versions: list[int] = []
    while True:
        t = time.perf_counter()
        ids, lps, version = generator.generate(tokens, ep.sampling, episode=ep)
        timings["generate"] += time.perf_counter() - t
        if len(ids) != len(lps):
            raise RuntimeError(f"generator returned {len(ids)} tokens but {len(lps)} log-probs")
        tokens += ids
        logprobs += lps
        mask += [1] * len(ids)                                          # model tokens: loss_mask 1
        versions.append(int(version))
        t = time.perf_counter()
        res = env.step(tok.decode(ids), action_tokens=len(ids))
        timings["env"] += time.perf_counter() - t
        if res.done:
            break
        obs_ids = tok.encode(res.observation.text)                      # observation: loss_mask 0
        tokens += obs_ids
        logprobs += [0.0] * len(obs_ids)
        mask += [0] * len(obs_ids)
    timings["total"] = time.perf_counter() - t0
    rr = res.reward_result
    prov = {k: json.dumps(v, sort_keys=True) for k, v in (rr.provenance if rr else {}).items()}
    if isinstance(generator, ScriptedGenerator):
        prov["policy"] = "scripted test policy (not a model)"
    return Trajectory(
        tokens=np.asarray(tokens, np.int32), logprobs=np.asarray(logprobs, np.float32),
        loss_mask=np.asarray(mask, np.uint8), prompt_len=prompt_len, reward=float(res.reward),
        group_id=ep.group_id, policy_version_first=min(versions), policy_version_last=max(versions),
        env=ep.env, task_id=str(task.id), episode_id=ep.episode_id, status=res.info.get("status", "ok"),
        reward_components=dict(res.info.get("reward_components", {})), timings=timings, provenance=prov)


# ---------------------------------------------------------------------------------------------- publisher
class ShardPublisher:
    """Buffers finished trajectories and publishes them as shards with unique per-attempt names.

    `freeze()` (on checkpoint/preemption) publishes what is buffered and then refuses more, so nothing is
    published after the caller decided which episodes are left to do.
    """

    def __init__(self, shard_dir: str | Path, stem: str, every: int):
        self.dir, self.stem, self.every = Path(shard_dir), stem, every
        self.dir.mkdir(parents=True, exist_ok=True)
        self._buf: list = []
        self._lock = threading.Lock()
        self._frozen = False
        self.published_ids: list[str] = []
        self.shards: list[str] = []

    def add(self, traj) -> None:
        with self._lock:
            if self._frozen:
                return
            self._buf.append(traj)
            if self.every and len(self._buf) >= self.every:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            if not self._frozen:
                self._flush_locked()

    def freeze(self) -> list[str]:
        with self._lock:
            if not self._frozen:
                self._flush_locked()
            self._frozen = True
            return list(self.published_ids)

    def _flush_locked(self) -> None:
        from megatron_rl.data.shards import write_shard

        if not self._buf:
            return
        name = f"{self.stem}-p{len(self.shards):03d}-{uuid.uuid4().hex[:8]}.h5"
        write_shard(self.dir / name, self._buf)
        self.published_ids += [t.episode_id for t in self._buf]
        self.shards.append(name)
        self._buf = []


def _shard_stem(spec: WorkerSpec, rank: int) -> str:
    senv = SlurmEnv.from_environ()
    try:
        import submitit

        job = submitit.JobEnvironment().job_id
    except Exception:  # not inside a submitit job
        job = senv.job_id if senv else f"{socket.gethostname()}.{os.getpid()}"
        if senv and senv.array_task_id is not None:
            job = f"{senv.array_job_id}_{senv.array_task_id}"
    restart = senv.restart_count if senv else 0
    return f"{spec.shard_prefix}-r{spec.round}-j{job}-q{restart}-k{rank}"


def _default_threads() -> int:
    senv = SlurmEnv.from_environ()
    if senv and senv.cpus_per_task:
        return senv.cpus_per_task
    return max(1, min(8, len(os.sched_getaffinity(0))))


# ------------------------------------------------------------------------------------------------- batch
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


class EpisodeRunner:
    """Runs episodes from an iterator on `threads` threads sharing one sandbox (pool) and generator."""

    def __init__(self, spec: WorkerSpec, publisher: ShardPublisher):
        import dataclasses

        from envs.base import Budget, make_env

        self.spec, self.publisher = spec, publisher
        w = spec.worker
        self.threads = w.threads or _default_threads()
        self.tok = ByteTokenizer(w.vocab_size)
        self.generator = build_generator(w.generator, self.tok)
        self.sandbox = dataclasses.replace(w.sandbox, workers=max(w.sandbox.workers, self.threads)).build()
        self._make_env = lambda name: make_env(
            name, budget=Budget(w.max_turns, w.max_tokens), sandbox=self.sandbox,
            token_counter=lambda s: len(self.tok.encode(s)))
        self._done = 0
        self._lock = threading.Lock()
        self.stop = threading.Event()

    def _one(self, ep: EpisodeSpec) -> None:
        f = self.spec.worker.faults
        if f.delay_s and (not f.delay_in_rounds or self.spec.round in f.delay_in_rounds):
            time.sleep(f.delay_s)
        if self.stop.is_set():
            return
        traj = run_episode(ep, self._make_env(ep.env), self.generator, self.tok)
        self.publisher.add(traj)
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
    publisher = ShardPublisher(spec.shard_dir, _shard_stem(spec, rank), spec.worker.episodes_per_shard)
    runner = EpisodeRunner(spec, publisher)
    if runner_hook is not None:
        runner_hook(runner)
    try:
        runner.run(iter(spec.episodes) if episodes is None else episodes)
    finally:
        publisher.flush()
        runner.close()
    return BatchResult(publisher.published_ids, publisher.shards, socket.gethostname(), time.perf_counter() - t0)


# ------------------------------------------------------------------------------------ submitit entry point
class EpisodeBatchTask:
    """The callable the dispatcher submits (one per array task). Checkpointable: on Slurm's time-limit or
    preemption signal it publishes what is finished and requeues itself with only the remaining episodes."""

    def __init__(self) -> None:
        self._publisher: ShardPublisher | None = None
        self._runner: EpisodeRunner | None = None
        self._spec: WorkerSpec | None = None

    def __call__(self, spec: WorkerSpec) -> BatchResult:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
            "per_rank": [{"rank": i, "host": r.host, "episodes": len(r.finished), "shards": r.shards}
                         for i, r in enumerate(results)],
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
                                             "shards": r.shards}], "finished": r.finished}
    if summary:
        text = json.dumps(summary)
        if args.report:
            Path(args.report).write_text(text)
        brief = {k: v for k, v in summary.items() if k != "finished"}
        print(json.dumps(brief | {"episodes": len(summary["finished"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
