"""Named registries for extension points (environments, rewards, losses, advantage estimators, sandboxes).

A registry maps a name to an object (usually a function or class) with a declared signature contract.
Third-party packages may add entries through the Python entry-point group given at construction. A plugin
that fails to load is logged and recorded in `failed` (name -> reason; `plugin_failures()` counts them over
every registry); the others load, and asking for the broken one by name raises with its reason.
"""
from __future__ import annotations

import importlib.metadata
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class RegistryError(KeyError):
    """Unknown or duplicate registry name; the message lists what is available."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """A name -> object table. `register` works as a decorator or a plain call."""

    def __init__(self, kind: str, entry_point_group: str | None = None):
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._items: dict[str, T] = {}
        self._entry_points_loaded = False
        self.failed: dict[str, str] = {}
        """Entry-point name -> why it failed to load."""
        self._families: list[tuple[Callable[[str], T | None], Callable[[], list[str]]]] = []
        _ALL.add(self)

    def add_family(self, resolve: Callable[[str], T | None], names: Callable[[], list[str]]) -> None:
        """Entries made on first use (e.g. one per generator of a task library, whose import is slow): a name not
        registered goes to `resolve(name)` (its entry, or None: not of this family), which is registered;
        `names()` lists the family for `names()` (called only when the whole registry is listed)."""
        self._families.append((resolve, names))

    def _resolve_family(self, name: str) -> bool:
        for resolve, _ in self._families:
            obj = resolve(name)
            if obj is not None:
                self._items[name] = obj
                return True
        return False

    def register(self, name: str, obj: T | None = None, *, overwrite: bool = False):
        if obj is None:
            return lambda o: self.register(name, o, overwrite=overwrite)
        if name in self._items and not overwrite and self._items[name] is not obj:
            raise RegistryError(f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it")
        self._items[name] = obj
        return obj

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded or not self.entry_point_group:
            return
        self._entry_points_loaded = True
        for ep in importlib.metadata.entry_points(group=self.entry_point_group):
            if ep.name in self._items:
                continue
            try:
                self._items[ep.name] = ep.load()
            except Exception as e:  # one broken plugin must not hide the others
                self.failed[ep.name] = f"{type(e).__name__}: {e}"[:500]
                log.warning("%s plugin %r (entry point %s = %s) failed to load, skipped: %s", self.kind, ep.name,
                            self.entry_point_group, ep.value, self.failed[ep.name])

    def get(self, name: str) -> T:
        if name not in self._items:
            self._load_entry_points()
        if name not in self._items and name not in self.failed:
            self._resolve_family(name)
        if name in self.failed:
            raise RegistryError(f"{self.kind} {name!r} (entry point group {self.entry_point_group}) failed to "
                                f"load: {self.failed[name]}")
        if name not in self._items:
            known = ", ".join(sorted(self._items)) or "none"
            raise RegistryError(f"unknown {self.kind} {name!r}; known: {known}")
        return self._items[name]

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted({*self._items, *(n for _, names in self._families for n in names())})

    def __contains__(self, name: str) -> bool:
        self._load_entry_points()
        return name in self._items or self._resolve_family(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def items(self) -> list[tuple[str, T]]:
        return [(n, self.get(n)) for n in self.names()]


Factory = Callable[..., T]

_ALL: weakref.WeakSet[Registry] = weakref.WeakSet()  # every registry alive


def plugin_failures() -> dict[str, int]:
    """Plugins that failed to load so far, per entry-point group (only groups with failures)."""
    out: dict[str, int] = {}
    for reg in _ALL:
        if reg.failed:
            out[reg.entry_point_group] = out.get(reg.entry_point_group, 0) + len(reg.failed)
    return out
