"""Many trajectories as flat CSR columns (what a shard stores and the trainer reads), with their checks."""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import hdf5plugin  # noqa: F401  (registers the blosc filter; readers need it to decompress)
import numpy as np

from megatron_rl.data.shards.schema import (
    INT_COLUMNS,
    LOGPROB_SLACK,
    MAX_POLICY_VERSION,
    MAX_TOKEN_ID,
    RAGGED,
    RAGGED_DTYPES,
    REWARD_LIMIT,
    STATUSES,
    STR_COLUMNS,
    TIMING_LIMIT,
    TrajectoryError,
)
from megatron_rl.data.shards.trajectory import Trajectory, _check_names, _routes_array, episode_of

logger = logging.getLogger(__name__)

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
