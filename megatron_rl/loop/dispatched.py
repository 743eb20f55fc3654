"""Rollouts from dispatched episodes: rollout workers run whole episodes and publish HDF5 shards.

    episodes.runner: dispatch   ->   DispatchRollouts (same interface as loop.rollout.Rollouts)

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

Not covered yet: generation does not overlap training in this mode (each step dispatches its own groups
when it needs them, so `max_staleness` only bounds which samples are kept), and data-parallel replicas
other than rank 0's wait while rank 0's replica serves.
"""
from __future__ import annotations

import dataclasses
import socket
import threading
import time
from pathlib import Path

import torch.distributed as dist

from megatron_rl.loop.rollout import Group, Rollouts, seed_of


class DispatchRollouts(Rollouts):
    """Rollouts whose episodes run on dispatched rollout workers; see the module docstring."""

    def __init__(self, engine, runner, tok, prompt_fn, cfg, seed: int, episodes_cfg, worker_cfg, run_dir: Path,
                 tp_group):
        super().__init__(engine, runner, tok, prompt_fn, cfg, seed)
        self.episodes_cfg, self.worker_cfg, self.run_dir, self.tp_group = episodes_cfg, worker_cfg, run_dir, tp_group
        self.counters = {"episodes_dispatched": 0, "episodes_recovered": 0, "episodes_missing": 0,
                         "dispatch_failed_tasks": 0, "dispatch_rounds": 0}

    # ------------------------------------------------------------------------------- the Rollouts interface
    def submit(self, step: int, tasks: list) -> None:
        for task in tasks:
            g = Group(self.next_gid, step, task, [self.tok.bos_id, *self.tok.encode(self.prompt_fn(task))])
            self.next_gid += 1
            self.inflight[f"g{g.gid}"] = g

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
        return groups, {**stats, **{k: v - before[k] for k, v in self.counters.items()}}

    # ------------------------------------------------------------------------------- dispatch
    def _run(self, groups: list[Group]) -> None:
        """Dispatch `groups` (every rank calls this with the same groups), fill their samples and rewards."""
        if not groups:
            return
        t0 = time.perf_counter()
        shard_dir = self.run_dir / "rl_episodes" / f"g{groups[0].gid:07d}-g{groups[-1].gid:07d}"
        box = {}
        work = (lambda url: box.update(self._dispatch(groups, shard_dir, url))) if dist.get_rank() == 0 else None
        serve_while(self.engine, self.tp_group, work, self._hosts())
        result = [box if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(result, src=0)
        if "error" in result[0]:
            raise RuntimeError(f"episode dispatch failed on rank 0: {result[0]['error']}")
        self._fill(groups, result[0]["episodes"])
        for k in self.counters:
            self.counters[k] += result[0]["counters"].get(k, 0)
        for g in groups:
            del self.inflight[f"g{g.gid}"]
            self.ready.append(g)
        self.timers["generate_s"] += time.perf_counter() - t0

    def _hosts(self) -> tuple[str, str]:
        """(bind address, address the workers use)."""
        slurm = self.episodes_cfg.dispatch.executor == "slurm"
        return ("0.0.0.0" if slurm else "127.0.0.1",
                self.episodes_cfg.serve_host or (socket.gethostname() if slurm else "127.0.0.1"))

    def _specs(self, groups: list[Group]) -> list:
        from megatron_rl.dispatch import EpisodeSpec

        out = []
        for g in groups:
            base = seed_of(self.seed, g.gid)
            for i in range(self.cfg.group_size):
                out.append(EpisodeSpec(
                    episode_id=episode_id(g.gid, i), env=g.task.domain, task=g.task.to_dict(), group_id=g.gid,
                    seed=base + 7919 * i, prompt_ids=list(g.prompt),
                    sampling={"temperature": self.cfg.temperature, "max_new_tokens": self.cfg.max_new_tokens,
                              "seed": base + 7919 * i, "stop_token_ids": [self.tok.eos_id]}))
        return out

    def _dispatch(self, groups: list[Group], shard_dir: Path, url: str) -> dict:
        """Rank 0, while the engine serves at `url`: run the missing episodes, read back every published one."""
        from megatron_rl.dispatch import Dispatcher, published_episode_ids

        try:
            specs = self._specs(groups)
            done = {e for ids in published_episode_ids(shard_dir).values() for e in ids}
            todo = [s for s in specs if s.episode_id not in done]
            counters = {"episodes_recovered": len(specs) - len(todo), "episodes_dispatched": len(todo)}
            if todo:
                worker = dataclasses.replace(self.worker_cfg, generator=dataclasses.replace(
                    self.worker_cfg.generator, url=url))
                report = Dispatcher(self._dispatch_cfg(), worker, shard_dir, prefix=shard_dir.name).run(todo)
                counters.update(dispatch_failed_tasks=len(report.failures), dispatch_rounds=len(report.rounds))
            episodes = read_episodes(shard_dir, {s.episode_id for s in specs})
            counters["episodes_missing"] = len(specs) - len(episodes)
            return {"episodes": episodes, "counters": counters}
        except Exception as e:  # reported to every rank, which all raise
            return {"error": f"{type(e).__name__}: {e}"}

    def _dispatch_cfg(self):
        d = self.episodes_cfg.dispatch
        return dataclasses.replace(d, folder=d.folder or str(self.run_dir / "dispatch"))

    def _fill(self, groups: list[Group], episodes: dict) -> None:
        from megatron_rl.rollout import SampleOutput

        for g in groups:
            g.samples, g.rewards = [], []
            for i in range(self.cfg.group_size):
                e = episodes.get(episode_id(g.gid, i))
                if e is None:
                    g.samples.append(SampleOutput(i, [], [], [], "abort"))
                    g.rewards.append((0.0, {}, "missing"))
                    continue
                ids = e["token_ids"]
                finish = "stop" if ids and ids[-1] == self.tok.eos_id else "length"
                g.samples.append(SampleOutput(i, ids, e["logprobs"], e["versions"], finish))
                status = e["status"] if ids or e["status"] != "ok" else "error"  # no response: nothing to train
                g.rewards.append((e["reward"], e["components"], status))


def episode_id(gid: int, index: int) -> str:
    return f"g{gid}-s{index}"


def read_episodes(shard_dir: Path, wanted: set[str]) -> dict[str, dict]:
    """episode id -> response token ids, behaviour log-probs, per-token versions, reward, components, status
    for the wanted episodes published in `shard_dir` (first copy wins; unreadable shards are skipped)."""
    from megatron_rl.data.shards import ShardError, read_shard

    out: dict[str, dict] = {}
    for p in sorted(shard_dir.glob("*.h5")) if shard_dir.is_dir() else []:
        try:
            trajs = read_shard(p)
        except (ShardError, OSError):
            continue
        for t in trajs:
            if t.episode_id not in wanted or t.episode_id in out:
                continue
            n = t.prompt_len
            versions = t.token_versions[n:] if t.token_versions is not None else [t.policy_version_first] * (
                len(t.tokens) - n)
            out[t.episode_id] = {"token_ids": [int(x) for x in t.tokens[n:]],
                                 "logprobs": [float(x) for x in t.logprobs[n:]],
                                 "versions": [int(x) for x in versions], "reward": float(t.reward),
                                 "components": {k: float(v) for k, v in t.reward_components.items()},
                                 "status": str(t.status)}
    return out


def serve_while(engine, tp_group, work, hosts: tuple[str, str]) -> None:
    """Serve `engine` over HTTP on the TP group of global rank 0 while `work(url)` runs (a thread on rank 0);
    ranks outside that group return at once. Every rank of the group returns when `work` has returned."""
    from megatron_rl.rollout.tp_serve import serve_tp

    if 0 not in dist.get_process_group_ranks(tp_group):
        return
    if dist.get_rank() != 0:
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

    serve_tp(engine, tp_group, host=bind, port=0, ready=ready, until=finished)
