"""Helpers for generated task suites (math, code, tool_use builders): families of parametrised tasks and the
held-out rule they share.

A `Family` draws parameter sets with a seeded RNG (or lists them all) and renders each into a task. The split
is by PARAMETER RANGE: a family names one parameter (`key`) and an inclusive band of its values (`held`); a task
is held out exactly when its key lies in the band. So a held-out task may read like a train task with other
numbers, but no train task has a key value from the band (no held-out task is a train task, nor one with only
the other parameters changed). Each generated task's payload records `family`, `tier` (easy or medium) and
`params`, so the rule can be checked from the shipped files.
"""
from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

MASK = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Family:
    name: str
    tier: str
    key: str
    held: tuple[int, int]
    n: int
    draw: Callable[[random.Random], dict]
    """One parameter set (called until `n` distinct sets are drawn)."""

    def is_held(self, params: dict) -> bool:
        lo, hi = self.held
        return lo <= params[self.key] <= hi

    def params(self, seed: str) -> list[dict]:
        """`n` distinct parameter sets, the same for the same seed."""
        rng, seen, out = random.Random(f"{seed}-{self.name}"), set(), []
        for _ in range(self.n * 200):
            p = self.draw(rng)
            sig = repr(sorted(p.items()))
            if sig not in seen:
                seen.add(sig)
                out.append(p)
                if len(out) == self.n:
                    return out
        raise ValueError(f"family {self.name}: only {len(out)} distinct parameter sets, wanted {self.n}")


def split_of(family: Family, params: dict) -> str:
    return "heldout" if family.is_held(params) else "train"


def meta(family: Family, params: dict) -> dict:
    """The payload fields every generated task carries."""
    return {"family": family.name, "tier": family.tier, "params": params}


def template(prompt: str) -> str:
    """A prompt with its numbers masked and whitespace/case normalised (for near-duplicate checks)."""
    return " ".join(MASK.sub("#", prompt).lower().split())


def normalise(prompt: str) -> str:
    return " ".join(prompt.lower().split())
