"""Trajectory data: HDF5 shards written by rollout workers and consumed by the trainer."""
from megatron_rl.data.shards import (
    COMPRESSIONS,
    SCHEMA,
    SCHEMA_VERSION,
    STATUSES,
    ShardError,
    ShardReader,
    ShardSchemaError,
    ShardWriter,
    ShardWriterConfig,
    Trajectory,
    TrajectoryColumns,
    TrajectoryError,
    read_arrays,
    read_shard,
    write_shard,
)

__all__ = [
    "COMPRESSIONS", "SCHEMA", "SCHEMA_VERSION", "STATUSES", "ShardError", "ShardReader",
    "ShardSchemaError", "ShardWriter", "ShardWriterConfig", "Trajectory",
    "TrajectoryColumns", "TrajectoryError", "read_arrays", "read_shard", "write_shard",
]
