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
from megatron_rl.data.store import store_for
from megatron_rl.dispatch.spec import EpisodeSpec, GeneratorConfig, WorkerSpec
from megatron_rl.slurm_env import SlurmEnv
from megatron_rl.tokenizer import Tokenizer, from_path

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- generators
class Generator(Protocol):
    """Token in, token out: `generate(prompt_ids, sampling, episode, turn) -> (token_ids, logprobs, versions)`,
    `versions` the policy version of each token (or one int for all of them); with MoE routing replay a 4th
    item, (the tokens the engine ran, their experts [len - 1, L_moe, k]) (`parse_routes`).

    `episode` is passed for context; a real model ignores it (only the scripted test policy reads it).
    Raises `GenerationError` for a failed request.
    """

    def generate(self, prompt_ids: list[int], sampling: dict, episode: EpisodeSpec | None = None, turn: int = 0
                 ) -> tuple[list[int], list[float], int | list[int]]: ...


class GenerationError(RuntimeError):
    """A generation request failed. `retryable` (server unreachable, timed out, 5xx after the client's
    retries): the episode is not published and the dispatcher re-runs it. Otherwise (4xx, a malformed
    answer) re-running cannot help: the episode is published with `status` and the reason."""

    def __init__(self, message: str, status: str = "error", retryable: bool = False):
        super().__init__(message)
        self.status, self.retryable = status, retryable


class ScriptedGenerator:
    """A TEST POLICY, NOT A MODEL: answers from the task's hidden reference data (countdown's
    `payload['solution']`), or a deliberately wrong answer for a seeded fraction of episodes. Its
    log-probs are fixed made-up numbers. It exists so dispatch and shards can be tested without a GPU."""

    def __init__(self, config: GeneratorConfig, tokenizer: Tokenizer):
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

    def generate(self, prompt_ids, sampling, episode=None, turn=0):
        if episode is None:
            raise ValueError("ScriptedGenerator (test policy) needs the episode to answer from")
        ids = self.tok.encode(self.answer_text(episode)) + [self.tok.eos_id]
        logprobs = [-0.1 * (1 + i % 5) for i in range(len(ids))]  # made-up, deterministic
        return ids, logprobs, self.config.policy_version


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "max_tokens", "stop_token_ids", "seed")


class HttpGenerator:
    """The rollout engine over HTTP (`megatron_rl.rollout.client.RolloutClient`, `/v1/completions` with
    token ids in and token ids, behaviour log-probs and per-token policy versions out).

    One sample per request; the seed is the episode's (or `sampling['seed']`) plus the turn, so a retried
    episode asks for the same draws. EOS always stops a turn; a turn never asks for more tokens than the
    worker's token budget has left. The answer is checked before it is used (lengths, finite log-probs <= 0,
    versions >= 0): a malformed answer fails the episode, never the worker.
    """

    def __init__(self, config: GeneratorConfig, tokenizer: Tokenizer, max_tokens: int = 1 << 30):
        from megatron_rl.rollout.client import RolloutClient

        self.config, self.tok, self.max_tokens = config, tokenizer, max_tokens
        try:
            self.client = RolloutClient(config.url, timeout=config.timeout_s, retries=config.retries,
                                        backoff=config.backoff_s, token_file=config.token_file or None)
        except (OSError, ValueError) as e:
            raise GenerationError(f"generator.token_file {config.token_file}: cannot read the rollout server's "
                                  f"token ({e}); the driver writes it in the run folder, which this worker must "
                                  "see") from e

    def request(self, prompt_ids: list[int], sampling: dict, episode: EpisodeSpec | None, turn: int) -> dict:
        """The sampling fields of the /v1/completions body."""
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise GenerationError(f"episode sampling has unknown keys {unknown}; use {list(SAMPLING_KEYS)}")
        want = int(sampling.get("max_new_tokens", sampling.get("max_tokens", self.config.max_new_tokens)))
        seed = sampling.get("seed", episode.seed if episode is not None else 0)
        body = {"max_tokens": max(1, min(want, self.max_tokens - len(prompt_ids))),
                "stop_token_ids": sorted({*self.tok.stop_ids, *sampling.get("stop_token_ids", [])}),
                "seed": int(seed) + turn, "n": 1}
        body.update({k: sampling[k] for k in ("temperature", "top_p", "top_k") if k in sampling})
        if self.config.routed_experts:  # MoE routing replay
            body["return_routed_experts"] = True
        return body

    def generate(self, prompt_ids, sampling, episode=None, turn=0):
        from megatron_rl.rollout.client import RolloutError

        try:
            body = self.request(prompt_ids, sampling, episode, turn)
        except (TypeError, ValueError) as e:
            raise GenerationError(f"bad episode sampling {sampling!r}: {e}") from e
        try:
            out = self.client.complete(list(prompt_ids), **body)
        except RolloutError as e:
            transient = e.status is None or e.status >= 500 or e.status == 429
            status = "timeout" if "timed out" in str(e).lower() else "error"
            raise GenerationError(f"rollout server {self.config.url}: {e}", status, retryable=transient) from e
        except ValueError as e:  # a 200 whose body is not JSON
            raise GenerationError(f"rollout server {self.config.url}: answer is not JSON: {e}") from e
        ids, lps, versions = parse_completion(out)
        if not self.config.routed_experts:
            return ids, lps, versions
        return ids, lps, versions, parse_routes(out, prompt_ids, ids)


