"""Rollouts from dispatched episodes: rollout workers run whole episodes and publish HDF5 shards.

    episodes.runner: dispatch   ->   DispatchRollouts (same interface as loop.rollout.Rollouts)
    episodes.runner: fleet      ->   the same, episodes on a persistent fleet (dispatch/fleet.py) instead of
                                     one submitit job array per step

At a step that needs groups, every rank of global rank 0's tensor-parallel group serves the in-process
engine over HTTP (`rollout.tp_serve.serve_tp`: TP rank 0 runs the server, the others follow its schedule),
while a thread on rank 0 runs the `Dispatcher`: the step's episodes (prompt ids, sampling seeds and group
ids chosen here) go to submitit workers -- local processes, or a Slurm job array on the CPU partition --
which call the server for tokens, step the environment in their sandboxes and publish shards under
`<run>/rl_episodes/<batch>/`. When the dispatch is over the server stops, rank 0 reads the shards and
broadcasts the samples and rewards, and the loop goes on exactly as with in-process rollouts (dynamic
sampling, trajectories, staleness filter, checkpoints).

Episodes of one batch are named by group id and sample index, and the batch's folder by its group ids, so a
restart after a crash mid-dispatch finds what was already published and dispatches only the rest (none lost,
none duplicated). An episode still missing after the dispatcher's retries counts as an invalid sample
(dropped from training, counted in `episodes_missing`).

Placement of the engine (`episodes.server`):
- colocated: at a step that needs groups, the trainer ranks serve their in-process engine while the
  episodes run, so generation never overlaps training (`max_staleness` then only bounds which samples are
  kept), and data-parallel replicas other than rank 0's wait while rank 0's replica serves.
- separate: rank 0 starts a rollout server process of its own (`RolloutServerProcess`, the same model and
  engine config, weights pushed through `/update_weights` after every update with the 'continue' policy).
  Episodes of a batch are dispatched (a background thread on rank 0) as soon as the batch is submitted, so
  with `max_staleness` k >= 1 the episodes of the next k steps run while the trainer trains; tokens
  generated across a weight update record their versions (partial rollouts).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch.distributed as dist

from megatron_rl.data.shards import SEGMENT_MARK, episode_of
from megatron_rl.dispatch.net import node_address  # noqa: F401 (re-exported: tests, callers)
from megatron_rl.distributed import group_leader, group_rank
from megatron_rl.loop.rollout import Group, Rollouts, seed_of
from megatron_rl.slurm_env import TORCHRUN_VARS

log = logging.getLogger(__name__)


class DispatchRollouts(Rollouts):
    """Rollouts whose episodes run on dispatched rollout workers; see the module docstring."""

    def __init__(self, engine, runner, tok, prompt_fn, cfg, seed: int, episodes_cfg, worker_cfg, run_dir: Path,
                 tp_group, server: RolloutServerProcess | None = None, max_tokens: int = 1 << 30, group=None):
        """group: the ranks running these rollouts (`DistContext.world`; its first rank dispatches), None: one
        process; the other arguments as `Rollouts`' and below."""
        super().__init__(engine, runner, tok, prompt_fn, cfg, seed, max_tokens, group=group)
        self.rank0 = group_rank(group) == 0
        """This rank is the group's first: it dispatches, holds the fleet and the futures, and broadcasts."""
        self.episodes_cfg, self.run_dir = episodes_cfg, run_dir
        self.token = server.token if server is not None else secrets.token_urlsafe(32)
        """The job's token of the rollout server (every endpoint but /health needs it): the separate server's,
        or the one the colocated engine serves with; rank 0 writes it to `token_file` for the workers."""
        self.token_file = Path(run_dir) / "rollout_token"
        if self.rank0:
            from megatron_rl.http_auth import write_token_file

            Path(run_dir).mkdir(parents=True, exist_ok=True)
            write_token_file(self.token_file, self.token)
        self.worker_cfg = worker_cfg if worker_cfg is None else dataclasses.replace(worker_cfg, generator=(
            dataclasses.replace(worker_cfg.generator,
                                token_file=worker_cfg.generator.token_file or str(self.token_file.resolve()))))
        from megatron_rl.data.store import build_store

        self.store = build_store(episodes_cfg.store, episodes_cfg.s3, index=Path(run_dir) / "store_index.jsonl")
        """Where the workers publish shards and this rank reads them (`episodes.store`); its index of consumed
        announcements (s3) lives in the run folder, so a restarted driver resumes where it acked."""
        if self.rank0:
            self.store.check()  # a missing bucket, refused credentials, no server: an error before any episode
        self.serve_group = tp_group
        """The engine's TP group, which serves the workers (not `Rollouts.tp_group`: the in-process rounds of
        eval are driven from rank 0 over the world; with it at TP=1 and 2+ ranks, rank 1 never got them)."""
        self.server = server
        """The separate rollout server (rank 0; None when colocated or on other ranks)."""
        self.separate = episodes_cfg.server == "separate"
        self.batch_of: dict[int, str] = {}
        """Group id -> the batch (its shard folder name) it was submitted in."""
        self.futures: dict[str, Future] = {}
        """Rank 0, separate server: batch name -> the running dispatch."""
        # up to max_staleness + 1 steps' batches in flight at once, each its own dispatch
        self.pool = ThreadPoolExecutor(cfg.max_staleness + 1, thread_name_prefix="dispatch") if self.separate else None
        self.counters = {"episodes_dispatched": 0, "episodes_recovered": 0, "episodes_missing": 0,
                         "dispatch_failed_tasks": 0, "dispatch_rounds": 0, "unreadable_shards": 0,
                         "quarantined_shards": 0, "duplicate_episodes": 0}
        self.fleet = None
        """Rank 0, runner=fleet: the persistent fleet (started here, so its workers start during step 0's
        set-up and stay for the whole run)."""
        if episodes_cfg.runner == "fleet":
            self.counters.update({f"fleet_{k}": 0 for k in (*FLEET_COUNTERS, "first_lease_s")})
            if self.rank0:
                from megatron_rl.dispatch.fleet import Fleet

                self.fleet = Fleet(episodes_cfg.fleet, self.worker_cfg, run_dir / "fleet", store=self.store).start()
        self.tool_stats: dict[tuple[str, str], list[float]] = {}
        """(domain, tool) -> [calls, errors, seconds] of the episodes taken since the last batch()."""

    # ------------------------------------------------------------------------------- the Rollouts interface
    def submit(self, step: int, tasks: list) -> None:
        groups = []
        for task in tasks:
            g = Group(self.next_gid, step, task, self.prompt_fn(task))
            self.next_gid += 1
            self.inflight[f"g{g.gid}"] = g
            groups.append(g)
        if not groups:
            return
        name = batch_name(groups)
        for g in groups:
            self.batch_of[g.gid] = name
        if self.separate and self.rank0:  # start at once: runs while the trainer trains
            self.futures[name] = self.pool.submit(self._dispatch, groups, self.run_dir / "rl_episodes" / name,
                                                  self.server.url)

    def take(self, step: int) -> list[Group]:
        due = sorted((g for g in self.inflight.values() if g.step <= step), key=lambda g: g.gid)
        self._run(due)
        mine = sorted((g for g in self.ready if g.step <= step), key=lambda g: g.gid)
        self.ready = [g for g in self.ready if g.step > step]
        return mine

    def drain(self) -> None:
        self._run(sorted(self.inflight.values(), key=lambda g: g.gid))

    def batch(self, step: int, sampler) -> tuple[list[Group], dict]:
        before = dict(self.counters)
        groups, stats = super().batch(step, sampler)
        stats.update({k: v - before[k] for k, v in self.counters.items()})
        for (domain, tool), (calls, errors, seconds) in sorted(self.tool_stats.items()):
            stats.update({f"tools/{domain}/{tool}/calls": calls, f"tools/{domain}/{tool}/error_frac": errors / calls,
                          f"tools/{domain}/{tool}/latency_mean_s": seconds / calls})
        self.tool_stats = {}
        return groups, stats

    # ------------------------------------------------------------------------------- dispatch
    def _run(self, groups: list[Group]) -> None:
        """Finish the dispatch of `groups` (every rank calls this with the same groups): colocated, one dispatch
        while the trainer ranks serve; separate, wait for their batches' background dispatches. Fills their
        samples and rewards on every rank and moves them to `ready`."""
        if not groups:
            return
        t0 = time.perf_counter()
        if self.separate:
            names = sorted({self.batch_of[g.gid] for g in groups})
            self._await([self.futures[n] for n in names] if self.rank0 else [])
            results = [self.futures.pop(n).result() if self.rank0 else None for n in names]
        else:
            results = [self._dispatch_now(groups, self.run_dir / "rl_episodes" / batch_name(groups))]
        episodes = self._results(results, count=True)
        self._fill(groups, episodes)
        self._count_tools(episodes.values())
        for g in groups:
            del self.inflight[f"g{g.gid}"]
            self.batch_of.pop(g.gid, None)
            self.ready.append(g)
        self.timers["generate_s"] += time.perf_counter() - t0

    def run_now(self, tasks: list, params: list, tag: str) -> list[Group]:
        """Evaluation groups (one per task, its `SamplingParams`: greedy n=1, or eval.k samples) dispatched to the
        same workers, fleet and server as the training episodes, in a folder of their own
        (`<run>/eval_episodes/<tag>-<nonce>`: an evaluation never finds another's episodes); every rank gets the
        groups with their rewards. Not counted in the step's dispatch metrics."""
        groups = [Group(-1 - i, None, t, self.prompt_fn(t), params=sp) for i, (t, sp) in enumerate(zip(tasks, params))]
        if not groups:
            return groups
        folder = self.run_dir / "eval_episodes" / f"{tag}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        if self.separate:
            futures = [self.pool.submit(self._dispatch, groups, folder, self.server.url)] if self.rank0 else []
            self._await(futures)
            results = [futures[0].result() if futures else None]
        else:
            results = [self._dispatch_now(groups, folder)]
        self._fill(groups, self._results(results, count=False))
        return groups

    def _dispatch_now(self, groups: list[Group], shard_dir: Path) -> dict | None:
        """Colocated: dispatch `groups` into `shard_dir` while the trainer ranks serve the engine (every rank
        calls it); rank 0's result, None on the others."""
        box = {}
        work = (lambda url: box.update(self._dispatch(groups, shard_dir, url))) if self.rank0 else None
        serve_while(self.engine, self.serve_group, work, self._hosts(), self.group, token=self.token)
        return box if self.rank0 else None

    def _results(self, results: list, count: bool) -> dict[str, dict]:
        """Rank 0's dispatch results on every rank: episode id -> episode (a failed dispatch raises on every
        rank); `count`: add their counters to the step's metrics."""
        if self.world > 1:
            dist.broadcast_object_list(results, src=group_leader(self.group), group=self.group)
        episodes: dict[str, dict] = {}
        for result in results:
            if "error" in result:
                raise RuntimeError(f"episode dispatch failed on rank 0: {result['error']}")
            episodes.update(result["episodes"])
            for k in self.counters if count else ():
                self.counters[k] += result["counters"].get(k, 0)
        return episodes

    def _await(self, futures: list[Future], poll_s: float = 5.0) -> None:
        """Every rank returns when rank 0's `futures` are done; the others hear from rank 0 every `poll_s`, so
        no collective waits longer than that (a Slurm queue can hold episodes longer than the collective
        timeout)."""
        while True:
            done = [not self.rank0 or not wait(futures, timeout=poll_s).not_done]
            if self.world > 1:
                dist.broadcast_object_list(done, src=group_leader(self.group), group=self.group)
            if done[0]:
                return

    def _count_tools(self, episodes) -> None:
        for e in episodes:
            for key, value in e["tools"].items():  # tool.<name>.calls / .errors / .latency_s (Environment)
                parts = key.split(".")
                if len(parts) == 3 and parts[2] in _TOOL_SLOTS:
                    self.tool_stats.setdefault((e["env"], parts[1]), [0.0, 0.0, 0.0])[_TOOL_SLOTS[parts[2]]] += value

    def push_weights(self, version: int, named_parameters) -> None:
        """After an update (every rank calls it): rank 0 sends the weights to the separate server."""
        if self.server is not None:
            self.server.push(version, named_parameters)

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
            self.fleet = None
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.server is not None:
            self.server.close()
        self.store.close()

    def _hosts(self) -> tuple[str, str]:
        return server_hosts(self.episodes_cfg)

    def _specs(self, groups: list[Group]) -> list:
        from megatron_rl.dispatch import EpisodeSpec

        out = []
        for g in groups:
            sp = self._sampling(g)
            for i in range(sp.n):
                out.append(EpisodeSpec(
                    episode_id=episode_id(g.gid, i), env=g.task.domain, task=g.task.to_dict(), group_id=g.gid,
                    seed=sp.seed + 7919 * i, prompt_ids=list(g.prompt),
                    sampling={"temperature": sp.temperature, "max_new_tokens": sp.max_new_tokens,
                              "seed": sp.seed + 7919 * i, "stop_token_ids": list(sp.stop_token_ids)}))
        return out

    def _sampling(self, g: Group):
        """A group's sampling: its own (an evaluation group's), else the run's (group_size samples at the rollout
        temperature, seeded by the group id)."""
        if g.params is None:
            return self.params(g.gid)
        return g.params if g.params.seed is not None else dataclasses.replace(g.params, seed=seed_of(self.seed, g.gid))

    def _dispatch(self, groups: list[Group], shard_dir: Path, url: str) -> dict:
        """Rank 0, while the engine serves at `url`: run the missing episodes, read back every published one."""
        from megatron_rl.dispatch import Dispatcher, published_episode_ids

        try:
            specs = self._specs(groups)
            done = {e for ids in published_episode_ids(shard_dir, store=self.store).values() for e in ids}
            todo = [s for s in specs if s.episode_id not in done]
            counters = {"episodes_recovered": len(specs) - len(todo), "episodes_dispatched": len(todo)}
            if todo and self.fleet is not None:
                counters.update(self._on_fleet(shard_dir, todo, url))
            elif todo:
                worker = dataclasses.replace(self.worker_cfg, generator=dataclasses.replace(
                    self.worker_cfg.generator, url=url))
                report = Dispatcher(self._dispatch_cfg(), worker, shard_dir, prefix=shard_dir.name,
                                    store=self.store).run(todo)
                counters.update(dispatch_failed_tasks=len(report.failures), dispatch_rounds=len(report.rounds))
            unreadable: list[str] = []
            episodes = read_episodes(shard_dir, {s.episode_id for s in specs}, unreadable,
                                     vocab_size=getattr(self.tok, "vocab_size", None), store=self.store,
                                     counts=counters)
            counters.update(episodes_missing=len(specs) - len(episodes), unreadable_shards=len(unreadable))
            return {"episodes": episodes, "counters": counters}
        except Exception as e:  # reported to every rank, which all raise
            return {"error": f"{type(e).__name__}: {e}"}

    def _on_fleet(self, shard_dir: Path, todo: list, url: str) -> dict:
        """Run `todo` on the persistent fleet; the fleet's counters of this batch (metrics fleet_*)."""
        before = {**self.fleet.state.queue.counters, **self.fleet.counters}
        rep = self.fleet.run_batch(shard_dir.name, todo, shard_dir, url)
        after = {**self.fleet.state.queue.counters, **self.fleet.counters}
        for eid, reason in sorted(rep["given_up"].items()):
            log.warning("rollouts: episode %s given up by the fleet: %s", eid, reason)
        out = {f"fleet_{k}": after[k] - before[k] for k in FLEET_COUNTERS if k in after}
        out["fleet_first_lease_s"] = rep["first_lease_s"] or 0.0  # queued -> first lease taken (summed per step)
        return out

    def _dispatch_cfg(self):
        d = self.episodes_cfg.dispatch
        return dataclasses.replace(d, folder=d.folder or str(self.run_dir / "dispatch"))

    def _fill(self, groups: list[Group], episodes: dict) -> None:
        from megatron_rl.rollout import SampleOutput

        for g in groups:
            g.samples, g.rewards, g.masks, g.turns, g.prompts, g.timings, g.segments = [], [], [], [], [], [], []
            g.routes = {}
            for i in range(self._sampling(g).n):
                e = episodes.get(episode_id(g.gid, i))
                if e is None:
                    g.samples.append(SampleOutput(i, [], [], [], "abort"))
                    g.rewards.append((0.0, {}, "missing"))
                    g.masks.append([])
                    g.turns.append(0)
                    g.prompts.append(None)
                    g.timings.append({})
                    g.segments.append([])
                    continue
                # the episode's own prompt when it is not the group's (a black-box agent asked another one)
                g.prompts.append(None if e["prompt"] == list(g.prompt) else e["prompt"])
                g.timings.append({k: v for k, v in e["timings"].items() if k != "turns"})
                g.segments.append(e["segments"])
                ids = e["token_ids"]
                finish = "stop" if ids and ids[-1] in self.tok.stop_ids else "length"
                g.samples.append(SampleOutput(i, ids, e["logprobs"], e["versions"], finish))
                g.masks.append(e["mask"])  # the episode's own: observations stay 0 (never re-derived)
                g.turns.append(e["turns"])
                status = "ok" if e["status"] == "truncated" else e["status"]  # truncated: the model's doing
                status = status if any(e["mask"]) or status != "ok" else "error"  # no model token: nothing to train
                g.rewards.append((e["reward"], e["components"], status))
                if e.get("routes") is not None:  # routing replay: the worker's row holds its tokens' experts
                    g.routes[i] = ([*e["prompt"], *ids], e["routes"])


