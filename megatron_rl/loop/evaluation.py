"""Held-out evaluation: greedy success, pass@1 and pass@k per domain, in the train loop (`evaluate`: an `eval`
row) and in `megatron-rl eval` (`heldout_run`)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from megatron_rl.loop.job import say
from megatron_rl.run_config import RunConfig

if TYPE_CHECKING:
    from megatron_rl.loop.job import Job


def eval_due(cfg: RunConfig, step: int) -> bool:
    return step == cfg.rl.steps - 1 or bool(cfg.eval.every and (step + 1) % cfg.eval.every == 0)


def evaluate(job: Job, rollouts, step: int) -> dict:
    """Held-out success of every domain of the mixture, logged as an `eval` row (rank 0; {} on other ranks)."""
    cfg = job.cfg
    m = heldout_success(rollouts, job.heldout, cfg, tag=f"eval{step}")
    if not job.is_rank0:
        return {}
    job.monitor.log("eval", step, m)
    say(job, f"eval  step {step:3d}: held-out success greedy {m['success_greedy']:.3f}  pass@1 {m['pass@1']:.3f}"
               f"  pass@{cfg.eval.k} {m[f'pass@{cfg.eval.k}']:.3f}  ({m['tasks']} tasks)")
    return m


def heldout_success(rollouts, tasks: list, cfg: RunConfig, tag: str) -> dict:
    """Greedy success, pass@1 and pass@k (eval.k samples at the rollout temperature) on `tasks`, overall and per
    domain, each episode judged by its environment's own success definition (`Environment.success`) after the
    same episode loop as training (multi-turn included). Samples whose episode failed for an infrastructure
    reason are left out (counted in infra_error_frac), never scored as failures. Every rank runs the engine;
    rank 0 (the runner's) returns the metrics, the others {}."""
    return heldout_run(rollouts, tasks, cfg, tag)[0]


def heldout_run(rollouts, tasks: list, cfg: RunConfig, tag: str) -> tuple[dict, list[dict]]:
    """`heldout_success`'s metrics and one row per task (`megatron_rl.eval_report.task_rows`); ({}, []) off rank 0."""
    from megatron_rl.eval_report import task_rows
    from megatron_rl.loop.metrics import rank_cpu_s
    from megatron_rl.rollout import SamplingParams

    tok = rollouts.tok
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=cfg.rl.max_new_tokens, stop_token_ids=list(tok.stop_ids))
              for _ in tasks]
    sampled = [rollouts.params(10**7 + i, n=cfg.eval.k) for i in range(len(tasks))]  # seeded by the task's place
    t0, cpu0 = time.perf_counter(), rank_cpu_s()
    up = by_prompt_length(tasks, rollouts.prompt_fn)
    order = up + up[::-1]  # greedy shortest first, then sampled longest first: the longest prompts, prefilled last
    # by their greedy request, are still in the prefix cache when their sampled request comes
    ran = rollouts.run_now([tasks[i] for i in order], [greedy[i] for i in up] + [sampled[i] for i in up[::-1]],
                           tag=tag)
    groups = [None] * len(ran)  # back in the order of `tasks` (greedy, then sampled)
    for j, i in enumerate(order):
        groups[i + (len(tasks) if j >= len(tasks) else 0)] = ran[j]
    if not rollouts.is_scorer:
        return {}, []
    n, out = len(tasks), {}
    solved = [_solved(g) for g in groups]  # per group: 0/1 per valid sample
    for d in sorted({t.domain for t in tasks}):
        idx = [i for i, t in enumerate(tasks) if t.domain == d]
        out.update({f"{d}/{k}": v for k, v in _success([solved[i] for i in idx], [solved[n + i] for i in idx],
                                                       cfg.eval.k).items()})
        out[f"{d}/turns_mean"] = float(np.mean([x for i in idx for x in groups[n + i].turns] or [0]))
    samples = [r for g in groups for r in g.rewards]
    rows = task_rows(tasks, solved[:n], solved[n:], [g.turns for g in groups[n:]], cfg.eval.k)
    return {**_success(solved[:n], solved[n:], cfg.eval.k), **out, "time_s": time.perf_counter() - t0,
            "cpu_s": rank_cpu_s() - cpu0,  # this rank's CPU seconds (all its threads and waited-for children)
            "infra_error_frac": float(np.mean([r[2] != "ok" for r in samples])) if samples else 0.0}, rows


def by_prompt_length(tasks: list, prompt_fn) -> list[int]:
    """The indices of `tasks`, shortest prompt first (ties in their order): the engine decodes the sequences it
    runs at once padded to the longest one's K/V, so a mixture's long prompts (hundreds of tokens next to tens)
    cost far less decoded together than mixed with short ones. Only the order of the requests changes."""
    return sorted(range(len(tasks)), key=lambda i: len(prompt_fn(tasks[i])))


def _solved(g) -> list[int]:
    from megatron_rl.envs.base import RewardResult
    from megatron_rl.prompts import environment

    env = environment(g.task.domain)
    return [int(env.success(RewardResult(r[0], dict(r[1]), status=r[2]))) for r in g.rewards if r[2] == "ok"]


def _success(greedy: list[list[int]], sampled: list[list[int]], k: int) -> dict:
    """Means over the tasks that have a valid sample (greedy and sampled separately)."""
    g, s = [c[0] for c in greedy if c], [c for c in sampled if c]
    return {"success_greedy": float(np.mean(g)) if g else 0.0, "pass@1": float(np.mean([np.mean(c) for c in s]))
            if s else 0.0, f"pass@{k}": float(np.mean([max(c) for c in s])) if s else 0.0, "tasks": len(greedy)}
