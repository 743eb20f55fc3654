"""HDF5 trajectory shards: the hand-off between rollout workers and the trainer (DESIGN.md section 3).

One shard is one HDF5 file holding N trajectories (samples) in a CSR layout:

  tokens          int32   [T]     all samples' tokens back to back (1-D, chunked, compressed)
  logprobs        float32 [T]     behaviour-policy log-probs; 0 for prompt/env tokens
  loss_mask       uint8   [T]     1 = model token (trained on), 0 = prompt/environment token
  token_versions  int32   [T]     optional; policy version of each token, -1 = not recorded for that sample
  offsets         int64   [N+1]   sample i is tokens[offsets[i]:offsets[i+1]]; written LAST
  routed_experts  uint8/uint16 [T, L_moe, k]  optional (MoE routing replay): the experts each MoE layer of the
                                  rollout engine chose for the token (gzip; the dtype's maximum, attribute
                                  `missing`, = not recorded; read back as int16 with -1 there)
  prompt_len, group_id, policy_version_first, policy_version_last   int64 [N]
  reward                      float64 [N]  total reward
  reward_components/<name>    float64 [N]  one dataset per component name in the union over the shard's samples;
                                           NaN = the sample did not report that component (read back as absent)
  timing/<name>               float64 [N]  seconds; same NaN rule as reward components
  env, task_id, episode_id, status, provenance (JSON object)   variable-length UTF-8 strings [N]

Root attributes: schema = "megatron-rl/trajectory", schema_version (integer, bumped only for incompatible
changes; additive changes keep it and readers ignore unknown datasets), created (ISO-8601 UTC),
created_unix, writer_host, writer_pid, num_samples, num_tokens, min/max_policy_version (-1 when empty),
compression, chunk_elems.

(The issue text asked for `reward/<component>`; HDF5 cannot hold a dataset `reward` and a group `reward`
side by side, so components live under `reward_components/`.)

Publishing is atomic: the writer fills `<name>.tmp` in the same directory, flushes and closes it, fsyncs it,
`os.replace`s it onto `<name>` and fsyncs the directory, so a reader never sees a half-written shard under
its final name (measured 8/8 clean under SIGKILL, shared/notes/sandbox-and-shards.md).

Per-token chunks are compressed and decompressed on a thread pool by data/chunk_io.py (HDF5 direct chunk
I/O, the file format unchanged); the Blosc shuffle of each per-token dataset is in SHUFFLE.

H5_LOCKING: HDF5's own file locks are off (`locking=False`) for both the writer's private temp file and the
readers. A published shard is never written again, so the lock protects nothing, while it breaks readers on
file systems without flock (some Lustre/NFS mounts) and fails readers with EAGAIN when a child process forked
by another thread (a sandbox spawn) briefly holds the writer's descriptor (seen in CI on the async loop).
"""
from __future__ import annotations

import fcntl
import itertools
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import hdf5plugin  # noqa: F401  (registers the blosc filter; readers need it to decompress)
import numpy as np

from megatron_rl.config import ConfigError
from megatron_rl.data.chunk_io import ChunkReader, ChunkWriter, codec_threads

logger = logging.getLogger(__name__)

SCHEMA = "megatron-rl/trajectory"
SCHEMA_VERSION = 1
KNOWN_SCHEMA_VERSIONS = (1,)
"""Schema versions this reader understands (an integer attribute; anything else is refused)."""
MAX_TOKEN_ID = (1 << 24) - 1
"""Largest token id accepted when the vocabulary is not known (no tokenizer has 16.7M entries); readers given
`vocab_size` refuse ids >= vocab_size."""
MAX_POLICY_VERSION = (1 << 24) - 1
"""Largest policy version accepted when the current version is not known (a version is an optimizer step: 16.7M
of them is beyond any run, and far from overflowing `current - version` arithmetic)."""
REWARD_LIMIT = 1e6
"""Largest |reward| (and |reward component|) accepted: finite is not enough, 1e300 would swamp a batch."""
LOGPROB_SLACK = 1e-4
"""Log-probs above this are impossible (log of a probability <= 1; float rounding stays below it)."""
TIMING_LIMIT = 1e9
"""Largest timing accepted (seconds; NaN = absent)."""
STATUSES = ("ok", "truncated", "sandbox_error", "timeout", "error")
COMPRESSIONS = ("blosc-lz4", "none")
TMP_SUFFIX = ".tmp"
MIN_CHUNK_ELEMS = 4096
SHARD_SUFFIXES = (".h5", ".hdf5")
RAGGED = ("tokens", "logprobs", "loss_mask")
RAGGED_DTYPES = (np.int32, np.float32, np.uint8)
INT_COLUMNS = ("prompt_len", "group_id", "policy_version_first", "policy_version_last")
STR_COLUMNS = ("env", "task_id", "episode_id", "status", "provenance")
_I32 = np.iinfo(np.int32)
ROUTE_MAX = 32767
"""Largest expert id routed_experts holds (int16 in memory; uint16 on disk with 65535 = not recorded)."""
SEGMENT_MARK = "~seg"
"""An episode published as several rows (a black-box agent's episode split where it edited its history:
`envs.agents`): its earlier exact segments are `<episode_id>~seg<j>`, its last is `<episode_id>`; the trainer
scores them as one sample (`episode_of`)."""


def segment_id(episode_id: str, j: int) -> str:
    """The row id of segment j (0 = the first) of a split episode whose last row is `episode_id`."""
    return f"{episode_id}{SEGMENT_MARK}{j}"


def episode_of(row_id: str) -> str:
    """The episode a row belongs to: its own id, or the episode of a segment row."""
    return str(row_id).split(SEGMENT_MARK, 1)[0]


def segment_rows(main: Trajectory, segments: list[dict]) -> list[Trajectory]:
    """The rows of the earlier `segments` of a split episode whose last row is `main` (each {tokens, logprobs,
    loss_mask, versions, prompt_len}: `envs.episode.EpisodeResult.segments`), with its reward, group, task and
    status, ids `segment_id(main.episode_id, j)`."""
    out = []
    for j, seg in enumerate(segments):
        versions, mask = list(seg["versions"]), list(seg["loss_mask"])
        model = [v for v, m in zip(versions, mask) if m] or versions or [0]
        out.append(Trajectory(
            tokens=np.asarray(seg["tokens"], np.int32), logprobs=np.asarray(seg["logprobs"], np.float32),
            loss_mask=np.asarray(mask, np.uint8), prompt_len=int(seg["prompt_len"]), reward=main.reward,
            group_id=main.group_id, policy_version_first=min(model), policy_version_last=max(model), env=main.env,
            task_id=main.task_id, episode_id=segment_id(main.episode_id, j), status=main.status,
            reward_components=dict(main.reward_components), token_versions=np.asarray(versions, np.int32),
            provenance={"segment_of": main.episode_id, "segment": str(j)}))
    return out


class TrajectoryError(ValueError):
    """A trajectory that breaks the shard contract (wrong length, dtype, status...)."""


class ShardError(RuntimeError):
    """A shard that cannot be read: unopenable, truncated, inconsistent, or of another schema."""


class ShardSchemaError(ShardError):
    """A shard written by another schema or by a newer, incompatible schema version."""


# --------------------------------------------------------------------------------------------- trajectory