_TOOL_SLOTS = {"calls": 0, "errors": 1, "latency_s": 2}
FLEET_COUNTERS = ("scheduler_queries", "submissions", "workers_lost", "workers_hung", "leases", "leases_expired",
                  "episodes_requeued", "episodes_given_up", "fenced_heartbeats")
"""Fleet counters reported per step as metrics fleet_<name> (plus fleet_first_lease_s: seconds from queueing
a batch to its first lease, summed over the step's batches)."""


def server_hosts(episodes_cfg) -> tuple[str, str]:
    """(bind address, address the workers use) of the rollout server: under Slurm the node's own address (the
    one its name resolves to), never 0.0.0.0 unless the name resolves to loopback only."""
    executor = episodes_cfg.fleet.executor if episodes_cfg.runner == "fleet" else episodes_cfg.dispatch.executor
    slurm = executor in ("slurm", "external")  # workers on other nodes
    public = episodes_cfg.serve_host or (socket.gethostname() if slurm else "127.0.0.1")
    return (node_address(public) if slurm else "127.0.0.1", public)


def episode_id(gid: int, index: int) -> str:
    return f"g{gid}-s{index}"


def batch_name(groups: list[Group]) -> str:
    """The shard folder of a batch: its group-id range (deterministic, so a restart finds it again)."""
    return f"g{groups[0].gid:07d}-g{groups[-1].gid:07d}"


