"""Slurm-native dispatch: episode batches as submitit job arrays (or local processes), HDF5 shards back.

`Dispatcher(DispatchConfig(...), WorkerConfig(...), shard_dir).run(episodes) -> DispatchReport`; the worker
side is `megatron_rl.dispatch.worker` (`megatron-rl rollout-worker --spec FILE`). A persistent fleet (one
submission per run, leases from the driver's queue): `Fleet(FleetConfig(...), WorkerConfig(...), folder)`
(`megatron_rl.dispatch.fleet`, workers in `fleet_worker`).
"""
from megatron_rl.dispatch.dispatcher import (
    DispatchConfig,
    Dispatcher,
    DispatchReport,
    episodes_from_tasks,
    published_episode_ids,
)
from megatron_rl.dispatch.spec import EpisodeSpec, FaultConfig, GeneratorConfig, WorkerConfig, WorkerSpec

__all__ = ["DispatchConfig", "DispatchReport", "Dispatcher", "EpisodeSpec", "FaultConfig", "GeneratorConfig",
           "WorkerConfig", "WorkerSpec", "episodes_from_tasks", "published_episode_ids"]
