"""Configs of the RL loop: rollouts (group size, staleness, dynamic sampling), evaluation, checkpoints."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config import ConfigError
from megatron_rl.data.store import STORES, S3StoreConfig
from megatron_rl.dispatch.dispatcher import DispatchConfig
from megatron_rl.dispatch.fleet import FleetConfig
from megatron_rl.rl.config import LossConfig
from megatron_rl.trainer.packing import PackingConfig
from megatron_rl.trainer.policy import OptimConfig
from megatron_rl.trainer.rl_step import RLConfig


def _default_trainer() -> RLConfig:
    return RLConfig(loss=LossConfig(name="grpo"), packing=PackingConfig(max_tokens=1024, overlong="skip"))


@dataclass
class RLLoopConfig:
    """The GRPO loop after the warm-up: sampling, staleness, dynamic sampling, checkpoints."""

    steps: int = 20
    """RL optimizer steps (0 = warm-up only)."""
    prompts_per_step: int = 8
    """Groups (prompts) in one global batch."""
    group_size: int = 8
    """Samples per prompt (the GRPO group)."""
    max_new_tokens: int = 24
    """Generated tokens per sample at most."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    max_staleness: int = 0
    """0 = synchronous; k >= 1: rollouts for up to k future steps overlap training (policy lag <= k)."""
    importance_correction: str = "auto"
    """Truncated IS correction of off-policy samples: auto (tis when max_staleness > 0), none, tis or mis."""
    dynamic_sampling: bool = True
    """DAPO: drop groups whose rewards are all equal and replace them with fresh prompts."""
    max_oversample: float = 2.0
    """Extra prompts per step for replacements at most, as a multiple of prompts_per_step."""
    checkpoint_every: int = 10
    """Save a resumable checkpoint every this many steps, and at the end and on SIGTERM/SIGUSR1 (0: only then)."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """Weights of the domain's reward components in the RL phase (e.g. {format: 0.0}); {} keeps the env's."""
    mismatch_alert_kl: float = 0.05
    """Alert (the monitor's `mismatch` rule) when KL(behaviour || trainer) of the batch, the metric mismatch_kl,
    exceeds this (train/rollout log-prob mismatch)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4, clip_grad=1.0))
    """Optimizer of the RL phase (a fresh optimizer on the warmed-up weights)."""
    trainer: RLConfig = field(default_factory=_default_trainer)
    """Loss, advantages and packing of the RL update."""

    def validate(self) -> None:
        for name in ("prompts_per_step", "group_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0 or self.max_staleness < 0 or self.checkpoint_every < 0:
            raise ConfigError("rl.steps, rl.max_staleness and rl.checkpoint_every must be >= 0")
        if self.importance_correction not in ("auto", "none", "tis", "mis"):
            raise ConfigError(f"rl.importance_correction {self.importance_correction!r} is not one of "
                              "auto, none, tis, mis")
        if not self.mismatch_alert_kl >= 0:
            raise ConfigError(f"rl.mismatch_alert_kl must be >= 0, got {self.mismatch_alert_kl}")
        if self.max_oversample < 0:
            raise ConfigError(f"rl.max_oversample must be >= 0, got {self.max_oversample}")
        if self.group_size < 2 and self.dynamic_sampling:
            raise ConfigError("rl.dynamic_sampling needs rl.group_size >= 2 (a group of one always has equal rewards)")
        self._no_shadowed_trainer_fields()

    def _no_shadowed_trainer_fields(self) -> None:
        """rl.trainer.temperature and rl.trainer.valid_vocab are set by the loop (from rl.temperature and from the
        run's tokenizer): a different value written there would be overwritten without a word, so it is refused."""
        t = self.trainer
        if t.temperature not in (1.0, self.temperature):
            raise ConfigError(f"rl.trainer.temperature={t.temperature} is set by the loop from rl.temperature "
                              f"({self.temperature}): set rl.temperature instead (the rollouts sample with it)")
        if t.valid_vocab is not None:
            raise ConfigError(f"rl.trainer.valid_vocab={t.valid_vocab} is set by the loop from the run's tokenizer: "
                              "remove it (tokenizer.* names the tokenizer)")

    def correction(self) -> str:
        """The IS correction actually used."""
        if self.importance_correction == "auto":
            return "tis" if self.max_staleness > 0 else "none"
        return self.importance_correction


@dataclass
class EvalConfig:
    """In-loop evaluation on held-out tasks."""

    every: int = 10
    """Evaluate every this many RL steps (and before the first and after the last); 0 = only those two."""
    tasks: int = 64
    """Held-out tasks evaluated per domain: the first this many of its held-out split whose prompt fits
    model.max_seq_length - rl.max_new_tokens (fewer are logged; the eval row's <domain>/tasks counts them)."""
    k: int = 4
    """Samples per task for pass@k (temperature rl.temperature); success is also measured greedily."""


def _default_dispatch() -> DispatchConfig:
    return DispatchConfig(folder="", episodes_per_task=8, time_min=20, max_retries=2)


@dataclass
class EpisodesConfig:
    """Where the RL loop's episodes (environment steps and rewards) run."""

    runner: str = "inprocess"
    """inprocess: the in-process engine generates and rank 0's threads score (sandboxed);
    dispatch: rollout workers (submitit: local processes or Slurm array tasks) run whole episodes, calling
    the engine's HTTP server on rank 0, and publish HDF5 shards that the trainer reads (one job array per step);
    fleet: the same episodes on a persistent fleet (episodes.fleet): long-lived workers submitted once, pulling
    leases from a queue that rank 0 serves."""
    server: str = "colocated"
    """colocated: the trainer ranks serve their in-process engine while a step's episodes run (no overlap with
    training); separate: a rollout server process of its own (weights pushed after every update), so with
    rl.max_staleness >= 1 the next steps' episodes run while the trainer trains (needs parallel.tp=pp=1)."""
    server_threads: int = 1
    """Torch threads of the separate rollout server process."""
    serve_host: str = ""
    """Address the workers use to reach the rollout server ('' = 127.0.0.1 for the local and debug
    executors, this host's name for slurm)."""
    worker_threads: int = 0
    """Episodes a worker task runs at once (0 = the CPUs Slurm gave it)."""
    dispatch: DispatchConfig = field(default_factory=_default_dispatch)
    """Executor, partition, batching and retries of the dispatched episodes ('' folder = <run>/dispatch)."""
    fleet: FleetConfig = field(default_factory=FleetConfig)
    """The persistent fleet of runner=fleet: size, resources, leases, heartbeats ('' folder = <run>/fleet)."""
    store: str = "fs"
    """Where the workers' shards go and how the trainer learns of them (runner dispatch or fleet; `data.store`):
    fs, the batch folder on the shared filesystem (listed); s3, an S3-compatible object store (`s3`) with
    "shard ready" announcements on a NATS JetStream server, for workers that do not share the trainer's
    filesystem."""
    s3: S3StoreConfig = field(default_factory=S3StoreConfig)
    """Endpoint, bucket, prefix and queue of store=s3 (credentials: environment or s3.credentials_file)."""
    checkpoint_turns: int = 0
    """Runner dispatch or fleet: a multi-turn episode (the loop's own turns) saves its state to the store every
    this many model turns, and one re-leased after its worker died continues from it on another worker,
    token-exact (`envs.episode_state`); 0 = off."""

    def validate(self) -> None:
        if self.runner not in ("inprocess", "dispatch", "fleet"):
            raise ConfigError(f"episodes.runner must be inprocess, dispatch or fleet, got {self.runner!r}")
        if self.server not in ("colocated", "separate"):
            raise ConfigError(f"episodes.server must be colocated or separate, got {self.server!r}")
        if self.server == "separate" and self.runner == "inprocess":
            raise ConfigError("episodes.server=separate needs episodes.runner=dispatch or fleet (workers call the "
                              "server)")
        if self.runner == "fleet":
            self.fleet.validate()
        if self.server_threads < 1:
            raise ConfigError(f"episodes.server_threads must be >= 1, got {self.server_threads}")
        if self.worker_threads < 0:
            raise ConfigError(f"episodes.worker_threads must be >= 0, got {self.worker_threads}")
        if self.checkpoint_turns < 0:
            raise ConfigError(f"episodes.checkpoint_turns must be >= 0 (0 = off), got {self.checkpoint_turns}")
        if self.checkpoint_turns and self.runner == "inprocess":
            raise ConfigError("episodes.checkpoint_turns needs episodes.runner=dispatch or fleet (in-process episodes "
                              "are not re-leased)")
        if self.store not in STORES:
            raise ConfigError(f"episodes.store must be one of {', '.join(STORES.names())}, got {self.store!r}")
        if self.store == "s3":
            if self.runner == "inprocess":
                raise ConfigError("episodes.store=s3 needs episodes.runner=dispatch or fleet (in-process episodes "
                                  "publish no shards)")
            self.s3.check()