def read_episodes(shard_dir: Path, wanted: set[str], unreadable: list[str] | None = None,
                  vocab_size: int | None = None, store=None, counts: dict | None = None) -> dict[str, dict]:
    """episode id -> response token ids, behaviour log-probs, loss mask, turns, per-token versions, reward,
    components, status, the engine's experts of its tokens (routing replay; None when not recorded) for the
    wanted episodes published in `shard_dir`, read by the one shard consumer (`data.consume.read_folder`: first
    copy of an episode wins; a shard that is unreadable, or whose values break the shard contract, is quarantined
    with a logged reason and its episodes count as missing). `unreadable` gets "where: reason" of each shard
    quarantined or skipped; `counts` gets quarantined_shards and duplicate_episodes added. `store`: the run's
    trajectory store (`data.store`; None = the shared filesystem)."""
    from megatron_rl.data.consume import read_folder

    got = read_folder(shard_dir, store, vocab_size=vocab_size)
    if unreadable is not None:
        unreadable += got.quarantined + got.skipped
    if counts is not None:
        counts["quarantined_shards"] = counts.get("quarantined_shards", 0) + len(got.quarantined)
        counts["duplicate_episodes"] = counts.get("duplicate_episodes", 0) + got.duplicates
    segments: dict[str, list] = {}  # a split agent episode's earlier rows (`<episode>#<k>`)
    for t in got.trajectories:
        if SEGMENT_MARK in t.episode_id:
            segments.setdefault(episode_of(t.episode_id), []).append(t)
    return {t.episode_id: _episode(t, segments.get(t.episode_id, [])) for t in got.trajectories
            if t.episode_id in wanted}