def parse_routes(out, prompt_ids: list[int], ids: list[int]) -> tuple[list[int], np.ndarray]:
    """(the tokens the request ran: its prompt as the server saw it + the completion, their experts int16
    [len - 1, L_moe, k]) of a /v1/completions answer asked with return_routed_experts; GenerationError if
    malformed."""
    from megatron_rl.data.routes import decode_routes

    try:
        routes = decode_routes(out["choices"][0]["routed_experts"])
    except (KeyError, TypeError, ValueError) as e:
        raise GenerationError(f"malformed completion from the rollout server: routed_experts: {e}") from e
    seen = [*(out.get("prompt_token_ids") or prompt_ids), *ids]
    if len(routes) != len(seen) - 1:
        raise GenerationError(f"malformed completion: routed_experts covers {len(routes)} tokens, the request "
                              f"ran {len(seen) - 1}")
    return seen, routes


def parse_completion(out) -> tuple[list[int], list[float], list[int]]:
    """(token_ids, logprobs, policy_versions) of a /v1/completions answer; GenerationError if malformed."""
    try:
        (choice,) = out["choices"]
        ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        versions = choice["policy_versions"]
        ids, lps, versions = [int(t) for t in ids], [float(x) for x in lps], [int(v) for v in versions]
    except (KeyError, TypeError, ValueError) as e:
        raise GenerationError(f"malformed completion from the rollout server ({type(e).__name__}: {e}); need "
                              "one choice with token_ids, logprobs.token_logprobs and policy_versions") from e
    if not len(ids) == len(lps) == len(versions):
        raise GenerationError(f"malformed completion: {len(ids)} token ids, {len(lps)} log-probs, "
                              f"{len(versions)} policy versions")
    if not all(np.isfinite(x) and x <= 1e-4 for x in lps) or any(v < 0 for v in versions):
        raise GenerationError("malformed completion: log-probs must be finite and <= 0, policy versions >= 0")
    return ids, lps, versions


def build_generator(config: GeneratorConfig, tokenizer: Tokenizer, max_tokens: int = 1 << 30) -> Generator:
    config.validate()
    if config.kind == "scripted":
        return ScriptedGenerator(config, tokenizer)
    return HttpGenerator(config, tokenizer, max_tokens)


# ------------------------------------------------------------------------------------------------- episode
def run_episode(ep: EpisodeSpec, env, generator: Generator, tok: Tokenizer, max_tokens: int = 1 << 30):
    """One episode -> its Trajectory (`episode_rows`' last row)."""
    return episode_rows(ep, env, generator, tok, max_tokens)[-1]


def episode_rows(ep: EpisodeSpec, env, generator: Generator, tok: Tokenizer, max_tokens: int = 1 << 30) -> list:
    """One episode -> the Trajectory rows it publishes, through the one episode loop (`envs.episode`: reset,
    [generate -> step]* until done), each turn one call of `generator`: the episode's, after the earlier exact
    segments of a split black-box agent episode (`shards.segment_rows`).

    A non-retryable `GenerationError` (the server rejected the request, a malformed answer) gives a
    `failed_trajectory`; a retryable one propagates (the episode is left for the dispatcher's next round).
    """
    from envs.base import Task
    from envs.episode import drive, open_episode
    from megatron_rl.data.routes import context_routes
    from megatron_rl.data.shards import Trajectory, segment_rows

    t0, gen_s, routes = time.perf_counter(), [0.0], {}
    task = Task(**{k: v for k, v in ep.task.items() if k in ("id", "domain", "prompt", "payload", "split")})
    co = open_episode(env, task, tok, min(max_tokens, env.budget.max_tokens), list(ep.prompt_ids) or None)
    try:
        r = drive(co, lambda tokens, turn: _generate(generator, tokens, ep, turn, gen_s, routes))
    except GenerationError as e:
        if e.retryable:
            raise
        return [failed_trajectory(ep, list(ep.prompt_ids), e.status, str(e))]
    timings = {"generate": gen_s[0], **r.timings, "turns": float(r.turns), "total": time.perf_counter() - t0}
    from envs.procedural import task_provenance

    prov = {k: json.dumps(v, sort_keys=True) for k, v in r.reward.provenance.items()}
    prov.update(task_provenance(task))  # a generated task's library, version, generator, seed, index, settings
    if isinstance(generator, ScriptedGenerator):
        prov["policy"] = "scripted test policy (not a model)"
    model_versions = [v for v, m in zip(r.versions, r.loss_mask) if m] or [0]
    main = Trajectory(
        tokens=np.asarray(r.tokens, np.int32), logprobs=np.asarray(r.logprobs, np.float32),
        loss_mask=np.asarray(r.loss_mask, np.uint8), prompt_len=r.prompt_len, reward=float(r.reward.total),
        group_id=ep.group_id, policy_version_first=min(model_versions), policy_version_last=max(model_versions),
        env=ep.env, task_id=str(task.id), episode_id=ep.episode_id, status=_status(r),
        reward_components=dict(r.reward.components), timings=timings, provenance=prov,
        token_versions=np.asarray(r.versions, np.int32),
        routed_experts=context_routes(routes.get("seen"), routes.get("routes"), list(r.tokens)))
    return [*segment_rows(main, r.segments), main]


