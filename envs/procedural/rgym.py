"""reasoning-gym (PyPI `reasoning-gym`, Apache-2.0) as a task library: each generator of
`reasoning_gym.factory.DATASETS` is the domain `reasoning_gym/<name>`, its category the package subfolder it lives
in (algorithmic, arithmetic, games, ...). The library is a normal dependency, imported on first use (it takes
seconds); nothing of it is copied.

`make` is `create_dataset(name, seed=, size=, **settings)[index]`; `score` is that dataset's own
`score_answer(answer, entry)` (partial credit kept). Settings are the generator's config dataclass fields but
`seed` and `size` (which the splits set); the dataset's own `validate()` checks their values. Some generators
print progress dots to stdout while making tasks: that output is swallowed (making tasks runs before the
episodes, in one thread; scoring, which runs in the episode threads, is left alone).
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import threading
from typing import Any

from envs.procedural.contract import Item, register_library

EXCLUDED = {
    "composite": "it mixes other generators; mix domains in envs.domains instead",
    "game_of_life_halting": "its score_answer in reasoning-gym 0.1.25 gives 1.0 to any non-empty answer "
                            "(bool('False') is True), so it rewards nothing",
}
"""Generators that are not domains, and why."""

NEEDS_PYCOSAT = {
    "zebra_puzzles": "it solves its puzzles with pycosat, which has no wheel for Python 3.11 (it compiles a C "
                     "extension); scripts/setup.sh installs reasoning-gym without it. `pip install pycosat` (needs a "
                     "C compiler) makes it a domain",
}
"""Generators that need pycosat; excluded, with this reason, where pycosat is not installed."""

_SPLIT_KEYS = ("seed", "size")
_quiet_lock = threading.Lock()


@contextlib.contextmanager
def _quiet():
    """Swallow what the generator prints to stdout (progress dots)."""
    with _quiet_lock, contextlib.redirect_stdout(io.StringIO()):
        yield


def _pycosat_missing() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("pycosat") is None
    except (ImportError, ValueError):
        return True


def _stand_in_pycosat() -> None:
    """reasoning-gym imports pycosat when it is imported (for zebra_puzzles only): where pycosat is not installed,
    a module that refuses any use stands in for it, so that every other generator loads."""
    import sys
    import types

    if sys.modules.get("pycosat") is not None or not _pycosat_missing():
        return
    stub = types.ModuleType("pycosat", "stand-in: pycosat is not installed (envs.procedural.rgym)")

    def refuse(*args, **kwargs):
        raise RuntimeError(f"pycosat is not installed: {NEEDS_PYCOSAT['zebra_puzzles']}")

    stub.itersolve = stub.solve = refuse
    sys.modules["pycosat"] = stub


def excluded() -> dict[str, str]:
    """Generators that are not domains here, and why (pycosat's only where it is missing)."""
    return {**EXCLUDED, **(NEEDS_PYCOSAT if _pycosat_missing() else {})}


def _datasets() -> dict:
    _stand_in_pycosat()
    from reasoning_gym.factory import DATASETS

    return DATASETS


@functools.lru_cache(maxsize=256)
def _dataset(generator: str, config_json: str, seed: int, size: int):
    from reasoning_gym.factory import create_dataset

    with _quiet():
        return create_dataset(generator, seed=seed, size=size, **json.loads(config_json))


class ReasoningGym:
    """The reasoning-gym task library (`envs.procedural.TaskLibrary`)."""

    name = "reasoning_gym"

    @property
    def excluded(self) -> dict[str, str]:
        return excluded()

    def version(self) -> str:
        import importlib.metadata

        return importlib.metadata.version("reasoning-gym")

    @functools.cache  # noqa: B019  (one instance, registered once)
    def generators(self) -> dict[str, str]:
        out = {}
        for name, (cls, _) in _datasets().items():
            if name not in self.excluded:
                parts = cls.__module__.split(".")
                out[name] = parts[1] if len(parts) >= 3 else "other"
        return dict(sorted(out.items()))

    def settings(self, generator: str) -> list[str]:
        """The settings of `generator` (its config's fields but seed and size)."""
        import dataclasses

        return sorted(f.name for f in dataclasses.fields(_datasets()[generator][1]) if f.name not in _SPLIT_KEYS)

    def check_config(self, generator: str, config: dict) -> None:
        known = self.settings(generator)
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown} of reasoning-gym generator {generator!r}; known: {known}")
        try:
            json.dumps(config)
            settings = _datasets()[generator][1](**config)
            if hasattr(settings, "validate"):
                settings.validate()
        except Exception as e:
            raise ValueError(f"reasoning-gym generator {generator!r} refuses settings {config}: "
                             f"{e.__class__.__name__}: {e}") from None

    def make(self, generator: str, config: dict, seed: int, size: int, index: int) -> Item:
        ds = _dataset(generator, json.dumps(config, sort_keys=True), seed, size)
        with _quiet():
            entry = ds[index]
        answer = entry.get("answer")
        return Item(str(entry["question"]), None if answer is None else str(answer), entry)

    def score(self, generator: str, config: dict, seed: int, size: int, answer: str, entry: Any) -> float:
        ds = _dataset(generator, json.dumps(config, sort_keys=True), seed, size)
        return float(ds.score_answer(answer, entry))


def available() -> bool:
    """Whether reasoning-gym is installed."""
    import importlib.util

    return importlib.util.find_spec("reasoning_gym") is not None


if available():
    register_library(ReasoningGym())