def _episode(t, segments: list) -> dict:
    """A trajectory row as `read_episodes` hands it out, with its earlier segment rows."""
    n = t.prompt_len
    versions = t.token_versions[n:] if t.token_versions is not None else [t.policy_version_first] * (
        len(t.tokens) - n)
    return {"token_ids": [int(x) for x in t.tokens[n:]], "logprobs": [float(x) for x in t.logprobs[n:]],
            "mask": [int(x) for x in t.loss_mask[n:]], "turns": int(t.timings.get("turns", 1)),
            "versions": [int(x) for x in versions], "reward": float(t.reward),
            "components": {k: float(v) for k, v in t.reward_components.items()},
            "status": str(t.status), "env": str(t.env), "prompt": [int(x) for x in t.tokens[:n]],
            "segments": [_segment(x) for x in sorted(
                segments, key=lambda x: int(x.episode_id.rsplit(SEGMENT_MARK, 1)[1]))],
            "timings": {k: float(v) for k, v in t.timings.items()},
            "routes": t.routed_experts,  # int16 [L, L_moe, k] (routing replay) or None
            "tools": {k: float(v) for k, v in t.timings.items() if k.startswith("tool.")}}


def _segment(t) -> dict:
    """A segment row as `EpisodeResult.segments` holds it."""
    versions = t.token_versions if t.token_versions is not None else [t.policy_version_first] * len(t.tokens)
    return {"tokens": [int(x) for x in t.tokens], "logprobs": [float(x) for x in t.logprobs],
            "loss_mask": [int(x) for x in t.loss_mask], "versions": [int(x) for x in versions],
            "prompt_len": int(t.prompt_len)}


