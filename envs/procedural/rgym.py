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

from megatron_rl.envs.procedural.contract import Item, register_library

EXCLUDED = {
    "composite": "it mixes other generators; mix domains in envs.domains instead",
    "game_of_life_halting": "its score_answer in reasoning-gym 0.1.25 gives 1.0 to any non-empty answer "
                            "(bool('False') is True), so it rewards nothing",
}
"""Generators that are not domains, and why."""

NEEDS = {"zebra_puzzles": "pycosat"}
"""Generators that need a module the default set-up leaves out (scripts/setup.sh installs reasoning-gym with
--no-deps: pycosat has no wheel for Python 3.11 and compiles C)."""


def _placeholder(module: str) -> None:
    """reasoning-gym imports every generator's module on import (zebra_puzzles' imports pycosat at the top): with
    `module` missing, a stand-in whose functions (pycosat's solve and itersolve) raise lets the others load; the
    generators that need it are refused by name (`excluded`), so the stand-in is never called through a domain."""
    import sys
    import types

    if _importable(module):
        return

    def missing(*args, **kwargs):
        raise ModuleNotFoundError(f"{module} is not installed; `pip install {module}` (it compiles C) enables the "
                                  "generators that need it", name=module)

    class Missing(types.ModuleType):
        """Only the callables (pycosat's solve, itersolve) raise; any other attribute is absent (AttributeError), as
        tools that probe modules (inspect reads `__file__` of every module) expect."""

    stub = Missing(module)
    stub.solve = stub.itersolve = missing
    sys.modules[module] = stub


def _importable(module: str) -> bool:
    """`module` imports (and is not the stand-in of `_placeholder`)."""
    import importlib

    try:
        return type(importlib.import_module(module)).__name__ != "Missing"
    except ImportError:
        return False


def _missing() -> dict[str, str]:
    """Generators refused because a module they need is not installed, and why."""
    out = {}
    for gen, module in NEEDS.items():
        if not _importable(module):
            out[gen] = (f"it needs {module}, which is not installed (the set-up leaves it out: it has no wheel for "
                        f"this Python and compiles C); `pip install {module}` enables it")
    return out

_SPLIT_KEYS = ("seed", "size")
_quiet_lock = threading.Lock()


@contextlib.contextmanager
def _quiet():
    """Swallow what the generator prints to stdout (progress dots)."""
    with _quiet_lock, contextlib.redirect_stdout(io.StringIO()):
        yield


def _datasets() -> dict:
    for module in set(NEEDS.values()):
        _placeholder(module)
    from reasoning_gym.factory import DATASETS

    return DATASETS


@functools.lru_cache(maxsize=256)
def _dataset(generator: str, config_json: str, seed: int, size: int):
    _datasets()  # the stand-ins of missing modules first
    from reasoning_gym.factory import create_dataset

    with _quiet():
        return create_dataset(generator, seed=seed, size=size, **json.loads(config_json))


class ReasoningGym:
    """The reasoning-gym task library (`envs.procedural.TaskLibrary`)."""

    name = "reasoning_gym"

    @property
    def excluded(self) -> dict[str, str]:
        """Generators that are not domains here, and why (EXCLUDED, and those whose module is missing)."""
        return {**EXCLUDED, **_missing()}

    def version(self) -> str:
        import importlib.metadata

        return importlib.metadata.version("reasoning-gym")

    @functools.cache  # noqa: B019  (one instance, registered once)
    def generators(self) -> dict[str, str]:
        out = {}
        datasets, excluded = _datasets(), self.excluded
        for name, (cls, _) in datasets.items():
            if name not in excluded:
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

    @functools.cache  # noqa: B019  (one instance, registered once)
    def levels(self, generator: str) -> tuple[dict, ...]:
        """The settings of the generator's own curriculum (reasoning-gym's `create_curriculum`) at each global
        level, easiest first (level L puts every attribute at min(L, its last level)): only the settings the
        curriculum moves (plain JSON values); () without a curriculum."""
        import dataclasses

        _datasets()
        from reasoning_gym.factory import create_curriculum, has_curriculum

        if not has_curriculum(generator):
            return ()
        cur, confs = create_curriculum(generator), []
        for level in range(max((len(a.levels) for a in cur.attributes.values()), default=1)):
            cur.set_global_level(level)
            confs.append(dataclasses.asdict(cur.generate_configuration({"seed": 0, "size": 1})))
        moved = sorted(k for k in confs[0] if k not in _SPLIT_KEYS and len({json.dumps(c[k], default=repr)
                                                                           for c in confs}) > 1)
        out = []
        for c in confs:
            level = {k: c[k] for k in moved if _plain(c[k])}
            if not out or level != out[-1]:
                out.append(level)
        return tuple(out)

    def make(self, generator: str, config: dict, seed: int, size: int, index: int) -> Item:
        ds = _dataset(generator, json.dumps(config, sort_keys=True), seed, size)
        with _quiet():
            entry = ds[index]
        answer = entry.get("answer")
        return Item(str(entry["question"]), None if answer is None else str(answer), entry)

    def score(self, generator: str, config: dict, seed: int, size: int, answer: str, entry: Any) -> float:
        ds = _dataset(generator, json.dumps(config, sort_keys=True), seed, size)
        return float(ds.score_answer(answer, entry))


def _plain(value) -> bool:
    """`value` survives a JSON round trip unchanged (an int, a float, a string, a list of them)."""
    try:
        return json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        return False


def available() -> bool:
    """Whether reasoning-gym is installed."""
    import importlib.util

    return importlib.util.find_spec("reasoning_gym") is not None


if available():
    register_library(ReasoningGym())