def _status(r) -> str:
    """The shard status: the reward's failure (sandbox_error, error) first, else the episode's (ok, truncated)."""
    return r.reward.status if not r.reward.valid else r.status


def _generate(generator: Generator, tokens: list[int], ep: EpisodeSpec, turn: int, gen_s: list[float],
              routes: dict | None = None):
    """One turn from the generator, checked: (ids, logprobs, per-token versions); GenerationError if malformed.
    A generator asked for routing replay also returns (tokens it ran, their experts): kept in `routes` (the
    latest turn's, which ran the whole context so far)."""
    t = time.perf_counter()
    ids, lps, version, *extra = generator.generate(tokens, ep.sampling, episode=ep, turn=turn)
    gen_s[0] += time.perf_counter() - t
    if extra and routes is not None:
        routes["seen"], routes["routes"] = extra[0]
    versions = [int(version)] * len(ids) if isinstance(version, (int, np.integer)) else list(version)
    if not len(ids) == len(lps) == len(versions):
        raise GenerationError(f"generator returned {len(ids)} tokens, {len(lps)} log-probs and {len(versions)} "
                              "policy versions")
    return list(ids), list(lps), versions


def failed_trajectory(ep: EpisodeSpec, prompt: list[int], status: str, reason: str):
    """An episode that could not be generated: its prompt only (nothing to train on), reward 0, the status
    and `provenance['error']` saying why. Published, so the dispatcher does not re-run a hopeless request."""
    from megatron_rl.data.shards import Trajectory

    log.warning("episode %s failed (%s): %s", ep.episode_id, status, reason)
    n = len(prompt)
    return Trajectory(
        tokens=np.asarray(prompt, np.int32), logprobs=np.zeros(n, np.float32), loss_mask=np.zeros(n, np.uint8),
        prompt_len=n, reward=0.0, group_id=ep.group_id, policy_version_first=0, policy_version_last=0,
        env=ep.env, task_id=str(ep.task.get("id", "")), episode_id=ep.episode_id, status=status,
        provenance={"error": reason[-2000:]})


# ---------------------------------------------------------------------------------------------- publisher
class ShardPublisher:
    """Buffers finished trajectories and publishes them as shards with unique per-attempt names.

    `freeze()` (on checkpoint/preemption) publishes what is buffered and then refuses more, so nothing is
    published after the caller decided which episodes are left to do.
    """

    def __init__(self, shard_dir: str | Path, stem: str, every: int, store=None):
        """store: where shards go (`data.store`: the worker config's; None = the shared filesystem)."""
        from megatron_rl.data.store import FsStore

        self.dir, self.stem, self.every = Path(shard_dir), stem, every
        self.store = store if store is not None else FsStore()
        self.store.prepare(self.dir)
        self._buf: list = []
        self._lock = threading.Lock()
        self._frozen = False
        self.published_ids: list[str] = []
        self.shards: list[str] = []

    def add(self, *trajs) -> None:
        """Buffer the rows of one episode (published together)."""
        with self._lock:
            if self._frozen:
                return
            self._buf.extend(trajs)
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

    def discard(self) -> list[str]:
        """Drop what is buffered and refuse more (the lease was revoked); returns what was published before."""
        with self._lock:
            self._buf, self._frozen = [], True
            return list(self.published_ids)

    def _flush_locked(self) -> None:
        if not self._buf:
            return
        name = f"{self.stem}-p{len(self.shards):03d}-{uuid.uuid4().hex[:8]}.h5"
        self.store.publish(self.dir, name, self._buf)
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
    failed: dict[str, str] = field(default_factory=dict)
    """Episode id -> 'status: reason' for episodes not published because of a retryable generation error
    (rollout server unreachable, timed out, 5xx); the dispatcher re-runs them."""


def env_factory(spec: WorkerSpec, tok: Tokenizer, workers: int):
    """The worker's environment factory: the run's mixture (`spec.worker.envs`) with its LLM judge, its budgets
    capped at the model's context, the domains' published images (opened here, once per node) and the run's
    tokenizer counting observation tokens; an environment not in the mixture gets the worker's max_turns."""
    from envs.base import Budget
    from envs.mixture import DomainConfig

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
            rows = episode_rows(ep, env, self.generator, self.tok, self.spec.worker.max_tokens)
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
