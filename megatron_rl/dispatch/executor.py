"""The one builder of submitit executors, for per-step dispatches (`DispatchConfig`) and the persistent fleet
(`FleetConfig`): both configs carry the same resource fields, read here alone."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol


class ExecutorFields(Protocol):
    """The fields an executor is built from (`DispatchConfig`, `FleetConfig`; documented there)."""

    executor: str
    time_min: int
    cpus_per_task: int
    mem_gb: float
    partition: str
    account: str
    qos: str
    signal_delay_s: int
    max_num_timeout: int
    setup: list[str]


def submitit_executor(cfg: ExecutorFields, folder: Path, name: str, array_parallelism: int):
    """A submitit executor of `cfg.executor` (local, slurm or debug), logs under `folder/<job id>`, jobs named
    `name`; on Slurm at most `array_parallelism` array tasks run at once, `cfg.setup` runs before each task on
    Slurm and locally, and a task that hits its time limit is requeued `max_num_timeout` times."""
    import submitit

    ex = submitit.AutoExecutor(folder=Path(folder) / "%j", cluster=cfg.executor,
                               slurm_max_num_timeout=cfg.max_num_timeout)
    params: dict = {"timeout_min": cfg.time_min, "cpus_per_task": cfg.cpus_per_task, "mem_gb": cfg.mem_gb,
                    "name": name}
    if cfg.executor == "slurm":
        params.update(slurm_partition=cfg.partition, slurm_array_parallelism=array_parallelism,
                      slurm_signal_delay_s=cfg.signal_delay_s)
        params.update({k: v for k, v in (("slurm_account", cfg.account), ("slurm_qos", cfg.qos)) if v})
        if cfg.setup:
            params["slurm_setup"] = list(cfg.setup)
    elif cfg.executor == "local" and cfg.setup:
        params["local_setup"] = list(cfg.setup)
    ex.update_parameters(**params)
    return ex
