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

One idea a module: schema (names, limits, errors), trajectory, columns, writer, reader. Worker shards are consumed
(quarantine, dedup) by `data.consume.read_folder` through the run's trajectory store (`data.store`).
"""
from megatron_rl.data.shards.columns import (  # noqa: F401
    TrajectoryColumns,
)
from megatron_rl.data.shards.reader import (  # noqa: F401
    ShardReader,
    read_arrays,
    read_shard,
    rows_of,
)
from megatron_rl.data.shards.schema import (  # noqa: F401
    COMPRESSIONS,
    INT_COLUMNS,
    KNOWN_SCHEMA_VERSIONS,
    LOGPROB_SLACK,
    MAX_POLICY_VERSION,
    MAX_TOKEN_ID,
    MIN_CHUNK_ELEMS,
    RAGGED,
    RAGGED_DTYPES,
    REWARD_LIMIT,
    ROUTE_MAX,
    SCHEMA,
    SCHEMA_VERSION,
    SEGMENT_MARK,
    SHARD_SUFFIXES,
    STATUSES,
    STR_COLUMNS,
    TIMING_LIMIT,
    TMP_SUFFIX,
    ShardError,
    ShardSchemaError,
    TrajectoryError,
)
from megatron_rl.data.shards.trajectory import (  # noqa: F401
    Trajectory,
    episode_of,
    segment_id,
    segment_rows,
)
from megatron_rl.data.shards.writer import (  # noqa: F401
    SHUFFLE,
    ShardWriter,
    ShardWriterConfig,
    fsync_dir,
    write_shard,
)

__all__ = (
    "SCHEMA", "SCHEMA_VERSION", "STATUSES", "COMPRESSIONS", "Trajectory", "TrajectoryColumns", "TrajectoryError",
    "ShardError", "ShardSchemaError", "ShardWriter", "ShardWriterConfig", "write_shard", "ShardReader",
    "read_shard", "read_arrays", "rows_of")
