"""Build the arithmetic suite: python -m megatron_rl.envs.arithmetic.build_tasks
(writes tasks/train.jsonl, heldout.jsonl).

Every question of four families (one-digit a+b and a*b, a-b with a in 10..19, two-digit + one-digit sums);
one in five, chosen by a seeded shuffle, is held out, so the splits share no question.
"""
from __future__ import annotations

import random
from pathlib import Path

from megatron_rl.envs.base import Task
from megatron_rl.envs.tasks import write_splits

FAMILIES = {
    "add": [(a, b, "+", a + b) for a in range(1, 10) for b in range(1, 10)],
    "mul": [(a, b, "*", a * b) for a in range(2, 10) for b in range(2, 10)],
    "sub": [(a, b, "-", a - b) for a in range(10, 20) for b in range(1, 10)],
    "add2": [(a, b, "+", a + b) for a in range(10, 50) for b in range(1, 10)],
}


def build(seed: int = 0) -> list[Task]:
    tasks = []
    for fam, rows in FAMILIES.items():
        order = random.Random(f"{seed}-{fam}").sample(rows, len(rows))
        for i, (a, b, op, ans) in enumerate(order):
            tasks.append(Task(id=f"arith-{fam}-{a}{op}{b}", domain="arithmetic", prompt=f"What is {a} {op} {b}?",
                              payload={"answer": ans, "family": fam}, split="heldout" if i % 5 == 0 else "train"))
    return tasks


if __name__ == "__main__":
    write_splits(Path(__file__).parent / "tasks", build())
