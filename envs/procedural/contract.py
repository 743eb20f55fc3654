"""The plugin contract of procedural task libraries (`TaskLibrary`), their registry and domain names.

A task library (reasoning-gym, a verifiers taskset, a company's internal generator) is a set of named generators,
each making tasks deterministically from (settings, seed, index) and scoring an answer to one of them. Registered
in `LIBRARIES`, every generator `g` of library `lib` becomes the domain `lib/g`: an environment of the same
registry and factory as the hand-written ones (`envs.base.ENVIRONMENTS`, `envs.mixture.EnvFactory`), so it runs
in-process and on rollout workers, with

- train and held-out tasks generated from seeds (`generate`), disjoint by question text (checked by the mixture),
  recorded in every task's provenance (library, version, generator, seed, size, index, settings);
- the generator's settings (difficulty) per domain (`envs.domains.<d>.generator`), unknown names refused;
- optionally, difficulty levels (a library's `levels(generator)`: settings per level, easiest first, e.g.
  reasoning-gym's own curricula) that a domain climbs during the run (`envs.domains.<d>.levels`);
- the answer asked for in <answer>...</answer> and scored by the generator's own scorer (partial credit kept),
  plus a separate `format` component (`envs.procedural.env`);
- a generator that raises while making a task: that task is left out and counted per domain; while scoring: the
  sample is masked (reward status `error`, never scored 0), counted per domain by the RL loop's metrics.

The contract is `TaskLibrary`; a minimal second library (docs/task_libraries.md):

    from megatron_rl.envs.procedural import Item, register_library

    class Doubling:
        name = "doubling"
        def version(self): return "1"
        def generators(self): return {"double": "arithmetic"}
        def check_config(self, generator, config):
            for key in set(config) - {"max_value"}:
                raise ValueError(f"unknown setting {key!r}; known: ['max_value']")
        def make(self, generator, config, seed, size, index):
            n = (seed * 7919 + index) % config.get("max_value", 100)
            return Item(f"What is {n} doubled?", str(2 * n), {"n": n})
        def score(self, generator, config, seed, size, answer, entry):
            return float(answer.strip() == str(2 * entry["n"]))

    register_library(Doubling())   # domains: doubling/double
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from megatron_rl.registry import Registry

SEP = "/"
"""Between a library's name and a generator's in a domain name: `reasoning_gym/basic_arithmetic`."""


@dataclass
class Item:
    """One task as a library makes it."""

    question: str
    """The task text the model sees (the answer format is appended by the environment)."""
    answer: str | None
    """The reference answer (scores 1.0); None when the generator has none (several answers are right)."""
    entry: Any = None
    """The library's own record of the task, handed back to `score` (kept in the task payload when it survives a
    JSON round trip unchanged; otherwise the task is made again from its seed and index to score it)."""


@runtime_checkable
class TaskLibrary(Protocol):
    """A procedural task library. `make` and `score` must be deterministic and may raise (the task or the sample
    is then masked and counted, never scored 0); `check_config` raises ValueError naming a bad setting."""

    name: str
    """The prefix of its domains (`<name>/<generator>`); letters, digits and _ only."""

    def version(self) -> str:
        """The library's version (recorded in every task's provenance)."""

    def generators(self) -> dict[str, str]:
        """Generator name -> its category (what `envs.domains` patterns like `<name>:<category>` select)."""

    def check_config(self, generator: str, config: dict) -> None:
        """Refuse settings the generator does not have (or values it rejects): ValueError naming them."""

    def make(self, generator: str, config: dict, seed: int, size: int, index: int) -> Item:
        """Task `index` (0 <= index < size) of the split drawn with `seed` and `size`."""

    def score(self, generator: str, config: dict, seed: int, size: int, answer: str, entry: Any) -> float:
        """The generator's score in [0, 1] of `answer` (the text extracted from the reply) to the task `entry`."""


def difficulty_levels(domain: str) -> list[dict]:
    """The generator settings of `domain`'s difficulty levels, easiest first, from its library's optional
    `levels(generator) -> list[dict]` (the generator's own curriculum); [] when the library has none. A domain
    with `envs.domains.<d>.levels: N` climbs the first N of them during the run (`envs.sampler`)."""
    parts = split_domain(domain)
    if parts is None:
        return []
    levels = getattr(LIBRARIES.get(parts[0]), "levels", None)
    return list(levels(parts[1])) if callable(levels) else []


LIBRARIES: Registry[TaskLibrary] = Registry("task library", entry_point_group="megatron_rl.task_libraries")
"""Library name -> the library object (third-party ones through the `megatron_rl.task_libraries` entry points)."""


def register_library(library: TaskLibrary, overwrite: bool = False) -> TaskLibrary:
    """Register `library`: its generators become the domains `<library.name>/<generator>`."""
    import re

    if not isinstance(library, TaskLibrary):
        missing = [m for m in ("name", "version", "generators", "check_config", "make", "score")
                   if not hasattr(library, m)]
        raise TypeError(f"{library!r} is not a TaskLibrary: missing {missing} (see envs/procedural/__init__.py)")
    if not re.fullmatch(r"[A-Za-z0-9_]+", library.name):
        raise ValueError(f"task library name {library.name!r}: letters, digits and _ only (it prefixes domains)")
    return LIBRARIES.register(library.name, library, overwrite=overwrite)


def split_domain(domain: str) -> tuple[str, str] | None:
    """(library, generator) of a library domain, else None (also for an unknown library)."""
    lib, sep, gen = domain.partition(SEP)
    return (lib, gen) if sep and gen and lib in LIBRARIES else None


def library_domains(library: str) -> dict[str, str]:
    """Domain -> category of every generator of `library`."""
    return {f"{library}{SEP}{g}": c for g, c in sorted(LIBRARIES.get(library).generators().items())}


def is_procedural(domain: str) -> bool:
    """Whether `domain` is a registered library's generator."""
    parts = split_domain(domain)
    return parts is not None and parts[1] in LIBRARIES.get(parts[0]).generators()


def task_provenance(task) -> dict[str, str]:
    """A task's provenance as shard strings (`task.<key>`): library, version, generator, seed, size, index,
    settings of a generated task; {} for a task of a hand-written suite."""
    prov = (getattr(task, "payload", None) or {}).get("provenance")  # a stand-in task may have no payload
    if not isinstance(prov, dict):
        return {}
    import json

    return {f"task.{k}": v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in prov.items()}
