"""The countdown environment's curriculum, countdown's generated task source (`envs.task_source`; the run config's
`curriculum:` section while data.domain is countdown): an easier suite for tiny models, few small numbers, targets
one or two operations away.

The tasks are ordinary `envs` countdown tasks (domain 'countdown', payload numbers/target/solution), so the
reward is the real sandboxed countdown reward. Deterministic given (seed, split); splits never share a task.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_rl.config import ConfigError
from megatron_rl.envs.base import Task
from megatron_rl.envs.countdown.env import PROMPT


@dataclass
class CurriculumConfig:
    """Generated countdown tasks (envs/countdown's reward, easier numbers) instead of the shipped suite."""

    enabled: bool = True
    """Use generated tasks for warm-up, RL and evaluation; false = the domain's shipped suite."""
    min_numbers: int = 2
    """Numbers per task at least."""
    max_numbers: int = 3
    """Numbers per task at most."""
    max_value: int = 9
    """Numbers are drawn from 1..max_value."""
    max_ops: int = 2
    """Operations in the reference solution at most."""
    rl_tasks: int = 600
    """Generated training tasks for the RL phase (disjoint from the warm-up's and the held-out ones)."""

    def validate(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers or self.max_value < 2 or self.max_ops < 1:
            raise ConfigError("curriculum: need 2 <= min_numbers <= max_numbers, max_value >= 2, max_ops >= 1")

    def generate(self, n: int, seed: int, split: str) -> list[Task]:
        """The task source's interface (`envs.task_source`): `generate(n, self, seed, split)`."""
        return generate(n, self, seed, split)


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
