"""The top-level run configuration: one section per component, loaded from `configs/*.yaml`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.envs.mixture import DomainConfig, MixtureConfig
from megatron_rl.envs.task_source import task_source as build_task_source
from megatron_rl.loop.config import EpisodesConfig, EvalConfig, RLLoopConfig
from megatron_rl.models.gpt import ModelConfig
from megatron_rl.monitoring import MonitorConfig
from megatron_rl.parallel import ParallelConfig
from megatron_rl.rollout.engine import EngineConfig
from megatron_rl.tokenizer import TokenizerConfig
from megatron_rl.trainer.lora import LoRAConfig
from megatron_rl.trainer.policy import OptimConfig
from megatron_rl.trainer.teacher import DistillConfig, check_teacher


@dataclass
class LaunchConfig:
    """How the job's ranks are started when `megatron-rl train` is not already under a launcher."""

    nproc_per_node: int = 2
    """Local ranks started with torchrun (the world size on one machine)."""
    backend: str = "auto"
    """torch.distributed backend: auto (gloo on CPU, NCCL on GPU), gloo or nccl."""
    timeout_minutes: int = 30
    """Collective timeout."""
    threads_per_rank: int = 0
    """Torch intra-op threads of each rank (OMP_NUM_THREADS); 0 = $OMP_NUM_THREADS, else this machine's cores
    shared among the local ranks (decided in commands/launch.py: rank_threads)."""

    def validate(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(f"launch.nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.threads_per_rank < 0:
            raise ConfigError(f"launch.threads_per_rank must be >= 0, got {self.threads_per_rank}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"launch.backend {self.backend!r} is not one of auto, gloo, nccl")


@dataclass
class DataConfig:
    """Task data for the warm-up phase."""

    domain: str = "countdown"
    """Environment of the warm-up's data, and the RL loop's only domain when `envs.domains` is empty."""
    train_tasks: int = 256
    """Training tasks taken from the suite."""
    heldout_tasks: int = 32
    """Held-out tasks for evaluation."""
    sandbox: str = "bwrap"
    """Sandbox backend that checks each reference solution and runs the rewards (registry name)."""
    sandbox_workers: int = 2
    """Concurrent sandbox slots (a SandboxPool above 1)."""
    sandbox_lease_dir: str = ""
    """bwrap as root: the node-wide registry of slot uid leases ('' = /run/megatron-rl/sandbox-uids); name a folder
    every job on the node sees where jobs run in containers with a private /run (never a per-job TMPDIR)."""
    episode_workers: int = 4
    """Threads running episodes' env steps and rewards on rank 0."""

    def sandbox_config(self):
        from megatron_rl.envs.sandbox import SandboxConfig

        return SandboxConfig(backend=self.sandbox, workers=self.sandbox_workers, lease_dir=self.sandbox_lease_dir)

    def validate(self) -> None:
        import megatron_rl.envs  # noqa: F401  (registers the built-in environments)
        from megatron_rl.envs.base import ENVIRONMENTS

        if self.domain not in ENVIRONMENTS:
            raise ConfigError(f"data.domain {self.domain!r} is not a registered environment; known: "
                              f"{sorted(ENVIRONMENTS.names())}")
        if self.sandbox_workers < 1 or self.episode_workers < 1:
            raise ConfigError("data.sandbox_workers and data.episode_workers must be >= 1")


@dataclass
class TrainConfig:
    """The supervised warm-up on verified reference solutions (before the RL phase)."""

    steps: int = 30
    """Warm-up optimizer steps (0 = none)."""
    micro_batch_size: int = 8
    """Samples per micro-batch."""
    num_microbatches: int = 2
    """Micro-batches per step on each data-parallel rank."""
    seq_length: int = 64
    """Tokens per sample (padded/truncated)."""
    eval_every: int = 10
    """Evaluate held-out loss every this many steps (and at the end)."""
    checkpoint_every: int = 100
    """Checkpoint the warm-up every this many steps (0: only at its end and on SIGTERM/SIGUSR1); a rerun resumes."""

    def validate(self) -> None:
        for name, least in (("steps", 0), ("checkpoint_every", 0), ("eval_every", 1)):
            if getattr(self, name) < least:
                raise ConfigError(f"train.{name} must be >= {least}, got {getattr(self, name)}")


@dataclass
class ExportConfig:
    """The HF folder written at the end of a run (`megatron-rl export` does the same for any checkpoint)."""

    enabled: bool = True
    """Export the final policy to <run>/export/hf-step-N when the run finishes."""
    verify: bool = False
    """Load the folder with transformers and compare its logits with the policy's (small models)."""


@dataclass
class RunConfig:
    """A whole run."""

    name: str = "run"
    """Run name; outputs go to output_dir/name."""
    output_dir: str = "runs"
    """Root folder of run outputs (shards, checkpoints, metrics)."""
    seed: int = 1234
    """Seed of every random stream of the run."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Process launch."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the trainer."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model (model.init: a pretrained checkpoint)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer every component uses (default: the checkpoint's own, else bytes)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Task data of the warm-up, sandbox and episode threads."""
    envs: MixtureConfig = field(default_factory=MixtureConfig)
    """The RL loop's mixture of domains (weights, tasks, rewards, budgets, judge)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Supervised warm-up."""
    curriculum: dict[str, Any] = field(default_factory=dict)
    """data.domain's generated task source (`envs.task_source`) instead of its shipped suite, for warm-up, RL and
    evaluation: its settings, checked by the source (countdown's easier curriculum: enabled, min_numbers,
    max_numbers, max_value, max_ops, rl_tasks, in envs/countdown/curriculum.py); {} = the source's defaults (on);
    {enabled: false} = the shipped suite."""
    rl: RLLoopConfig = field(default_factory=RLLoopConfig)
    """The RL loop."""
    episodes: EpisodesConfig = field(default_factory=EpisodesConfig)
    """Where the RL loop's episodes run (in-process or dispatched to rollout workers)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine: the in-process native one, or vLLM engine processes (engine.backend)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """In-loop evaluation."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Metrics sinks and alerts."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """The HF export at the end of the run."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation: the teacher scoring every sampled token (off by default)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters trained in the RL phase instead of the full weights (off by default)."""

    def resolve_sources(self) -> None:
        """The run's resolve step (before `validate`): read model.init's checkpoint and fill the model's shape in."""
        if not self.model.init:
            return
        from megatron_rl.convert.source import resolve

        try:
            resolve(self.model)
        except ConfigError as e:
            raise ConfigError(f"config section 'model': {e}") from None

    def _resolve_domains(self) -> None:
        """`envs.domains` empty: the one domain data.domain with rl.reward_weights (the single-domain form)."""
        if not self.envs.domains:
            self.envs.domains = {self.data.domain: DomainConfig(reward_weights=dict(self.rl.reward_weights))}
        elif self.rl.reward_weights and any(d.reward_weights != self.rl.reward_weights
                                            for d in self.envs.domains.values()):
            raise ConfigError("rl.reward_weights applies to data.domain alone; with envs.domains set, give each "
                              "domain its own envs.domains.<name>.reward_weights")
        self.envs.validate()
        self.envs.check_generated()  # a task library's domains: their splits made and checked here

    def task_source(self):
        """data.domain's generated task source (`curriculum:`), None when off (`envs.task_source`)."""
        return build_task_source(self.curriculum, self.data.domain)

    def _check_warmup(self) -> None:
        """The supervised warm-up trains on reference answers (`payload.solution`); refuse a domain without."""
        if self.train.steps == 0 or self.task_source() is not None:
            return
        from megatron_rl.envs.tasks import load_domain

        missing = [t.id for t in load_domain(self.data.domain, split="train")[:self.data.train_tasks]
                   if not isinstance(t.payload.get("solution"), str)]
        if missing:
            raise ConfigError(f"train.steps={self.train.steps} (the supervised warm-up) needs a reference answer "
                              f"(payload.solution) in every task, but {len(missing)} tasks of data.domain "
                              f"{self.data.domain!r} have none (e.g. {missing[0]!r}); set train.steps=0 to start "
                              f"RL from the model as it is, or pick a domain with reference answers")

    def _check_agents(self) -> None:
        """Domains played by a black-box agent need the gateway's chat template (every episode runner plays them:
        in process, dispatched and on the fleet, `dispatch.spec.WorkerConfig.agents`)."""
        agents = self.envs.agent_domains()
        if not agents:
            return
        key = f"envs.domains.{agents[0]}.agent={self.envs.domains[agents[0]].agent!r}"
        tok = self.tokenizer.build(self.model) if self.tokenizer.resolved_path(self.model) else None
        if not getattr(tok, "has_chat_template", False):
            raise ConfigError(f"{key}: the agent's chat calls are rendered with the model's chat template, and the "
                              f"run's tokenizer has none; use an HF model folder with a chat template "
                              f"(model.init: hf:DIR) or drop the agent")

    def _check_export(self) -> None:
        """The end-of-run HF export of a random model needs an HF architecture that describes it."""
        if not self.export.enabled or self.model.init:
            return
        from megatron_rl.convert.arch import describe
        from megatron_rl.convert.arch.base import ConvertError

        try:
            describe(self.model, {"layernorm_epsilon": self.model.norm_epsilon, "kv_channels": self.model.head_dim})
        except ConvertError as e:
            raise ConfigError(f"export.enabled=true, but the run's random model cannot be written as an HF folder: "
                              f"{e}; set export.enabled=false or give the model a shape an HF architecture has "
                              f"(e.g. every layer MoE: Mixtral)") from None

    def _check_routing_replay(self) -> None:
        """rl.trainer.routing_replay needs routes recorded by the engine of an MoE policy (in-process, or over HTTP
        for dispatched and fleet workers), and no agent episodes (the gateway does not carry them)."""
        mode = self.rl.trainer.routing_replay
        if mode == "off":
            return
        if not self.model.moe.num_experts:
            raise ConfigError(f"rl.trainer.routing_replay={mode} replays MoE routing, but the model is dense "
                              f"(model.moe.num_experts=0); set rl.trainer.routing_replay=off")
        agents = sorted(d for d, c in self.envs.domains.items() if c.agent)
        if agents:
            raise ConfigError(f"rl.trainer.routing_replay={mode} with agent episodes (envs.domains {agents} have "
                              f"an agent): the gateway that serves a black-box agent records its tokens but not "
                              f"the experts they were routed to, so those episodes would train with the trainer's "
                              f"own routing; set routing_replay=off, or drop the domains' agent")
        tc = self.rl.trainer
        old = "recompute" if self.rl.correction() != "none" else tc.old_logprobs  # as loop.job.trainer_config
        if mode == "logprobs" and old != "recompute" and not tc.reference:
            raise ConfigError("rl.trainer.routing_replay=logprobs replays the forward-only log-prob passes, but this "
                              "run has none (rl.trainer.old_logprobs=behaviour, no reference model): it would "
                              "change nothing; use routing_replay=everywhere, or old_logprobs=recompute")

    def _check_vllm(self) -> None:
        """engine.backend=vllm: what the vLLM backend serves (an HF folder, one replica per trainer rank of a
        TP=PP=CP=EP=1 layout; in-process, dispatched or fleet episodes with the colocated server; no routing
        replay), then its environment (a missing one or another vLLM version refused here, before any rank
        starts)."""
        if self.engine.backend != "vllm":
            return
        from megatron_rl.rollout.vllm_config import check_environment, check_transfer_device

        if not self.model.init.startswith("hf:"):
            raise ConfigError(f"engine.backend=vllm starts vLLM from an HF model folder: set model.init=hf:DIR "
                              f"(got {self.model.init!r}); or use engine.backend=native")
        p = self.parallel
        if (p.tp, p.pp, p.cp, p.ep) != (1, 1, 1, 1):
            raise ConfigError(f"engine.backend=vllm needs parallel.tp=pp=cp=ep=1 (got tp={p.tp} pp={p.pp} cp={p.cp} "
                              f"ep={p.ep}): every trainer rank drives a vLLM engine of its own with the whole model; "
                              f"use engine.backend=native for a sharded trainer")
        if self.episodes.server == "separate":
            raise ConfigError("engine.backend=vllm serves dispatched and fleet episodes from the trainer rank's own "
                              "vLLM process (episodes.server=colocated); episodes.server=separate starts a rollout "
                              "server process that builds our engine and is fed from it, which a vLLM engine "
                              "(weights in its own process) cannot do: set episodes.server=colocated or "
                              "engine.backend=native")
        if self.rl.trainer.routing_replay != "off":
            raise ConfigError(f"rl.trainer.routing_replay={self.rl.trainer.routing_replay} needs the experts each "
                              f"token was routed to, which engine.backend=vllm does not return; set "
                              f"rl.trainer.routing_replay=off or engine.backend=native")
        check_transfer_device(self.engine.vllm)  # nccl without CUDA: names the setting and the fix
        check_environment(self.engine.vllm)  # names engine.vllm.python and the fix (scripts/setup_vllm.sh)

    def validate(self) -> None:
        from megatron_rl.rollout.model_runner import check_servable
        from megatron_rl.rollout.reshard import check_engine_layout

        self.model.check_parallel(self.parallel)
        self.model.check_training(self.parallel)
        check_servable(self.model)  # the rollout engine serves this policy (refused here, before any rank starts)
        check_engine_layout(self.parallel, self.model)  # and the weight sync reshards this layout into it
        if self.tokenizer.resolved_path(self.model):
            self.tokenizer.build(self.model)  # the HF tokenizer loads and its ids fit the model
        self.parallel.resolve(self.launch.nproc_per_node)
        if self.train.seq_length > self.model.max_seq_length:
            raise ConfigError(f"train.seq_length={self.train.seq_length} exceeds "
                              f"model.max_seq_length={self.model.max_seq_length}")
        if self.rl.max_new_tokens + 16 > self.model.max_seq_length:
            raise ConfigError(f"rl.max_new_tokens={self.rl.max_new_tokens} leaves no room for a prompt in "
                              f"model.max_seq_length={self.model.max_seq_length} (keep 16 tokens for it)")
        n = max(self.rl.group_size, self.eval.k)
        if n > self.engine.max_running:
            raise ConfigError(f"engine.max_running={self.engine.max_running} is below the samples of one prompt "
                              f"(rl.group_size={self.rl.group_size}, eval.k={self.eval.k}), which decode together; "
                              f"set engine.max_running >= {n}")
        self._resolve_domains()
        self._check_agents()
        self._check_warmup()
        if self.episodes.server == "separate" and self.parallel.tp != 1:
            raise ConfigError(f"episodes.server=separate sends the whole model from rank 0's engine and needs "
                              f"parallel.tp=1 (got tp={self.parallel.tp}); use episodes.server=colocated")
        self._check_routing_replay()
        check_teacher(self)  # the distillation teacher loads, tokenizes as the student and fits the layout
        self._check_vllm()
        self._check_export()
        self.lora.check_model(self.model, self.parallel)
        if self.monitor.alerts.mismatch_kl is not None:
            raise ConfigError(f"monitor.alerts.mismatch_kl={self.monitor.alerts.mismatch_kl} is set by the RL loop "
                              f"from rl.mismatch_alert_kl; set rl.mismatch_alert_kl instead")
        build_task_source(self.curriculum, self.data.domain, mixture=list(self.envs.domains))  # refused, naming the fix
