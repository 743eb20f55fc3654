"""Recorded MoE routes on the wire and in a trajectory: each token's experts per MoE layer, int16 [T, L_moe, k] with
-1 where not recorded (`megatron_rl.models.routing_replay` records and replays them).

    wire = encode_routes(routes)          # server: {"dtype", "shape", "data"} in a /v1/completions choice
    routes = decode_routes(wire)          # worker: back to int16, ValueError naming what is malformed
    row = context_routes(seen, routes, tokens)   # the trajectory's routes when that request ran exactly its tokens

Numpy only: a rollout worker decodes and stores routes without importing torch or Megatron-Core.
"""
from __future__ import annotations

import base64

import numpy as np


def encode_routes(routes: np.ndarray) -> dict:
    """int [T, L_moe, k] (-1 = not recorded) -> {"dtype", "shape", "data": base64 little-endian bytes}: uint8 when
    every id fits (255 = not recorded), else uint16 (65535), as the shards store them."""
    a = np.asarray(routes)
    dtype = np.dtype("<u1") if a.max(initial=0) < 255 else np.dtype("<u2")
    stored = np.where(a < 0, np.iinfo(dtype).max, a).astype(dtype)
    return {"dtype": dtype.name, "shape": list(a.shape), "data": base64.b64encode(stored.tobytes()).decode("ascii")}


def decode_routes(obj) -> np.ndarray:
    """`encode_routes`' dict -> int16 [T, L_moe, k] with -1 where not recorded; ValueError naming what is wrong."""
    try:
        dtype, shape = np.dtype(obj["dtype"]).newbyteorder("<"), tuple(int(x) for x in obj["shape"])
        if dtype.name not in ("uint8", "uint16") or len(shape) != 3:
            raise ValueError(f"dtype {dtype.name} shape {list(shape)} (need uint8/uint16 and [tokens, layers, k])")
        raw = np.frombuffer(base64.b64decode(obj["data"], validate=True), dtype=dtype).reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed routed_experts ({type(e).__name__}: {e}); need {{dtype: uint8|uint16, "
                         f"shape: [tokens, MoE layers, topk], data: base64}}") from None
    out = raw.astype(np.int16)
    out[raw == np.iinfo(dtype).max] = -1
    return out


def context_routes(seen, routes: np.ndarray | None, tokens) -> np.ndarray | None:
    """int16 [L, L_moe, k] experts of a trajectory's `tokens` (the last, never run, -1) when an engine request ran
    exactly these tokens (`seen`, its context plus completion; `routes` [len(seen) - 1, L_moe, k]); None when
    not recorded or the engine saw another context (e.g. compressed, or an earlier turn)."""
    n = len(tokens) - 1  # tokens the trainer runs (inputs)
    if routes is None or seen is None or len(routes) < n or list(seen[:n]) != list(tokens[:n]):
        return None
    return np.concatenate([np.asarray(routes[:n], np.int16), np.full((1, *routes.shape[1:]), -1, np.int16)])
