"""One trajectory (a sample) as the shard contract holds it, checked on construction; split agent episodes' segment
rows."""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import hdf5plugin  # noqa: F401  (registers the blosc filter; readers need it to decompress)
import numpy as np

from megatron_rl.data.shards.schema import (
    _I32,
    LOGPROB_SLACK,
    MAX_POLICY_VERSION,
    MAX_TOKEN_ID,
    REWARD_LIMIT,
    ROUTE_MAX,
    SEGMENT_MARK,
    STATUSES,
    TIMING_LIMIT,
    TrajectoryError,
)

logger = logging.getLogger(__name__)

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