def serve_while(engine, tp_group, work, hosts: tuple[str, str], group, token: str | None = None) -> None:
    """Serve `engine` over HTTP on the TP group of `group`'s first rank while `work(url)` runs (a thread on that
    rank), every endpoint but /health behind `token` (None: $MEGATRON_RL_ROLLOUT_TOKEN, else random); ranks
    outside that TP group return at once. Every rank of the TP group returns when `work` has returned."""
    from megatron_rl.rollout.tp_serve import serve_tp

    if group_leader(group) not in dist.get_process_group_ranks(tp_group):
        return
    if group_rank(group) != 0:
        return serve_tp(engine, tp_group)
    finished = threading.Event()
    bind, public = hosts

    def ready(url: str) -> None:
        port = url.rsplit(":", 1)[1]

        def run() -> None:
            try:
                work(f"http://{public}:{port}")
            finally:
                finished.set()
        threading.Thread(target=run, name="dispatch", daemon=True).start()

    serve_tp(engine, tp_group, host=bind, port=0, ready=ready, until=finished, token=token)


class RolloutServerProcess:
    """The rollout engine in a process of its own (`episodes.server: separate`), started by rank 0 on its first
    weight push: `python -m megatron_rl.rollout.server` with the run's model and engine config, bound to a free
    port (reported through a file), `server_threads` torch threads, log in `<run>/rollout_server/server.log`.
    Later pushes save the weights next to it and POST `/update_weights` (policy 'continue'). It gets SIGTERM
    when the driver closes it, and (Linux) when its parent dies."""

    def __init__(self, run_dir: Path, model_cfg, engine_cfg, threads: int, hosts: tuple[str, str],
                 start_timeout_s: float = 180.0, tokenizer_cfg=None, record_routes: bool = False):
        from megatron_rl.config import to_dict

        self.dir = Path(run_dir) / "rollout_server"
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = {"model": to_dict(model_cfg), "engine": to_dict(engine_cfg),
                "tokenizer": to_dict(tokenizer_cfg) if tokenizer_cfg else {}}
        (self.dir / "config.json").write_text(json.dumps(conf))
        self.threads, self.hosts, self.start_timeout_s = threads, hosts, start_timeout_s
        self.record_routes = record_routes
        """MoE routing replay: the server's engine records each token's experts (`--record-routes`)."""
        self.token = secrets.token_urlsafe(32)
        """The job's token for the server's mutating endpoints (passed through the environment, not argv)."""
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.client = None

    def push(self, version: int, named_parameters) -> None:
        path = self._save(named_parameters)
        if self.proc is None:
            self._start(path, version)
        else:
            self.client.update_weights(version, str(path), "continue")

    def _save(self, named_parameters) -> Path:
        from megatron_rl.rollout.weight_file import write_weights

        path = self.dir / "weights.bin"
        write_weights(path, named_parameters)  # raw bytes, read by the server into its engine's parameters
        return path

    def _start(self, weights: Path, version: int) -> None:
        from megatron_rl.rollout.client import TOKEN_ENV, RolloutClient

        port_file = self.dir / "port"
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "megatron_rl.rollout.server", "--host", self.hosts[0], "--port", "0",
               "--port-file", str(port_file), "--config", str(self.dir / "config.json"), "--weights", str(weights),
               "--version", str(version)] + (["--record-routes"] if self.record_routes else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), TOKEN_ENV: self.token}
        for k in list(env):  # a single-process server, not a member of the training job (torchrun's agent store!)
            if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_"):
                del env[k]
        with open(self.dir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.start_timeout_s
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                tail = (self.dir / "server.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"rollout server did not start (see {self.dir / 'server.log'}):\n{tail}")
            time.sleep(0.1)
        self.url = f"http://{self.hosts[1]}:{port_file.read_text().strip()}"
        self.client = RolloutClient(self.url, timeout=300.0, token=self.token)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG); else nothing."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))
    except (OSError, AttributeError):
        pass
