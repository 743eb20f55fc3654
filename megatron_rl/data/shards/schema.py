"""Names, limits and errors of the trajectory shard schema (the layout: the package docstring)."""
from __future__ import annotations

import logging

import hdf5plugin  # noqa: F401  (registers the blosc filter; readers need it to decompress)
import numpy as np

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


class TrajectoryError(ValueError):
    """A trajectory that breaks the shard contract (wrong length, dtype, status...)."""


class ShardError(RuntimeError):
    """A shard that cannot be read: unopenable, truncated, inconsistent, or of another schema."""


class ShardSchemaError(ShardError):
    """A shard written by another schema or by a newer, incompatible schema version."""
