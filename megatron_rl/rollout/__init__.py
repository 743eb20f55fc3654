"""Rollout engine: generation from the trainer's own Megatron model with a paged KV cache, continuous
batching, weight updates and an OpenAI-compatible HTTP API (see engine.py, server.py).

The names below load on first use (PEP 562): the package is also the parent of `rollout.client`, which a rollout
worker imports to call the engine over HTTP, and a worker has no use for torch (importing it is ~3 CPU-s of each
worker's start-up)."""
from __future__ import annotations

import importlib

_HOME = {"CompressionConfig": "compression", "CompressionRecord": "compression", "EngineConfig": "engine",
         "RequestOutput": "engine", "RolloutEngine": "engine", "SampleOutput": "engine", "SamplingParams": "sampling"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'megatron_rl.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megatron_rl.rollout.{_HOME[name]}"), name)