def _int_array(name: str, value, ident: str, kinds: str = "iu") -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise TrajectoryError(f"trajectory {ident}: {name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in kinds:
        raise TrajectoryError(f"trajectory {ident}: {name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < _I32.min or arr.max() > _I32.max):
        raise TrajectoryError(f"trajectory {ident}: {name} has values outside the int32 range")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _float_array(name: str, value, ident: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise TrajectoryError(f"trajectory {ident}: {name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "fiu":
        raise TrajectoryError(f"trajectory {ident}: {name} must hold floats, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _mask_array(value, ident: str) -> np.ndarray:
    arr = _int_array("loss_mask", value, ident, kinds="iub")
    if arr.size and (arr.min() < 0 or arr.max() > 1):
        raise TrajectoryError(f"trajectory {ident}: loss_mask must be 0/1 (1 = model token), got other values")
    return arr.astype(np.uint8)


def _routes_array(value, n: int, ident: str) -> np.ndarray:
    a = np.asarray(value)
    if a.ndim != 3 or a.shape[0] != n or a.dtype.kind not in "iu" or (a.size and (a.min() < -1 or a.max() > ROUTE_MAX)):
        raise TrajectoryError(f"trajectory {ident}: routed_experts must be integer [{n} tokens, MoE layers, topk] "
                              f"with expert ids in [0, {ROUTE_MAX}] (-1 = not recorded), got {a.dtype}{list(a.shape)}")
    return a.astype(np.int16, copy=False)


def _check_names(kind: str, names: Iterable[str], ident: str) -> None:
    for name in names:
        if not isinstance(name, str) or not name or "/" in name or name == ".":
            raise TrajectoryError(f"trajectory {ident}: {kind} name {name!r} must be a non-empty str without '/'")


def _float_dict(kind: str, value: dict, ident: str, limit: float) -> dict[str, float]:
    if not isinstance(value, dict):
        raise TrajectoryError(f"trajectory {ident}: {kind}s must be a dict name -> float, got {type(value).__name__}")
    _check_names(kind, value, ident)
    out = {k: float(v) for k, v in value.items()}
    bad = [k for k, v in out.items() if not math.isfinite(v) or abs(v) > limit]
    if bad:
        raise TrajectoryError(f"trajectory {ident}: {kind} {bad} not finite or beyond +-{limit:g} (NaN marks "
                              f"'absent' in a shard)")
    return out


@dataclass(eq=False)
class Trajectory:
    """One sample: a whole (possibly multi-turn) episode as one token sequence, with its reward and metadata."""

    tokens: np.ndarray
    """int32 [L]: token ids, prompt first, then model and environment tokens interleaved."""
    logprobs: np.ndarray
    """float32 [L]: behaviour-policy log-prob of each token; 0 for prompt/environment tokens."""
    loss_mask: np.ndarray
    """uint8 [L]: 1 for model-generated tokens (trained on), 0 for prompt/environment tokens."""
    prompt_len: int
    """Number of leading prompt tokens (0 <= prompt_len <= L)."""
    reward: float
    """Total (weighted) reward of the episode; finite."""
    group_id: int
    """Group for group-normalised advantages (all samples of one prompt share it)."""
    policy_version_first: int
    """Policy version that generated the first model token (>= 0)."""
    policy_version_last: int
    """Policy version that generated the last model token (>= policy_version_first)."""
    env: str
    """Environment name (registry key)."""
    task_id: str
    """Task identifier inside the environment's suite."""
    episode_id: str
    """Globally unique episode id; the trainer drops a second sample with the same id (exactly-once)."""
    status: str = "ok"
    """Outcome: one of STATUSES (ok, truncated, sandbox_error, timeout, error)."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """Named reward components (name -> finite value) before weighting."""
    token_versions: np.ndarray | None = None
    """Optional int32 [L]: policy version per token, for partial rollouts across weight updates."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent per phase, e.g. generate / env / reward / total."""
    provenance: dict[str, str] = field(default_factory=dict)
    """Where the reward came from: judge model/version, verifier version, ..."""
    routed_experts: np.ndarray | None = None
    """Optional int16 [L, L_moe, k]: the rollout engine's experts per token and MoE layer (routing replay),
    -1 where not recorded (the last token, which is sampled and never run)."""

    def __post_init__(self) -> None:
        self._check_strings()
        self._check_arrays()
        self._check_scalars()
        self.reward_components = _float_dict("reward component", self.reward_components, self._ident, REWARD_LIMIT)
        self.timings = _float_dict("timing", self.timings, self._ident, TIMING_LIMIT)
        if not isinstance(self.provenance, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.provenance.items()):
            raise TrajectoryError(f"trajectory {self._ident}: provenance must map str -> str")

    @property
    def _ident(self) -> str:
        return repr(self.episode_id)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def _check_strings(self) -> None:
        for name in ("env", "task_id", "episode_id", "status"):
            if not isinstance(getattr(self, name), str):
                raise TrajectoryError(f"trajectory {self.episode_id!r}: {name} must be a str")
        if not self.episode_id:
            raise TrajectoryError("trajectory: episode_id must be a non-empty unique string")
        if self.status not in STATUSES:
            raise TrajectoryError(f"trajectory {self._ident}: status {self.status!r} not one of {STATUSES}")

    def _check_arrays(self) -> None:
        self.tokens = _int_array("tokens", self.tokens, self._ident)
        if self.tokens.size and (self.tokens.min() < 0 or self.tokens.max() > MAX_TOKEN_ID):
            raise TrajectoryError(f"trajectory {self._ident}: tokens must be ids in [0, {MAX_TOKEN_ID}]")
        self.logprobs = _float_array("logprobs", self.logprobs, self._ident)
        if self.logprobs.size and not (np.isfinite(self.logprobs).all() and self.logprobs.max() <= LOGPROB_SLACK):
            raise TrajectoryError(f"trajectory {self._ident}: logprobs must be finite and <= 0")
        self.loss_mask = _mask_array(self.loss_mask, self._ident)
        if self.token_versions is not None:
            self.token_versions = _int_array("token_versions", self.token_versions, self._ident)
            if self.token_versions.size and self.token_versions.min() < 0:
                raise TrajectoryError(f"trajectory {self._ident}: token_versions must be >= 0")
        lengths = {"tokens": len(self.tokens), "logprobs": len(self.logprobs), "loss_mask": len(self.loss_mask)}
        if self.token_versions is not None:
            lengths["token_versions"] = len(self.token_versions)
        if len(set(lengths.values())) != 1:
            raise TrajectoryError(f"trajectory {self._ident}: per-token arrays differ in length: {lengths}")
        if self.routed_experts is not None:
            self.routed_experts = _routes_array(self.routed_experts, len(self.tokens), self._ident)

    def _check_scalars(self) -> None:
        for name in ("prompt_len", "group_id", "policy_version_first", "policy_version_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TrajectoryError(f"trajectory {self._ident}: {name} must be an int, got {value!r}")
            setattr(self, name, int(value))
        if not 0 <= self.prompt_len <= len(self.tokens):
            raise TrajectoryError(f"trajectory {self._ident}: prompt_len {self.prompt_len} not in [0, {len(self)}]")
        if not 0 <= self.policy_version_first <= self.policy_version_last:
            raise TrajectoryError(f"trajectory {self._ident}: need 0 <= policy_version_first <= policy_version_last,"
                                  f" got {self.policy_version_first}, {self.policy_version_last}")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float, np.number)):
            raise TrajectoryError(f"trajectory {self._ident}: reward must be a number, got {self.reward!r}")
        self.reward = float(self.reward)
        if not math.isfinite(self.reward) or abs(self.reward) > REWARD_LIMIT:
            raise TrajectoryError(f"trajectory {self._ident}: reward {self.reward} is not finite or beyond "
                                  f"+-{REWARD_LIMIT:g}")
        if self.policy_version_last > MAX_POLICY_VERSION:
            raise TrajectoryError(f"trajectory {self._ident}: policy_version_last {self.policy_version_last} > "
                                  f"{MAX_POLICY_VERSION}")


# ------------------------------------------------------------------------------------------------ columns


@dataclass(eq=False)
class TrajectoryColumns:
    """Columnar (CSR) view of many trajectories: what the trainer consumes without per-sample objects."""

    tokens: np.ndarray
    """int32 [T]: all tokens back to back."""
    logprobs: np.ndarray
    """float32 [T]: behaviour log-probs."""
    loss_mask: np.ndarray
    """uint8 [T]: 1 = model token."""
    offsets: np.ndarray
    """int64 [N+1]: sample i spans offsets[i]:offsets[i+1]."""
    token_versions: np.ndarray | None
    """int32 [T] or None: per-token policy versions, -1 where a sample recorded none."""
    prompt_len: np.ndarray
    """int64 [N]."""
    reward: np.ndarray
    """float64 [N]: total reward."""
    group_id: np.ndarray
    """int64 [N]."""
    policy_version_first: np.ndarray
    """int64 [N]."""
    policy_version_last: np.ndarray
    """int64 [N]."""
    env: np.ndarray
    """object [N] of str."""
    task_id: np.ndarray
    """object [N] of str."""
    episode_id: np.ndarray
    """object [N] of str."""
    status: np.ndarray
    """object [N] of str."""
    provenance: np.ndarray
    """object [N] of JSON strings (parsed only when a Trajectory is built)."""
    reward_components: dict[str, np.ndarray] = field(default_factory=dict)
    """name -> float64 [N]; NaN = sample did not report that component."""
    timings: dict[str, np.ndarray] = field(default_factory=dict)
    """name -> float64 [N] seconds; NaN = not reported."""
    routed_experts: np.ndarray | None = None
    """int16 [T, L_moe, k] or None: the rollout engine's experts per token (routing replay), -1 = not recorded."""

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def episode_index(self) -> np.ndarray:
        """int64 [N]: the episode of each row, numbered 0.. in order of first appearance; the rows of a split
        episode (`SEGMENT_MARK`) share one."""
        keys: dict[str, int] = {}
        return np.asarray([keys.setdefault(episode_of(e), len(keys)) for e in self.episode_id], np.int64)

    def select(self, index) -> TrajectoryColumns:
        """Samples picked by a boolean mask [N] or an index array, in that order (self if all, in order)."""
        idx = np.asarray(index)
        idx = np.flatnonzero(idx) if idx.dtype == bool else idx.astype(np.int64)
        if len(idx) == len(self) and np.array_equal(idx, np.arange(len(self))):
            return self
        lengths = self.lengths[idx]                                     # [n]
        offsets = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.arange(offsets[-1], dtype=np.int64) + np.repeat(self.offsets[idx] - offsets[:-1], lengths)
        per_token = {k: getattr(self, k)[gather] for k in RAGGED}        # each [T']
        tv = None if self.token_versions is None else self.token_versions[gather]
        routes = None if self.routed_experts is None else self.routed_experts[gather]
        per_sample = {k: getattr(self, k)[idx] for k in INT_COLUMNS + STR_COLUMNS + ("reward",)}
        return TrajectoryColumns(
            **per_token, offsets=offsets, token_versions=tv, **per_sample,
            reward_components={k: v[idx] for k, v in self.reward_components.items()},
            timings={k: v[idx] for k, v in self.timings.items()}, routed_experts=routes)

    def trajectory(self, i: int) -> Trajectory:
        """Sample i as a Trajectory (token arrays are views into the columns)."""
        s, e = int(self.offsets[i]), int(self.offsets[i + 1])
        tv = None  # -1 throughout (or an empty sample) = no per-token versions recorded
        if self.token_versions is not None and e > s and not np.all(self.token_versions[s:e] == -1):
            tv = self.token_versions[s:e]
        routes = None  # -1 throughout = not recorded for this sample
        if self.routed_experts is not None and e > s and not np.all(self.routed_experts[s:e] == -1):
            routes = self.routed_experts[s:e]
        return Trajectory(
            tokens=self.tokens[s:e], logprobs=self.logprobs[s:e], loss_mask=self.loss_mask[s:e],
            prompt_len=int(self.prompt_len[i]), reward=float(self.reward[i]), group_id=int(self.group_id[i]),
            policy_version_first=int(self.policy_version_first[i]),
            policy_version_last=int(self.policy_version_last[i]),
            env=str(self.env[i]), task_id=str(self.task_id[i]), episode_id=str(self.episode_id[i]),
            status=str(self.status[i]), token_versions=tv,
            reward_components=_present(self.reward_components, i), timings=_present(self.timings, i),
            provenance=json.loads(self.provenance[i]), routed_experts=routes)

    def to_trajectories(self) -> list[Trajectory]:
        return [self.trajectory(i) for i in range(len(self))]

    @classmethod
    def from_trajectories(cls, trajs: Sequence[Trajectory]) -> TrajectoryColumns:
        """Columns of `trajs` (copies their token arrays into one CSR)."""
        trajs = list(trajs)
        meta = _rows_to_block([_meta_row(t) for t in trajs])
        offsets = np.zeros(len(trajs) + 1, np.int64)
        np.cumsum(meta.pop("length"), out=offsets[1:])
        ragged = {k: np.concatenate([getattr(t, k) for t in trajs] or [np.zeros(0, dt)]).astype(dt, copy=False)
                  for k, dt in zip(RAGGED, RAGGED_DTYPES)}
        tv = None
        if any(t.token_versions is not None for t in trajs):
            tv = np.concatenate([_versions_or_fill(t) for t in trajs])
        return cls(**ragged, offsets=offsets, token_versions=tv, **meta, routed_experts=_concat_routes(trajs))

    def validate(self, vocab_size: int | None = None, max_version: int | None = None) -> None:
        """Vectorised check of the shard contract (what Trajectory checks one sample at a time): structure, dtypes
        and values. Token ids must be < `vocab_size` (else <= MAX_TOKEN_ID), policy versions <= `max_version`
        (else <= MAX_POLICY_VERSION). Raises TrajectoryError naming the field."""
        _check_csr(self)
        _check_per_sample(self)
        for kind, group, limit in (("reward component", self.reward_components, REWARD_LIMIT),
                                   ("timing", self.timings, TIMING_LIMIT)):
            _check_names(kind, group, "columns")
            bad = [k for k, v in group.items() if v.shape != (len(self),) or np.asarray(v).dtype.kind != "f"
                   or np.any(np.abs(v[~np.isnan(v)]) > limit)]
            if bad:
                raise TrajectoryError(f"columns: {kind}s {bad} need float shape [{len(self)}], values within "
                                      f"+-{limit:g} (NaN = absent)")
        _check_values(self, vocab_size, max_version)


def _concat_routes(trajs: Sequence[Trajectory]) -> np.ndarray | None:
    """int16 [T, L_moe, k] routes of `trajs` back to back (-1 for samples without), None if none has any."""
    shapes = {t.routed_experts.shape[1:] for t in trajs if t.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise TrajectoryError(f"trajectories disagree on routed_experts [MoE layers, topk]: {sorted(shapes)}")
    shape = shapes.pop()
    return np.concatenate([t.routed_experts if t.routed_experts is not None else
                           np.full((len(t), *shape), -1, np.int16) for t in trajs])


def _present(columns: dict[str, np.ndarray], i: int) -> dict[str, float]:
    return {k: float(v[i]) for k, v in columns.items() if not np.isnan(v[i])}


def _versions_or_fill(t: Trajectory) -> np.ndarray:
    return t.token_versions if t.token_versions is not None else np.full(len(t), -1, np.int32)


def _check_csr(c: TrajectoryColumns) -> None:
    o, t = np.asarray(c.offsets), len(c.tokens)
    if o.ndim != 1 or o.dtype.kind not in "iu" or len(o) < 1 or o[0] != 0 or o[-1] != t or np.any(np.diff(o) < 0):
        raise TrajectoryError(f"columns: offsets must be int [N+1], start at 0, non-decreasing, end at {t} tokens")
    arrays = {k: getattr(c, k) for k in RAGGED + ("token_versions",) if getattr(c, k) is not None}
    dtypes = dict(zip(RAGGED + ("token_versions",), RAGGED_DTYPES + (np.int32,)))
    bad = [f"{k} {a.dtype}[{len(a)}]" for k, a in arrays.items() if a.ndim != 1 or len(a) != t or a.dtype != dtypes[k]]
    if bad:
        raise TrajectoryError(f"columns: per-token arrays must be tokens int32, logprobs float32, loss_mask uint8,"
                              f" token_versions int32, all [{t}]; got {bad}")
    if t and c.loss_mask.max() > 1:
        raise TrajectoryError("columns: loss_mask must be 0/1 (1 = model token)")
    if c.token_versions is not None and t and c.token_versions.min() < -1:
        raise TrajectoryError("columns: token_versions must be >= 0 (-1 = not recorded)")
    if c.routed_experts is not None:
        _routes_array(c.routed_experts, t, "columns")


def _check_per_sample(c: TrajectoryColumns) -> None:
    n = len(c)
    bad = [k for k in INT_COLUMNS + ("reward",) + STR_COLUMNS if np.shape(getattr(c, k)) != (n,)]
    if bad:
        raise TrajectoryError(f"columns: per-sample columns {bad} must have shape [{n}]")
    dtypes = {k: np.asarray(getattr(c, k)).dtype for k in INT_COLUMNS + ("reward",)}
    bad = [f"{k} {dt}" for k, dt in dtypes.items() if dt.kind not in ("f" if k == "reward" else "iu")]
    if bad:
        raise TrajectoryError(f"columns: {bad}: {', '.join(INT_COLUMNS)} must be integers, reward a float")
    bad = [k for k in STR_COLUMNS if not all(isinstance(x, str) for x in getattr(c, k).tolist())]
    if bad:
        raise TrajectoryError(f"columns: {bad} must hold strings")
    if np.any(c.prompt_len < 0) or np.any(c.prompt_len > c.lengths):
        raise TrajectoryError("columns: prompt_len must be in [0, sample length]")
    if np.any(c.policy_version_first < 0) or np.any(c.policy_version_first > c.policy_version_last):
        raise TrajectoryError("columns: need 0 <= policy_version_first <= policy_version_last")
    if not np.all(np.isfinite(c.reward)):
        raise TrajectoryError("columns: reward must be finite")
    unknown = set(c.status.tolist()) - set(STATUSES)
    if unknown:
        raise TrajectoryError(f"columns: status values {sorted(unknown)} not in {STATUSES}")
    if not all(isinstance(e, str) and e for e in c.episode_id.tolist()):
        raise TrajectoryError("columns: episode_id must be non-empty strings")


def _check_values(c: TrajectoryColumns, vocab_size: int | None, max_version: int | None) -> None:
    """Value ranges no sample may leave (a reader refuses them: never a silently wrong sample)."""
    top = MAX_TOKEN_ID if vocab_size is None else int(vocab_size) - 1
    if len(c.tokens) and (c.tokens.min() < 0 or c.tokens.max() > top):
        raise TrajectoryError(f"columns: tokens must be ids in [0, {top}]"
                              f"{'' if vocab_size is None else f' (vocabulary of {vocab_size})'}, got "
                              f"[{c.tokens.min()}, {c.tokens.max()}]")
    if len(c.logprobs) and not (np.isfinite(c.logprobs).all() and c.logprobs.max() <= LOGPROB_SLACK):
        raise TrajectoryError("columns: logprobs must be finite and <= 0 (log of a probability)")
    if len(c) and np.abs(c.reward).max() > REWARD_LIMIT:
        raise TrajectoryError(f"columns: reward beyond +-{REWARD_LIMIT:g}: {np.abs(c.reward).max():g}")
    vmax = MAX_POLICY_VERSION if max_version is None else int(max_version)
    for name in ("policy_version_last", "token_versions"):
        a = getattr(c, name)
        if a is not None and len(a) and int(a.max()) > vmax:
            raise TrajectoryError(f"columns: {name} {int(a.max())} above {vmax} (the current policy version)"
                                  if max_version is not None else f"columns: {name} {int(a.max())} above {vmax}")
    for i, text in enumerate(c.provenance.tolist()):
        try:
            prov = json.loads(text)
        except (TypeError, ValueError):
            prov = None
        if not isinstance(prov, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prov.items()):
            raise TrajectoryError(f"columns: provenance of sample {i} is not a JSON object of strings")


# ------------------------------------------------------------------------------------------------- writer


@dataclass
class ShardWriterConfig:
    """How shards are written; `build(path)` opens a ShardWriter."""

    compression: str = "blosc-lz4"
    """'blosc-lz4' (hdf5plugin Blosc with lz4, shuffle per dataset: SHUFFLE) or 'none'."""
    chunk_elems: int = 262144
    """Elements per HDF5 chunk of the per-token datasets (256 Ki measured best here; a shard smaller than one
    chunk gets a single chunk of its own size, rounded up to MIN_CHUNK_ELEMS)."""
    clevel: int = 5
    """Blosc compression level 1-9 (lz4 speed hardly depends on it; 5 is the Blosc default)."""
    buffer_elems: int = 4 * 1024 * 1024
    """Tokens buffered in memory before they are appended to the file (rounded to whole chunks)."""
    threads: int = 0
    """Threads compressing chunks (data/chunk_io.py); 0 = one per usable core, at most 4."""

    def validate(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ConfigError(f"shard compression {self.compression!r} unknown; use one of {COMPRESSIONS}")
        if self.chunk_elems < 1 or self.buffer_elems < 1:
            raise ConfigError("shard chunk_elems and buffer_elems must be >= 1")
        if self.threads < 0:
            raise ConfigError(f"shard writer threads {self.threads} must be >= 0 (0 = one per core, at most 4)")
        if not 1 <= self.clevel <= 9:
            raise ConfigError(f"shard clevel {self.clevel} must be in 1..9")

    def build(self, path: str | os.PathLike) -> ShardWriter:
        return ShardWriter(path, self.compression, self.chunk_elems, clevel=self.clevel,
                           buffer_elems=self.buffer_elems, threads=self.threads)


SHUFFLE = {"tokens": hdf5plugin.Blosc.BITSHUFFLE, "token_versions": hdf5plugin.Blosc.BITSHUFFLE,
           "logprobs": hdf5plugin.Blosc.NOSHUFFLE, "loss_mask": hdf5plugin.Blosc.NOSHUFFLE}
"""Blosc shuffle per per-token dataset, measured on 160 MB of benchmark samples (one core, lz4, 256 Ki chunks):
token ids bit-shuffled compress 1.8x faster and 10% smaller than byte-shuffled (3.6 vs 2.0 GB/s, 0.565 vs
0.630 of raw); float32 log-probs unshuffled compress 2x and decompress 2.7x faster than byte-shuffled for 12%
more bytes (0.705 vs 0.632); a 0/1 mask compresses to 1% either way."""


def _filter_kwargs(name: str, compression: str, clevel: int) -> dict:
    if compression == "none":
        return {}
    return dict(hdf5plugin.Blosc(cname="lz4", clevel=clevel, shuffle=SHUFFLE[name]))


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _meta_row(t: Trajectory) -> tuple:
    """The per-sample (non-token) fields of one trajectory, kept by the writer until close."""
    provenance = json.dumps(t.provenance, sort_keys=True) if t.provenance else "{}"
    return (len(t), t.prompt_len, t.group_id, t.policy_version_first, t.policy_version_last, t.reward, t.env,
            t.task_id, t.episode_id, t.status, provenance, t.reward_components, t.timings)


_ROW_FIELDS = ("length",) + INT_COLUMNS + ("reward", "env", "task_id", "episode_id", "status", "provenance")


def _union_columns(rows: Sequence[dict[str, float]]) -> dict[str, np.ndarray]:
    names = sorted({k for row in rows for k in row})
    return {k: np.array([row.get(k, np.nan) for row in rows], np.float64) for k in names}


def _rows_to_block(rows: list[tuple]) -> dict:
    """Rows from `_meta_row` -> per-sample column arrays (components/timings NaN where absent)."""
    cols = list(zip(*rows)) if rows else [()] * (len(_ROW_FIELDS) + 2)
    block = {name: np.array(col, dtype=np.float64 if name == "reward" else object if name in STR_COLUMNS
                            else np.int64).reshape(-1) for name, col in zip(_ROW_FIELDS, cols)}
    block["reward_components"] = _union_columns(cols[-2])
    block["timings"] = _union_columns(cols[-1])
    return block


def _concat_blocks(blocks: list[dict]) -> dict:
    """Concatenate metadata blocks; a component/timing missing from a block is NaN there."""
    out = {k: np.concatenate([b[k] for b in blocks]) for k in _ROW_FIELDS}
    for group in ("reward_components", "timings"):
        names = sorted({k for b in blocks for k in b[group]})
        out[group] = {k: np.concatenate([b[group].get(k, np.full(len(b["reward"]), np.nan)) for b in blocks])
                      for k in names}
    return out


class _SampleMeta:
    """Per-sample metadata collected until close: rows from `add`, whole blocks from `add_columns`."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self.rows: list[tuple] = []
        self.count = 0

    def add_row(self, t: Trajectory) -> None:
        self.rows.append(_meta_row(t))
        self.count += 1

    def add_block(self, c: TrajectoryColumns) -> None:
        self._seal()
        block = {k: np.asarray(getattr(c, k)) for k in _ROW_FIELDS[1:]}
        block.update(length=c.lengths, reward_components=c.reward_components, timings=c.timings)
        self.blocks.append(block)
        self.count += len(c)

    def _seal(self) -> None:
        if self.rows:
            self.blocks.append(_rows_to_block(self.rows))
            self.rows = []

    def finish(self) -> dict:
        self._seal()
        return _concat_blocks(self.blocks or [_rows_to_block([])])


class ShardWriter:
    """Writes one shard; a context manager. Nothing is visible under `path` until `close()` publishes it.

    `with ShardWriter(path) as w: w.add(traj)` (or `w.add_columns(cols)`). On an exception inside the block,
    or `abort()`, the temporary file is removed. A shard with the same final name is replaced atomically.
    Arrays passed in are referenced until written: do not modify them before `close()`.
    """

    def __init__(self, path: str | os.PathLike, compression: str = "blosc-lz4", chunk_elems: int = 262144,
                 *, clevel: int = 5, buffer_elems: int = 4 * 1024 * 1024, threads: int = 0):
        cfg = ShardWriterConfig(compression, chunk_elems, clevel, buffer_elems, threads)
        cfg.validate()
        self.path = Path(path)
        if self.path.name.endswith(TMP_SUFFIX):
            raise ValueError(f"shard path {self.path} ends in {TMP_SUFFIX!r}, reserved for unfinished shards")
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"shard folder {self.path.parent} does not exist; create it before writing")
        self.tmp_path = self.path.with_name(self.path.name + TMP_SUFFIX)
        self.config = cfg
        self._buffer_elems = max(cfg.chunk_elems, cfg.buffer_elems // cfg.chunk_elems * cfg.chunk_elems)
        self._samples = _SampleMeta()
        self._pending: dict[str, list[np.ndarray]] = {k: [] for k in RAGGED}
        self._pending_elems = 0
        self._written = 0
        self._file: h5py.File | None = h5py.File(self.tmp_path, "w", locking=False)  # private temp file
        self._kinds = {k: (dt, None) for k, dt in zip(RAGGED, RAGGED_DTYPES)}  # name -> (dtype, fill value)
        self._ragged: dict[str, h5py.Dataset] = {}  # created at the first flush, when the chunk size is known
        self._chunk: int | None = None
        self._chunks = ChunkWriter(codec_threads(cfg.threads), writeback_fd=self._file.id.get_vfd_handle())
        self._routes: list[np.ndarray | int] = []  # per add: routed_experts [n, L_moe, k], or n (none recorded)
        self._done = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __len__(self) -> int:
        return self._samples.count

    def _create_ragged(self, name: str) -> None:
        dtype, fillvalue = self._kinds[name]
        self._ragged[name] = self._file.create_dataset(
            name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(self._chunk,), fillvalue=fillvalue,
            **_filter_kwargs(name, self.config.compression, self.config.clevel))

    def _open_ragged(self, n: int, final: bool) -> None:
        """Fix the chunk size and create the per-token datasets: one chunk of the shard's own size when the
        whole shard arrives in its final flush and is smaller than `chunk_elems` (no padding of small shards)."""
        chunk = self.config.chunk_elems
        if final and n < chunk:
            chunk = max(MIN_CHUNK_ELEMS, -(-n // MIN_CHUNK_ELEMS) * MIN_CHUNK_ELEMS)
        self._chunk = min(chunk, self.config.chunk_elems)
        for name in self._kinds:
            self._create_ragged(name)

    def _check_open(self) -> None:
        if self._done:
            raise ValueError(f"shard writer for {self.path} is already closed")

    def _want_versions(self) -> None:
        """Create token_versions on first use; tokens already written stay at the fill value -1."""
        if "token_versions" not in self._kinds:
            self._kinds["token_versions"] = (np.int32, -1)
            self._pending["token_versions"] = []
            if self._chunk is not None:
                self._create_ragged("token_versions")

    def _append(self, parts: dict[str, np.ndarray], n: int) -> None:
        for name, arr in parts.items():
            self._pending[name].append(arr)
        self._pending_elems += n
        if self._pending_elems >= self._buffer_elems:
            self._flush(final=False)

    def add(self, traj: Trajectory) -> None:
        """Append one trajectory (validated at construction)."""
        self._check_open()
        if not isinstance(traj, Trajectory):
            raise TypeError(f"ShardWriter.add takes a Trajectory, got {type(traj).__name__}")
        if traj.token_versions is not None:
            self._want_versions()
        self._samples.add_row(traj)
        self._routes.append(traj.routed_experts if traj.routed_experts is not None else len(traj))
        parts = {k: getattr(traj, k) for k in RAGGED}
        if "token_versions" in self._kinds:
            parts["token_versions"] = _versions_or_fill(traj)
        self._append(parts, len(traj))

    def extend(self, trajs: Iterable[Trajectory]) -> None:
        for t in trajs:
            self.add(t)

    def add_columns(self, cols: TrajectoryColumns) -> None:
        """Append many samples at once (validated here, vectorised): the fast path for batch producers."""
        self._check_open()
        cols.validate()
        if cols.token_versions is not None:
            self._want_versions()
        self._samples.add_block(cols)
        self._routes.append(cols.routed_experts if cols.routed_experts is not None else cols.num_tokens)
        parts = {k: getattr(cols, k) for k in RAGGED}
        if "token_versions" in self._kinds:
            tv = cols.token_versions
            parts["token_versions"] = tv if tv is not None else np.full(cols.num_tokens, -1, np.int32)
        self._append(parts, cols.num_tokens)

    def _flush(self, final: bool) -> None:
        """Append pending tokens; keep a partial last chunk in memory unless `final` (no chunk rewrites)."""
        n = sum(len(a) for a in self._pending["tokens"])
        if self._chunk is None:
            self._open_ragged(n, final)
        cut = n if final else n // self._chunk * self._chunk
        jobs = []
        for name, ds in self._ragged.items():
            parts = self._pending[name]
            arr = parts[0] if len(parts) == 1 else np.concatenate(parts or [np.zeros(0, ds.dtype)])
            if len(arr) < n:  # token_versions appeared mid-shard: earlier tokens stay at the -1 fill value
                arr = np.concatenate([np.full(n - len(arr), -1, np.int32), arr])
            ds.resize((self._written + cut,))
            jobs.append((ds, self._written, arr[:cut]))
            self._pending[name] = [arr[cut:].copy()] if cut < n else []
        self._chunks.submit(jobs)
        self._written += cut
        self._pending_elems = n - cut

    def _write_samples(self, meta: dict) -> None:
        f = self._file
        for k in INT_COLUMNS:
            f.create_dataset(k, data=meta[k].astype(np.int64))
        f.create_dataset("reward", data=meta["reward"].astype(np.float64))
        for group, key in (("reward_components", "reward_components"), ("timing", "timings")):
            g = f.create_group(group)
            for name, col in meta[key].items():
                g.create_dataset(name, data=np.asarray(col, np.float64))
        for k in STR_COLUMNS:
            f.create_dataset(k, data=meta[k].astype(object), dtype=h5py.string_dtype())

    def _write_attrs(self, meta: dict, num_tokens: int) -> None:
        now = time.time()
        versions = np.concatenate([meta["policy_version_first"], meta["policy_version_last"]])
        self._file.attrs.update({
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "created_unix": now,
            "writer_host": socket.gethostname(), "writer_pid": os.getpid(),
            "num_samples": len(meta["reward"]), "num_tokens": num_tokens,
            "min_policy_version": int(versions.min()) if len(versions) else -1,
            "max_policy_version": int(versions.max()) if len(versions) else -1,
            "compression": self.config.compression, "chunk_elems": self._chunk})

    def _write_routes(self) -> None:
        """routed_experts (when any sample has them): uint8 when every id fits, else uint16; gzip."""
        shapes = {r.shape[1:] for r in self._routes if not isinstance(r, int)}
        if not shapes:
            return
        if len(shapes) > 1:
            raise TrajectoryError(f"shard {self.path}: samples disagree on routed_experts [MoE layers, topk]: "
                                  f"{sorted(shapes)}")
        shape = shapes.pop()
        routes = np.concatenate([np.full((r, *shape), -1, np.int16) if isinstance(r, int) else r
                                 for r in self._routes])  # [T, L_moe, k]
        dtype = np.uint8 if routes.max(initial=0) < 255 else np.uint16
        missing = np.iinfo(dtype).max
        stored = np.where(routes < 0, missing, routes).astype(dtype)
        ds = self._file.create_dataset("routed_experts", data=stored, compression="gzip", compression_opts=4,
                                       chunks=(max(1, min(len(stored), 65536)), *shape) if len(stored) else None)
        ds.attrs["missing"] = int(missing)

    def close(self) -> Path:
        """Write per-sample data, attributes and `offsets` (last), then publish atomically. Returns the path."""
        if self._done:
            return self.path
        try:
            self._flush(final=True)
            meta = self._samples.finish()
            offsets = np.zeros(len(meta["length"]) + 1, np.int64)
            np.cumsum(meta["length"], out=offsets[1:])
            self._write_samples(meta)  # while the chunk writer finishes the per-token chunks
            self._write_attrs(meta, int(offsets[-1]))
            self._write_routes()
            self._chunks.join()
            self._file.create_dataset("offsets", data=offsets)
            self._file.flush()
            self._file.close()
            self._file = None
            self._publish()
        except BaseException:
            self.abort()
            raise
        return self.path

    def _publish(self) -> None:
        fd = os.open(self.tmp_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(self.tmp_path, self.path)
        fsync_dir(self.path.parent)
        self._done = True

    def abort(self) -> None:
        """Drop everything written so far; nothing becomes visible."""
        self._done = True
        self._chunks.abort()  # its thread must be gone before the file closes
        if self._file is not None:
            try:
                self._file.close()
            except Exception:  # a half-broken file must not mask the original error
                logger.debug("closing aborted shard %s failed", self.tmp_path, exc_info=True)
            self._file = None
        self.tmp_path.unlink(missing_ok=True)


def write_shard(path: str | os.PathLike, trajectories: Iterable[Trajectory] | TrajectoryColumns,
                compression: str = "blosc-lz4", chunk_elems: int = 262144, **kwargs) -> Path:
    """Write trajectories (or columns) to a new shard at `path`, atomically. Returns the path."""
    with ShardWriter(path, compression, chunk_elems, **kwargs) as w:
        if isinstance(trajectories, TrajectoryColumns):
            w.add_columns(trajectories)
        else:
            w.extend(trajectories)
    return w.path


# ------------------------------------------------------------------------------------------------- reader


def _read_full(ds: h5py.Dataset) -> np.ndarray:
    """The whole dataset in native byte order (HDF5 converts: a big-endian float32 reads back as float32)."""
    out = np.empty(ds.shape, ds.dtype.newbyteorder("="))
    if out.size:
        ds.read_direct(out)
    return out


class ShardReader:
    """Opens a shard read-only and checks its schema and layout; a context manager. What it returns is checked
    as the writer checks it (`TrajectoryColumns.validate`: dtypes, finite and bounded rewards, token ids in the
    vocabulary, 0/1 loss mask, monotonic offsets, sane policy versions): a shard is written by a worker, which
    runs the policy's episodes, so its values are not trusted.

    Raises ShardSchemaError for another schema or an unknown schema version, ShardError for anything else that
    makes the shard unusable (the message names the file and the field).
    """

    REQUIRED = RAGGED + ("offsets", "reward") + INT_COLUMNS + STR_COLUMNS

    def __init__(self, path: str | os.PathLike, threads: int = 0, vocab_size: int | None = None,
                 max_version: int | None = None):
        """`vocab_size`: token ids must be below it (None: <= MAX_TOKEN_ID); `max_version`: policy versions must
        not exceed it (None: <= MAX_POLICY_VERSION)."""
        self.path = Path(path)
        self.threads = threads  # chunk decoding threads, 0 = one per usable core (at most 4)
        self.vocab_size, self.max_version = vocab_size, max_version
        try:
            self._file = h5py.File(self.path, "r", locking=False)  # published shards are immutable: see H5_LOCKING
        except OSError as e:
            raise ShardError(f"shard {self.path}: cannot open as HDF5 ({e})") from e
        try:
            self._check_schema()
            self._check_layout()
        except ShardError:
            self._file.close()
            raise
        except Exception as e:  # odd objects where datasets belong, unreadable attributes...
            self._file.close()
            raise ShardError(f"shard {self.path}: unreadable layout ({type(e).__name__}: {e})") from e

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    @property
    def h5(self) -> h5py.File:
        """The open, read-only h5py.File, for tools that read single datasets (e.g. `inspect`)."""
        return self._file

    @property
    def attrs(self) -> dict:
        return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in self._file.attrs.items()}

    def _check_schema(self) -> None:
        schema = self._file.attrs.get("schema")
        schema = schema.decode() if isinstance(schema, bytes) else schema
        if schema != SCHEMA:
            raise ShardSchemaError(f"shard {self.path}: schema attribute is {schema!r}, expected {SCHEMA!r}")
        version = self._file.attrs.get("schema_version")
        known = isinstance(version, (int, np.integer)) and not isinstance(version, (bool, np.bool_))
        if not known or int(version) not in KNOWN_SCHEMA_VERSIONS:
            raise ShardSchemaError(
                f"shard {self.path}: schema_version {int(version) if known else repr(version)} but this megatron-rl "
                f"reads versions {min(KNOWN_SCHEMA_VERSIONS)}..{max(KNOWN_SCHEMA_VERSIONS)}; upgrade megatron-rl to "
                "read it (or re-write the shard)")

    def _check_layout(self) -> None:
        f = self._file
        missing = [k for k in self.REQUIRED if k not in f]
        if missing:
            raise ShardError(f"shard {self.path}: missing datasets {missing} (not a finished shard)")
        n = f["offsets"].shape[0] - 1
        if n < 0 or int(f.attrs.get("num_samples", -1)) != n:
            raise ShardError(f"shard {self.path}: offsets has {n + 1} entries, attribute num_samples="
                             f"{f.attrs.get('num_samples')}")
        per_sample = [k for k in ("reward",) + INT_COLUMNS + STR_COLUMNS if f[k].shape != (n,)]
        per_sample += [f"{g}/{k}" for g in ("reward_components", "timing") if g in f
                       for k in f[g] if f[g][k].shape != (n,)]
        ragged = {k: f[k].shape for k in RAGGED + ("token_versions",) if k in f}
        if "routed_experts" in f:
            ragged["routed_experts"] = f["routed_experts"].shape[:1]
        if per_sample or len(set(ragged.values())) != 1:
            raise ShardError(f"shard {self.path}: inconsistent shapes (per-sample {per_sample}, per-token {ragged})")

    def __len__(self) -> int:
        return int(self._file["offsets"].shape[0] - 1)

    def _offsets(self) -> np.ndarray:
        offsets = _read_full(self._file["offsets"])
        t = self._file["tokens"].shape[0]
        if offsets.dtype.kind not in "iu" or offsets[0] != 0 or offsets[-1] != t or np.any(np.diff(offsets) < 0):
            raise ShardError(f"shard {self.path}: offsets are not a valid CSR over {t} tokens (integers, starting "
                             f"at 0, non-decreasing, ending at {t})")
        return offsets

    def read_arrays(self) -> TrajectoryColumns:
        """Everything, columnar: the trainer's fast path. The per-token datasets are decoded on a thread pool
        (data/chunk_io.py) while this thread reads the per-sample columns."""
        f = self._file
        try:
            with ChunkReader(self.path, codec_threads(self.threads)) as chunks:
                waits = {k: chunks.submit(f[k]) for k in RAGGED + ("token_versions",) if k in f}
                per_sample = self._per_sample()
                per_token = {k: _read_full(f[k]) if wait is None else wait() for k, wait in waits.items()}
            tv = per_token.pop("token_versions", None)
            cols = TrajectoryColumns(**per_token, offsets=self._offsets(), token_versions=tv, **per_sample,
                                     routed_experts=self._routes())
        except ShardError:
            raise
        except Exception as e:  # OSError, a decode error, odd dtypes: whatever it is, the shard is unusable
            raise ShardError(f"shard {self.path}: read failed ({type(e).__name__}: {e})") from e
        self._validate(cols)
        return cols

    def _validate(self, cols: TrajectoryColumns) -> None:
        try:
            cols.validate(self.vocab_size, self.max_version)
        except Exception as e:  # TrajectoryError names the field; anything else is just as fatal
            raise ShardError(f"shard {self.path}: invalid values: {e}") from e

    def _routes(self, s: int = 0, e: int | None = None) -> np.ndarray | None:
        """routed_experts [e - s, L_moe, k] as int16 with -1 where not recorded; None when the shard has none."""
        ds = self._file.get("routed_experts")
        if ds is None:
            return None
        raw = _read_full(ds) if s == 0 and e is None else ds[s:e]
        out = raw.astype(np.int16)  # ids <= ROUTE_MAX fit; the missing marker becomes -1 below
        out[raw == ds.attrs["missing"]] = -1
        return out

    def _per_sample(self) -> dict:
        f = self._file
        return {**{k: _read_full(f[k]) for k in INT_COLUMNS + ("reward",)},
                **{k: f[k].asstr()[()] if len(self) else np.zeros(0, object) for k in STR_COLUMNS},
                "reward_components": self._group("reward_components"), "timings": self._group("timing")}

    def _group(self, name: str) -> dict[str, np.ndarray]:
        g = self._file.get(name)
        return {} if g is None else {k: _read_full(g[k]).astype(np.float64) for k in g}

    def __getitem__(self, i: int) -> Trajectory:
        """Random access to one sample without reading the rest."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"shard {self.path} has {n} samples, index {i}")
        i %= n
        try:
            cols = self._one(i)
        except ShardError:
            raise
        except Exception as e:  # odd dtypes where strings or numbers belong
            raise ShardError(f"shard {self.path}: read failed ({type(e).__name__}: {e})") from e
        self._validate(cols)
        return self._rows(cols)[0]

    def _one(self, i: int) -> TrajectoryColumns:
        s, e = (int(x) for x in self._offsets()[i:i + 2])
        one = np.array([0, e - s], np.int64)
        f = self._file
        return TrajectoryColumns(
            **{k: f[k][s:e] for k in RAGGED}, offsets=one,
            token_versions=f["token_versions"][s:e] if "token_versions" in f else None,
            **{k: f[k][i:i + 1] for k in INT_COLUMNS + ("reward",)},
            **{k: f[k].asstr()[i:i + 1] for k in STR_COLUMNS},
            reward_components={k: v[i:i + 1] for k, v in f.get("reward_components", {}).items()},
            timings={k: v[i:i + 1] for k, v in f.get("timing", {}).items()}, routed_experts=self._routes(s, e))

    def read(self) -> list[Trajectory]:
        return self._rows(self.read_arrays())

    def _rows(self, cols: TrajectoryColumns) -> list[Trajectory]:
        try:
            return cols.to_trajectories()
        except Exception as e:  # a value the column checks let through but the row checks refuse
            raise ShardError(f"shard {self.path}: invalid values: {e}") from e


def read_shard(path: str | os.PathLike, **checks) -> list[Trajectory]:
    """All trajectories of a shard; `checks`: vocab_size, max_version (ShardReader)."""
    with ShardReader(path, **checks) as r:
        return r.read()


def read_arrays(path: str | os.PathLike, **checks) -> TrajectoryColumns:
    """All trajectories of a shard, columnar; `checks`: vocab_size, max_version (ShardReader)."""
    with ShardReader(path, **checks) as r:
        return r.read_arrays()


# ---------------------------------------------------------------------------------------------- directory


@dataclass
class ShardDirectoryConfig:
    """Where and how the trainer picks up shards; `build()` returns a ShardDirectory."""

    root: str = "runs/shards"
    """Folder the rollout workers publish shards into."""
    max_staleness: int | None = None
    """Keep samples with policy_version_first >= current - max_staleness; None keeps all (0 = on-policy)."""
    prefetch: bool = True
    """Read the next shard in a background thread while the trainer works."""
    quarantine_dir: str = "quarantine"
    """Sub-folder of `root` that unreadable shards are moved into, each with a `<name>.reason.txt`."""
    dedup_window: int = 1_000_000
    """Episode ids remembered for duplicate dropping (the most recent ones; retries re-publish recent episodes)."""
    read_threads: int = 0
    """Threads decoding a shard's per-token chunks (data/chunk_io.py); 0 = one per usable core, at most 4."""
    vocab_size: int | None = None
    """The policy's vocabulary: a shard holding a token id >= it is quarantined (None: ids up to MAX_TOKEN_ID)."""
    max_version_ahead: int | None = None
    """Quarantine a shard with a policy version more than this above the current one (0: none above it); None:
    only the absolute bound MAX_POLICY_VERSION (a trainer restarted from an older checkpoint legitimately finds
    shards of versions it has not reached again yet)."""

    def validate(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"shard max_staleness {self.max_staleness} must be >= 0 or None")
        if self.dedup_window < 1:
            raise ConfigError(f"shard dedup_window {self.dedup_window} must be >= 1")
        if self.read_threads < 0:
            raise ConfigError(f"shard read_threads {self.read_threads} must be >= 0 (0 = one per core, at most 4)")
        if not self.quarantine_dir or "/" in self.quarantine_dir:
            raise ConfigError(f"shard quarantine_dir {self.quarantine_dir!r} must be a plain folder name")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ConfigError(f"shard vocab_size {self.vocab_size} must be >= 1 (or None: not checked)")
        if self.max_version_ahead is not None and self.max_version_ahead < 0:
            raise ConfigError(f"shard max_version_ahead {self.max_version_ahead} must be >= 0 (or None: off)")

    def build(self) -> ShardDirectory:
        self.validate()
        return ShardDirectory(self.root, self.max_staleness, prefetch=self.prefetch,
                              quarantine_dir=self.quarantine_dir, dedup_window=self.dedup_window,
                              read_threads=self.read_threads, vocab_size=self.vocab_size,
                              max_version_ahead=self.max_version_ahead)


@dataclass
class ShardStats:
    """Counts, per shard (ShardBatch.stats) or cumulative (ShardDirectory.stats)."""

    shards: int = 0
    """Shards read successfully."""
    samples_read: int = 0
    """Samples found in those shards."""
    samples_kept: int = 0
    """Samples returned to the trainer."""
    dropped_stale: int = 0
    """Samples older than current_version - max_staleness."""
    dropped_duplicate: int = 0
    """Samples whose episode_id was already consumed (dispatch retries)."""
    quarantined: int = 0
    """Shards moved to quarantine."""

    def add(self, other: ShardStats) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class ShardBatch:
    """The kept samples of one shard."""

    path: Path
    """The shard they came from."""
    columns: TrajectoryColumns
    """Kept samples, columnar."""
    stats: ShardStats
    """What was read, kept and dropped in this shard."""


CONSUMER_LOCK = ".consumer.lock"
"""File in a shard folder that its one consumer holds an exclusive flock on (and names itself in)."""


class _ConsumerLock:
    """Exclusive, non-blocking flock on `<root>/.consumer.lock`, taken by a ShardDirectory on first read, so a
    second consumer of the same folder fails loudly instead of taking episodes twice or stealing them."""

    _warned: set[str] = set()

    def __init__(self, root: Path):
        self.root = root
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        fd = os.open(self.root / CONSUMER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "holder unknown"
            os.close(fd)
            raise ShardError(f"shard folder {self.root} is already read by another consumer ({holder}); give "
                             f"each trainer its own folder (one consumer per folder keeps every episode exactly "
                             f"once)") from None
        except OSError as e:  # a file system without flock (some NFS/Lustre mounts): the rule is not enforced
            os.close(fd)
            if str(self.root) not in self._warned:
                self._warned.add(str(self.root))
                logger.warning("shard folder %s: cannot lock %s (%s); one consumer per folder is not enforced",
                               self.root, CONSUMER_LOCK, e)
            self._fd = -1
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None


class ShardDirectory:
    """The trainer's view of a shard folder: new shards in publish order, each consumed exactly once.

    A shard counts as consumed when `next_batch` returns it; checkpoint `state_dict()` together with any
    samples the trainer still buffers. Only one consumer per folder: the first read takes a lock on the folder
    (`.consumer.lock`, released by `close()`, or when the object or its process goes), and a second
    ShardDirectory on the same folder raises ShardError naming the holder. Unreadable shards, and shards whose
    values break the contract (ShardReader's checks; with `max_version_ahead`, a policy version too far above the
    current one), are quarantined
    with the reason and skipped, never raised. Files ending in `.tmp` (unfinished writers) are ignored. Consumed
    shards are remembered by file name, so writers must use a new name per write attempt; an episode re-written by a
    retry under another name is dropped as a duplicate by its episode_id (the last `dedup_window` kept ids
    are remembered, so memory stays bounded on long runs).
    """

    def __init__(self, root: str | os.PathLike, max_staleness: int | None = None, *, prefetch: bool = True,
                 quarantine_dir: str = "quarantine", dedup_window: int = 1_000_000, read_threads: int = 0,
                 vocab_size: int | None = None, max_version_ahead: int | None = None):
        self.root = Path(root)
        self.read_threads = read_threads
        self.vocab_size, self.max_version_ahead = vocab_size, max_version_ahead
        self.max_staleness = max_staleness
        self.prefetch = prefetch
        self.quarantine_root = self.root / quarantine_dir
        self.stats = ShardStats()
        self._consumed: set[str] = set()
        self.dedup_window = dedup_window
        self._seen_ids: dict[str, None] = {}  # insertion-ordered: the oldest ids leave first
        self._prefetched: tuple[str, queue.Queue] | None = None
        self._lock = _ConsumerLock(self.root)

    def close(self) -> None:
        """Let another consumer read this folder (e.g. a restarted trainer in the same process)."""
        self._lock.release()

    def __enter__(self) -> ShardDirectory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_lock"):
            self._lock.release()

    # -- listing and state
    def list_new(self) -> list[Path]:
        """Unconsumed shards, oldest first (by modification time, then name)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in os.scandir(self.root):
            if entry.is_file() and entry.name.endswith(SHARD_SUFFIXES) and entry.name not in self._consumed:
                try:
                    found.append((entry.stat().st_mtime_ns, entry.name))
                except FileNotFoundError:  # quarantined or removed meanwhile
                    continue
        return [self.root / name for _, name in sorted(found)]

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: consumed shard names, seen episode ids, cumulative stats."""
        return {"version": 1, "consumed": sorted(self._consumed), "seen_episode_ids": list(self._seen_ids),
                "stats": dict(vars(self.stats))}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"ShardDirectory state version {state.get('version')!r} unknown (expected 1)")
        self._consumed = set(state["consumed"])
        self._seen_ids = {}
        self._remember(state["seen_episode_ids"])
        self.stats = ShardStats(**state["stats"])
        self._prefetched = None

    # -- reading
    def next_batch(self, current_version: int) -> ShardBatch | None:
        """The next readable shard's kept samples, or None when no new shard is there now."""
        if self.root.is_dir():
            self._lock.acquire()
        while True:
            pending = self.list_new()
            if not pending:
                return None
            path = pending[0]
            columns = self._take(path)
            if self.prefetch and len(pending) > 1:
                self._start_prefetch(pending[1])
            self._consumed.add(path.name)
            if not isinstance(columns, BaseException) and self.max_version_ahead is not None:
                columns = _not_ahead(path, columns, current_version + self.max_version_ahead)
            if isinstance(columns, BaseException):
                self._quarantine(path, columns)
                continue
            return self._filter(path, columns, current_version)

    def __iter__(self) -> Iterator[ShardBatch]:
        raise TypeError("iterate with next_batch(current_version): staleness depends on the current version")

    def _take(self, path: Path) -> TrajectoryColumns | BaseException:
        if self._prefetched is not None and self._prefetched[0] == path.name:
            result = self._prefetched[1].get()
            self._prefetched = None
            return result
        return _load(path, self.read_threads, self.vocab_size)

    def _start_prefetch(self, path: Path) -> None:
        box: queue.Queue = queue.Queue(maxsize=1)
        threading.Thread(target=lambda: box.put(_load(path, self.read_threads, self.vocab_size)),
                         name=f"shard-prefetch-{path.name}", daemon=True).start()
        self._prefetched = (path.name, box)

    def _filter(self, path: Path, cols: TrajectoryColumns, current_version: int) -> ShardBatch:
        n = len(cols)
        stats = ShardStats(shards=1, samples_read=n)
        keep = np.ones(n, bool)
        batch_ids: set[str] = set()
        for i, eid in enumerate(cols.episode_id):
            if eid in self._seen_ids or eid in batch_ids:
                keep[i] = False
                stats.dropped_duplicate += 1
            batch_ids.add(eid)
        if self.max_staleness is not None:
            stale = keep & (cols.policy_version_first < current_version - self.max_staleness)
            stats.dropped_stale = int(stale.sum())
            keep &= ~stale
        kept = cols.select(keep)
        self._remember(kept.episode_id.tolist())
        stats.samples_kept = len(kept)
        self.stats.add(stats)
        return ShardBatch(path, kept, stats)

    def _remember(self, ids) -> None:
        for eid in ids:
            self._seen_ids[eid] = None
        for eid in list(itertools.islice(self._seen_ids, max(0, len(self._seen_ids) - self.dedup_window))):
            del self._seen_ids[eid]

    def _quarantine(self, path: Path, error: BaseException) -> None:
        self.quarantine_root.mkdir(parents=True, exist_ok=True)
        target = self.quarantine_root / path.name
        if target.exists():
            target = self.quarantine_root / f"{path.stem}.{time.time_ns()}{path.suffix}"
        reason = (f"time: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\nshard: {path}\n"
                  f"error: {type(error).__name__}: {error}\n\n"
                  + "".join(traceback.format_exception(type(error), error, error.__traceback__)))
        try:
            os.replace(path, target)
            target.with_name(target.name + ".reason.txt").write_text(reason)
        except OSError as e:
            logger.warning("shard %s is unreadable and could not be quarantined (%s); skipping it", path, e)
        else:
            logger.warning("quarantined shard %s -> %s: %s: %s", path, target, type(error).__name__, error)
        self.stats.quarantined += 1


def _load(path: Path, threads: int = 0, vocab_size: int | None = None) -> TrajectoryColumns | BaseException:
    """Read a whole shard; any failure is returned (to be quarantined), never raised."""
    try:
        with ShardReader(path, threads, vocab_size=vocab_size) as r:
            return r.read_arrays()
    except Exception as e:  # corrupt input of any kind must not crash the trainer
        return e


def _not_ahead(path: Path, cols: TrajectoryColumns, limit: int) -> TrajectoryColumns | ShardError:
    """`cols`, or the error to quarantine them with when a policy version is above `limit` (no policy that new
    exists: the shard lies about where its tokens came from)."""
    for name in ("policy_version_last", "token_versions"):
        a = getattr(cols, name)
        if a is not None and len(a) and int(a.max()) > limit:
            return ShardError(f"shard {path}: invalid values: {name} {int(a.max())} is above {limit} (the current "
                              f"policy version plus max_version_ahead)")
    return cols


__all__: Sequence[str] = (
    "SCHEMA", "SCHEMA_VERSION", "STATUSES", "COMPRESSIONS", "Trajectory", "TrajectoryColumns", "TrajectoryError",
    "ShardError", "ShardSchemaError", "ShardWriter", "ShardWriterConfig", "write_shard", "ShardReader",
    "read_shard", "read_arrays", "ShardDirectory", "ShardDirectoryConfig", "ShardStats", "ShardBatch")
