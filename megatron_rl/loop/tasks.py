"""An easier countdown curriculum for tiny models: few small numbers, targets one or two operations away.

The tasks are ordinary `envs` countdown tasks (domain 'countdown', payload numbers/target/solution), so the
reward is the real sandboxed countdown reward. Deterministic given (seed, split); splits never share a task.
"""
from __future__ import annotations

import random

from envs.base import Task
from envs.countdown.env import PROMPT
from megatron_rl.loop.config import CurriculumConfig

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _one(rng: random.Random, cfg: CurriculumConfig) -> tuple[list[int], int, str] | None:
    numbers = [rng.randint(1, cfg.max_value) for _ in range(rng.randint(cfg.min_numbers, cfg.max_numbers))]
    used = rng.sample(numbers, min(len(numbers), rng.randint(2, cfg.max_ops + 1)))
    expr, value = str(used[0]), used[0]
    for n in used[1:]:
        op = rng.choice("+-*")
        if op == "-" and value <= n:
            op = "+"
        expr, value = f"{expr} {op} {n}" if op != "*" or " " not in expr else f"({expr}) * {n}", _OPS[op](value, n)
    return (numbers, value, expr) if value > 0 and value not in numbers else None


def generate(n: int, cfg: CurriculumConfig, seed: int, split: str) -> list[Task]:
    """`n` distinct tasks for `split` (train, rl or heldout); a task's (numbers, target) never repeats across
    splits of the same seed."""
    rng, seen, tasks = random.Random(f"curriculum:{seed}"), set(), {s: [] for s in ("heldout", "train", "rl")}
    order, want = ("heldout", "train", "rl"), {split: n}
    for _ in range(200_000):
        if len(tasks[split]) >= want[split]:
            return tasks[split][:n]
        got = _one(rng, cfg)
        if got is None or (tuple(sorted(got[0])), got[1]) in seen:
            continue
        seen.add((tuple(sorted(got[0])), got[1]))
        s = order[len(seen) % 3]
        tasks[s].append(Task(id=f"easy-{s}-{len(tasks[s]):05d}", domain="countdown",
                             prompt=PROMPT.format(numbers=got[0], target=got[1]),
                             payload={"numbers": got[0], "target": got[1], "solution": got[2]},
                             split="heldout" if s == "heldout" else "train"))
    raise ValueError(f"curriculum: only {len(tasks[split])} distinct {split} tasks exist for max_value="
                     f"{cfg.max_value}, max_numbers={cfg.max_numbers}; ask for fewer or raise those")
