"""Megatron-Core's import without TorchDynamo: `torch.compile` decorations made while `megatron.core` is
imported are deferred to the decorated function's first call.

Megatron decorates its fused element-wise functions with `megatron.core.jit.jit_fuser` (`torch.compile` on
torch >= 2.2) at import time. `torch.compile(fn)` compiles nothing until the first call, but building its wrapper
imports TorchDynamo and Inductor (1.1-2.6 s of CPU measured in every process that imports Megatron: each rank and
converter), although most runs never call those functions. While `megatron.core` is being imported,
`torch.compile(fn)` (a plain function, any options) returns a wrapper that calls the real `torch.compile(fn, ...)`
on its first call and the compiled function from then on, exactly what `torch.compile` would have run; any other
use (a module, no function) goes to the real one. `torch.compile` itself is restored when the import ends.

`install()` (called by `megatron_rl/__init__.py`, so by every process that imports this package before Megatron)
adds a one-shot finder to `sys.meta_path`; a process that imported Megatron first keeps Megatron's own behaviour.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading


def deferred(real_compile):
    """A `torch.compile` look-alike that defers compiling plain functions to their first call."""

    def compile_later(model=None, **options):
        if model is None:  # used as @torch.compile(...): the decorator
            return lambda fn: compile_later(fn, **options)
        if not inspect.isfunction(model):
            return real_compile(model, **options)
        compiled, lock = [], threading.Lock()

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            if not compiled:
                with lock:
                    if not compiled:
                        compiled.append(real_compile(model, **options))
            return compiled[0](*args, **kwargs)

        return first_call_compiles

    return compile_later


class _MegatronImport(importlib.abc.MetaPathFinder):
    """Finds `megatron.core` once (with the normal path finder) and runs its import with `torch.compile`
    deferred."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core":
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_with_deferred_compile(module):
            import torch

            real = torch.compile
            torch.compile = deferred(real)
            try:
                exec_module(module)
            finally:
                torch.compile = real

        spec.loader.exec_module = exec_with_deferred_compile
        return spec


_FINDER = _MegatronImport()


def install() -> None:
    """Defer `torch.compile` during the coming import of `megatron.core` (no-op if it is imported already)."""
    if "megatron.core" not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
