"""The RL step's row: phase timings (`Clock`), the mixture's per-domain figures, the trainer's, the batch's
(lengths, policy lag, agent splits), the episode runner's and the weight sync's."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from megatron_rl.data.shards import SEGMENT_MARK

if TYPE_CHECKING:
    from megatron_rl.loop.job import Job


class Clock:
    """Wall time of a step's phases; generation and env-wait come from the rollouts' own timers."""

    def __init__(self, rollouts):
        self.rollouts, self.t0, self.cpu0 = rollouts, time.perf_counter(), rank_cpu_s()
        self.start = dict(rollouts.timers)
        self.marks: dict[str, float] = {}
        self.last = self.t0

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.marks[name] = now - self.last
        self.last = now

    def summary(self) -> dict:
        total = time.perf_counter() - self.t0
        gen = self.rollouts.timers["generate_s"] - self.start["generate_s"]
        env = self.rollouts.timers["env_wait_s"] - self.start["env_wait_s"]
        train = self.marks.get("train", 0.0)
        return {"time_step_s": total, "time_generate_s": gen, "time_env_wait_s": env, "time_train_s": train,
                "time_sync_s": self.marks.get("sync", 0.0), "trainer_idle_frac": 1.0 - train / max(total, 1e-9),
                "cpu_step_s": rank_cpu_s() - self.cpu0}


def rank_cpu_s() -> float:
    """User + system CPU seconds of this rank (every thread: trainer, in-process engine, episode threads) and of
    its children that were waited for (sandboxes): summed over steps, the CPU cost of a run on this rank."""
    import resource

    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


TRAIN_KEYS = ("loss", "grad_norm", "clip_fraction", "approx_kl", "ref_kl", "entropy_mean", "behaviour_kl",
              "is_weight_mean", "samples", "update_skipped", "lr", "routing_mismatch_frac", "value_loss",
              "value_clip_fraction", "explained_variance", "value_mean", "value_grad_norm", "mtp_loss",
              "teacher_kl")


def step_metrics(job: Job, rollouts, cols, train: dict, sampling: dict, clock: Clock) -> dict:
    from megatron_rl.registry import plugin_failures

    domains = job.sampler.metrics.summary(reset=True)
    m = {**domains, **sampling, **{k: train[k] for k in TRAIN_KEYS if train.get(k) is not None},
         **clock.summary()}
    counts = {k.rsplit("/", 1)[0]: v for k, v in domains.items() if k.endswith("/count")}  # names may hold '/'
    valid = {d: c * (1.0 - domains[f"{d}/infra_error_frac"]) for d, c in counts.items()}  # scored episodes
    m["reward_mean"] = sum(domains[f"{d}/reward_mean"] * c for d, c in valid.items()) / (sum(valid.values()) or 1.0)
    m["sandbox_error_rate"] = sum(c - valid[d] for d, c in counts.items()) / (sum(counts.values()) or 1.0)
    for d in job.sampler.domains:  # every domain of the mixture, sampled this step or not
        if d not in counts:
            m.update({f"{d}/count": 0.0, f"{d}/reward_mean": None, f"{d}/turns_mean": None,
                      f"{d}/infra_error_frac": None})
    m.update({f"{d}/weight": p for d, p in job.sampler.probabilities().items()})  # the next draws' (curriculum)
    m.update(job.sampler.level_metrics())  # '<domain>/level' of the domains that climb difficulty levels
    if train.get("mismatch_kl") is not None:  # KL(engine's behaviour log-probs || trainer's, before the update)
        m["mismatch_kl"] = train["mismatch_kl"]
    m.update(_batch_metrics(cols, job.engine.version - 1, clock))
    m.update(_runner_metrics(job.runner))
    if getattr(job.engine, "restarts", None) is not None:  # engine.backend=vllm: its process restarts so far
        m["vllm_restarts"] = job.engine.restarts
    m.update(job.sync_stats)  # bytes and seconds of the weight sync after this update
    m["plugins_failed"] = sum(plugin_failures().values())  # each logged with its reason when it failed
    return m


def _batch_metrics(cols, version: int, clock: Clock) -> dict:
    if cols is None:
        return {"trained_samples": 0}
    lengths = np.diff(np.asarray(cols.offsets)) - np.asarray(cols.prompt_len)  # [N] response tokens
    lag = version - np.asarray(cols.policy_version_first)
    gen = max(clock.summary()["time_generate_s"], 1e-9)
    return {**_agent_metrics(cols), "trained_samples": len(cols), "response_len_mean": float(lengths.mean()),
            "response_len_max": int(lengths.max()), "policy_lag_mean": float(lag.mean()),
            "policy_lag_max": int(lag.max()), "tokens_per_s": float(lengths.sum()) / gen,
            "mixed_version_samples": int((np.asarray(cols.policy_version_last)
                                          != np.asarray(cols.policy_version_first)).sum())}


def _agent_metrics(cols) -> dict:
    """Black-box agent episodes of the batch (envs.agents): calls per episode, and history splits (each one an
    extra row of its episode: an earlier exact segment, trained with it); {} without any."""
    t = cols.timings
    if "agent.calls" not in t:
        return {}
    return {"agent_calls_mean": float(np.nanmean(t["agent.calls"])),
            "agent_splits": float(np.nansum(t.get("agent.splits", 0.0))),
            "agent_segment_rows": int(sum(SEGMENT_MARK in str(e) for e in cols.episode_id))}


def _runner_metrics(runner) -> dict:
    if runner is None:
        return {}
    s = runner.stats()
    pending = s["submitted"] - s["finished"]
    return {"episodes_pending": pending, "episodes_stalled_s": time.monotonic() - s["last_finish"] if pending else 0.0}
