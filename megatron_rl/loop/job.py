"""One assembly place: `build(cfg, run_dir, ctx) -> Job`, everything one RL step touches on this rank (policy,
trainer, engine, episode runner, sampler, monitor, weight sync) for the train loop (`megatron_rl/driver.py`); its
pieces (`build_engine`, `episode_runner`, `rollouts_for`, `task_lists`, `monitor_config`) also assemble
`megatron-rl eval` and the warm-up. The loop's per-step helpers live by idea: `loop/handoff.py` (the step's
shard), `loop/metrics.py` (the step's row), `loop/evaluation.py` (held-out success)."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Union

import torch

from megatron_rl.config import ConfigError
from megatron_rl.prompts import prompt_ids
from megatron_rl.run_config import RunConfig
from megatron_rl.tokenizer import Tokenizer

if TYPE_CHECKING:
    from megatron_rl.distributed import DistContext
    from megatron_rl.envs.base import Task
    from megatron_rl.envs.sampler import DomainSampler
    from megatron_rl.loop.episodes import ThreadEpisodeRunner
    from megatron_rl.monitoring import Monitor
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.rollout.vllm_engine import VLLMEngine
    from megatron_rl.trainer.policy import Policy
    from megatron_rl.trainer.rl_step import RLTrainer

Engine = Union["RolloutEngine", "VLLMEngine"]
"""The rollout engine of a rank: the native in-process one, or a vLLM process (engine.backend)."""
WeightSyncFn = Callable[["Engine", int, Iterable], None]
"""(engine, version, the trainer's named tensors) -> None: rollout/reshard.WeightSync, or the vLLM reload."""


def task_lists(cfg: RunConfig) -> dict:
    """Tasks: train and heldout of data.domain (the warm-up's), rl (the RL loop's, per domain of the mixture)
    and eval (every held-out task of every domain of the mixture, in order: `fitting` keeps the first
    eval.tasks of each domain among those whose prompt fits)."""
    source = cfg.task_source()  # data.domain's generated tasks (`curriculum:`), None: its shipped suite
    if source is not None:
        heldout = source.generate(cfg.data.heldout_tasks, cfg.seed, "heldout")
        return {"train": source.generate(cfg.data.train_tasks, cfg.seed, "train"), "heldout": heldout,
                "rl": {cfg.data.domain: source.generate(source.rl_tasks, cfg.seed, "rl")},
                "eval": heldout, "levels": {}}
    from megatron_rl.envs.tasks import load_domain

    evals = cfg.envs.tasks("heldout")
    return {"train": load_domain(cfg.data.domain, split="train")[:cfg.data.train_tasks],
            "heldout": load_domain(cfg.data.domain, split="heldout")[:cfg.data.heldout_tasks],
            "rl": {d: ts for d, ts in cfg.envs.tasks("train").items() if cfg.envs.domains[d].weight > 0},
            "eval": [t for ts in evals.values() for t in ts],
            "levels": cfg.envs.level_tasks()}  # domain -> train tasks per difficulty level (envs.domains.<d>.levels)


def fitting(tasks: dict, tok, cfg: RunConfig, say: bool = False) -> dict:
    """The RL and eval tasks whose prompt leaves room for a turn of rl.max_new_tokens in model.max_seq_length
    (the others are left out and counted); a domain with no RL task left is refused, naming the fix; eval: the
    first eval.tasks held-out tasks of each domain among those that fit (`eval_fitting`)."""
    room = cfg.model.max_seq_length - cfg.rl.max_new_tokens
    fits = lambda ts: [t for t in ts if len(prompt_ids(tok, t)) <= room]  # noqa: E731
    rl = {d: fits(ts) for d, ts in tasks["rl"].items()}
    out = {**tasks, "rl": rl, "eval": eval_fitting(tasks["eval"], tok, cfg, say), "levels": {}}
    for d, lv in tasks.get("levels", {}).items():  # a domain climbs up to its first level with no fitting task
        kept = list(itertools.takewhile(bool, (fits(ts) for ts in lv)))
        if say and len(kept) < len(lv):
            print(f"[megatron-rl] {d}: difficulty levels {len(kept)}.. left out (no prompt shorter than {room} "
                  f"tokens)", flush=True)
        if kept:
            out["levels"][d] = kept
    for d, ts in rl.items():
        if not ts:
            raise ConfigError(f"envs.domains.{d}: no task's prompt fits model.max_seq_length={cfg.model.max_seq_length}"
                              f" with rl.max_new_tokens={cfg.rl.max_new_tokens}; raise max_seq_length")
        if say and len(ts) < len(tasks["rl"][d]):
            print(f"[megatron-rl] {d}: {len(tasks['rl'][d]) - len(ts)} of {len(tasks['rl'][d])} tasks left out "
                  f"(prompt longer than {room} tokens)", flush=True)
    return out


def eval_fitting(heldout: list, tok, cfg: RunConfig, say: bool = False) -> list:
    """The first eval.tasks tasks of each domain of `heldout` (in its order, so deterministic) among those whose
    prompt leaves room for rl.max_new_tokens; `say`: name the domains with fewer (their eval row's
    <domain>/tasks says how many) and warn about those with none (no eval row: they still train)."""
    room, want = cfg.model.max_seq_length - cfg.rl.max_new_tokens, cfg.eval.tasks
    by_domain: dict[str, list] = {}
    for t in heldout:
        by_domain.setdefault(t.domain, []).append(t)
    out, none = [], []
    for d, ts in by_domain.items():
        kept = list(itertools.islice((t for t in ts if len(prompt_ids(tok, t)) <= room), want))
        out += kept
        if not kept:
            none.append(d)
        elif say and len(kept) < want:
            print(f"[megatron-rl] {d}: eval on {len(kept)} of eval.tasks={want} held-out tasks (of its {len(ts)}, "
                  f"the others' prompts are longer than {room} tokens)", flush=True)
    if say and none:
        print(f"[megatron-rl] WARNING: no held-out prompt of {', '.join(none)} fits {room} tokens "
              f"(model.max_seq_length - rl.max_new_tokens): no eval row for them; raise envs.domains.<domain>."
              f"heldout_tasks (more candidates) or model.max_seq_length", flush=True)
    return out


def task_key(task) -> str:
    """A task's id in checkpoints (ids are unique within a domain only)."""
    return f"{task.domain}/{task.id}"


@dataclass
class Job:
    """Everything one RL step touches on this rank, built by `build`."""

    cfg: RunConfig
    """The run's resolved config."""
    ctx: DistContext
    """This rank's process groups and device."""
    tok: Tokenizer
    """The model's tokenizer."""
    policy: Policy
    """The trainer's model, optimizer and schedule (Megatron-Core)."""
    trainer: RLTrainer
    """The RL update (advantages, loss, KL reference, critic, teacher)."""
    engine: Engine
    """The rollout engine: in-process (native) or this rank's vLLM process."""
    runner: ThreadEpisodeRunner | None
    """The episode thread pool of a rank that scores episodes (`scores_episodes`), else None."""
    sampler: DomainSampler
    """The mixture's task sampler (weights, curriculum, difficulty levels)."""
    heldout: list[Task]
    """The held-out eval tasks of every domain of the mixture."""
    tasks_by_id: dict[str, Task]
    """Every task of the run by `task_key` (a checkpointed rollout buffer names its tasks)."""
    monitor: Monitor
    """The run's monitor (shared with the warm-up when it ran in this process)."""
    is_rank0: bool
    """This rank is the job's rank 0 (it writes the logs)."""
    sync: WeightSyncFn | None = None
    """The weight sync from the trainer's layout into the engine's (rollout/reshard.py)."""
    sync_stats: dict = dataclasses.field(default_factory=dict)
    """The last weight sync of this rank: sync_bytes (the tensors it passed in, its TP slice), sync_s, and with
    LoRA sync_adapter_bytes (what an engine serving adapters would need instead of the merged weights)."""

    def prompt_fn(self, task) -> list[int]:
        return prompt_ids(self.tok, task)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        close_engine(self.engine)
        self.monitor.close()


def worker_config(cfg: RunConfig, run_dir: Path):
    """What every dispatched or fleet worker runs with: sandbox, tokenizer, the run's mixture (`envs`: budgets,
    rewards, agents, the LLM judge with its cache in <run_dir>/judge_cache, which the workers share), from which
    each worker builds its environments as the driver does (`envs.mixture.EnvFactory`); the generator's url is
    set at dispatch. The domains' images are built here, once, into the shared store (`worker_images`)."""
    from megatron_rl.dispatch import GeneratorConfig, WorkerConfig

    gen = GeneratorConfig(kind="http", url="http://unset", max_new_tokens=cfg.rl.max_new_tokens,  # url: at dispatch
                          routed_experts=cfg.rl.trainer.routing_replay != "off")  # MoE routing replay
    mixture = dataclasses.replace(cfg.envs, judge_cache_dir=judge_cache_dir(cfg, run_dir))
    return WorkerConfig(generator=gen, sandbox=cfg.data.sandbox_config(), threads=cfg.episodes.worker_threads,
                        max_tokens=cfg.model.max_seq_length, vocab_size=cfg.model.vocab_size,
                        tokenizer=cfg.tokenizer.resolved_path(cfg.model), envs=mixture,
                        images=cfg.envs.worker_images(), store=cfg.episodes.store, s3=cfg.episodes.s3,
                        checkpoint_turns=cfg.episodes.checkpoint_turns)


def judge_cache_dir(cfg: RunConfig, run_dir: Path) -> str:
    """The run's judge cache (envs.judge_cache_dir, else <run_dir>/judge_cache), absolute: the driver's and the
    workers' judges share it."""
    return os.path.abspath(cfg.envs.judge_cache_dir or str(Path(run_dir) / "judge_cache"))


def make_rollouts(job: Job, run_dir: Path):
    """The run's rollouts (`rollouts_for`)."""
    return rollouts_for(job.cfg, job.ctx, job.engine, job.runner, job.tok, job.prompt_fn, run_dir)


def rollouts_for(cfg: RunConfig, ctx, engine, runner, tok, prompt_fn, run_dir: Path):
    """In-process rollouts, or dispatched episodes (`episodes.runner: dispatch | fleet`, loop/dispatched.py), for
    the train loop and `megatron-rl eval` alike."""
    from megatron_rl.loop.rollout import Rollouts

    if cfg.episodes.runner == "inprocess":
        return Rollouts(engine, runner, tok, prompt_fn, cfg.rl, cfg.seed,
                        max_tokens=cfg.model.max_seq_length, replica_group=ctx.pgs.tp,  # an engine per TP group
                        group=ctx.world)
    from megatron_rl.loop.dispatched import DispatchRollouts

    server = None
    if cfg.episodes.server == "separate" and ctx.rank == 0:
        from megatron_rl.loop.dispatched import RolloutServerProcess, server_hosts

        server = RolloutServerProcess(run_dir, cfg.model, cfg.engine, cfg.episodes.server_threads,
                                      server_hosts(cfg.episodes), tokenizer_cfg=cfg.tokenizer,
                                      record_routes=cfg.rl.trainer.routing_replay != "off")
    return DispatchRollouts(engine, runner, tok, prompt_fn, cfg.rl, cfg.seed, cfg.episodes, worker_config(cfg, run_dir),
                            Path(run_dir), ctx.pgs.tp, server, max_tokens=cfg.model.max_seq_length, group=ctx.world)


def trainer_config(cfg: RunConfig, valid_vocab: int | None = None):
    tc = copy.deepcopy(cfg.rl.trainer)
    tc.temperature, tc.valid_vocab = cfg.rl.temperature, valid_vocab
    if cfg.rl.correction() != "none":
        tc.loss.is_correction, tc.old_logprobs = cfg.rl.correction(), "recompute"
    return tc


def monitor_config(cfg: RunConfig):
    """The run's monitor config with the loop's alert thresholds (rl.mismatch_alert_kl -> the mismatch rule)."""
    alerts = dataclasses.replace(cfg.monitor.alerts, mismatch_kl=cfg.rl.mismatch_alert_kl)
    return dataclasses.replace(cfg.monitor, alerts=alerts)


MODEL_INIT = "model.init"
"""`new_policy`'s default init: the weights model.init names (random when it is empty)."""


def new_policy(cfg: RunConfig, ctx: DistContext, phase: Literal["warmup", "rl"], init=MODEL_INIT) -> Policy:
    """The trainer's model, optimizer and schedule in the run's layout, for the `warmup` (optim, train.steps, no
    LoRA) or the `rl` phase (rl.optim, rl.steps, lora; eval builds this one too). `init`: MODEL_INIT, a
    `Policy` init (the warm-up's weights) or None (random: a checkpoint is loaded next)."""
    from megatron_rl.convert.source import initializer
    from megatron_rl.trainer.policy import Policy

    init = initializer(cfg.model) if init is MODEL_INIT else init
    if phase == "warmup":
        return Policy(cfg.model, cfg.optim, ctx, total_steps=cfg.train.steps, init=init)
    return Policy(cfg.model, cfg.rl.optim, ctx, total_steps=max(cfg.rl.steps, 1), init=init, lora=cfg.lora)


def build(cfg: RunConfig, run_dir: Path, ctx: DistContext, warm_policy: Policy | None = None,
          monitor: Monitor | None = None) -> Job:
    """The RL phase's Job on this rank (collective: every rank builds its share); `warm_policy`: the warm-up's
    policy when it ran in this process (its weights start the RL policy), `monitor`: the run's, when the
    warm-up already logged through it."""
    from megatron_rl.envs.sampler import DomainSampler
    from megatron_rl.monitoring import Monitor
    from megatron_rl.trainer.rl_step import RLTrainer
    from megatron_rl.trainer.teacher import load_teacher

    tok = cfg.tokenizer.build(cfg.model)
    tasks, rank0 = fitting(task_lists(cfg), tok, cfg, say=ctx.rank == 0), ctx.rank == 0
    warm = warm_init(warm_policy) if warm_policy is not None else None
    t0 = time.monotonic()
    policy = new_policy(cfg, ctx, "rl", init=warm if warm is not None else MODEL_INIT)
    engine, sync = build_engine(cfg, ctx, tok.vocab_size, run_dir)
    if rank0:
        source = "the warm-up's weights" if warm is not None else cfg.model.init or "random weights"
        print(f"[megatron-rl] policy ({source}, {cfg.model.num_layers} layers) and rollout engine ready in "
              f"{time.monotonic() - t0:.0f} s; {sum(map(len, tasks['rl'].values()))} RL tasks, "
              f"{len(tasks['eval'])} held-out eval tasks", flush=True)
    runner = episode_runner(cfg, run_dir) if scores_episodes(cfg, ctx) else None
    levels = tasks["levels"]  # the difficulty levels of the domains that climb them (envs.domains.<d>.levels)
    sampler = DomainSampler(tasks["rl"], {d: cfg.envs.domains[d].weight for d in tasks["rl"]}, seed=cfg.seed,
                            curriculum=cfg.envs.curriculum, levels=levels)
    by_id = {task_key(t): t for split in ("train", "heldout", "eval") for t in tasks[split]}
    by_id.update({task_key(t): t for ts in tasks["rl"].values() for t in ts})
    by_id.update({task_key(t): t for lv in levels.values() for ts in lv for t in ts})
    monitor = monitor or Monitor(monitor_config(cfg), run_dir, rank0)  # the warm-up's, when it ran before
    monitor.restart_clock()  # the RL rows' time_s counts from here, as before the Monitor was shared
    monitor.expect("rl", cfg.rl.steps)
    monitor.set_domains(cfg.envs.domains)  # summarised on the console and in TensorBoard
    trainer = RLTrainer(policy, trainer_config(cfg, tok.vocab_size), teacher=load_teacher(cfg, policy))
    return Job(cfg, ctx, tok, policy, trainer, engine, runner, sampler, tasks["eval"], by_id, monitor, rank0, sync)


@dataclass
class EvalJob:
    """What `megatron-rl eval` runs on this rank (`build_eval`): a policy's weights synced into an engine, the
    episode runner on rank 0."""

    tok: Tokenizer
    """The model's tokenizer."""
    policy: Policy
    """The evaluated weights (a checkpoint's, or model.init's)."""
    engine: Engine
    """The rollout engine, holding the policy's weights."""
    runner: ThreadEpisodeRunner | None
    """Rank 0's episode thread pool; None on the other ranks."""
    is_rank0: bool
    """This rank is the job's rank 0 (it scores and writes the report)."""


def build_eval(cfg: RunConfig, run_dir: Path, ctx: DistContext, checkpoint: Path | None) -> EvalJob:
    """The RL policy from `checkpoint` (None: model.init's weights; a LoRA checkpoint holds adapters only, its
    base comes from model.init) synced into the engine; the same builders as `build`."""
    from megatron_rl.trainer.checkpoint import load_checkpoint

    policy = new_policy(cfg, ctx, "rl", init=None if checkpoint and not cfg.lora.enabled else MODEL_INIT)
    if checkpoint is not None:
        load_checkpoint(policy, checkpoint)
    rank0, tok = ctx.rank == 0, cfg.tokenizer.build(cfg.model)
    engine, sync = build_engine(cfg, ctx, tok.vocab_size, run_dir)
    sync(engine, policy.step_count, policy.global_named_tensors())
    return EvalJob(tok, policy, engine, episode_runner(cfg, run_dir) if rank0 else None, rank0)


def warm_init(warm_policy):
    """The `Policy` init that hands the warm-up's weights to the RL policy: the k-th chunk built gets the
    warm-up's k-th chunk (virtual-pipeline chunks hold different layers; loading chunk 0 into all was wrong)."""
    states = iter([c.module.state_dict() for c in warm_policy.chunks])

    def init(model) -> None:
        state = next(states, None)
        if state is None:
            raise ValueError(f"the RL policy has more model chunks than the warm-up's {len(warm_policy.chunks)}: "
                             "keep parallel.pp/vpp the same for both phases")
        model.load_state_dict(state)
    return init


def build_engine(cfg: RunConfig, ctx, valid_vocab: int, run_dir: Path | None = None):
    """The in-process engine in its own layout (TP only: the whole model on every rank) and the weight sync
    that reshards the trainer's layout into it (collective: every rank); with engine.backend=vllm, this rank's
    vLLM engine process (its log in <run_dir>/vllm) and the sync that converts to HF names and reloads it."""
    if cfg.engine.backend == "vllm":
        return build_vllm_engine(cfg, ctx, valid_vocab, run_dir)
    from megatron_rl.rollout import RolloutEngine
    from megatron_rl.rollout.reshard import WeightSync, engine_layout

    par, pgs = engine_layout(ctx)
    engine = RolloutEngine.build(cfg.model, cfg.engine, par, pgs, valid_vocab=valid_vocab,
                                 record_routes=cfg.rl.trainer.routing_replay != "off",  # MoE routing replay
                                 device=ctx.device)
    return engine, WeightSync(ctx, pgs)


def build_vllm_engine(cfg: RunConfig, ctx, valid_vocab: int, run_dir: Path | None = None):
    """This rank's vLLM engine (every rank of a TP=1 run is a replica of its own) and its weight sync: the
    trainer's whole model (PP = EP = 1: every tensor on every rank) converted and reloaded, checked complete."""
    from megatron_rl.rollout.vllm_engine import VLLMEngine, dtype_name

    log_dir = Path(run_dir) / "vllm" if run_dir is not None else None
    engine = VLLMEngine(cfg.engine.vllm, cfg.engine, cfg.model.init, cfg.model.max_seq_length,
                        dtype_name(cfg.engine.dtype, cfg.model.params_dtype), valid_vocab, log_dir)
    return engine, lambda eng, version, named: eng.update_weights(version, named, complete=True)


def close_engine(engine) -> None:
    """Stop an engine that runs in a process of its own (engine.backend=vllm); nothing for the native one."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def scores_episodes(cfg: RunConfig, ctx) -> bool:
    """This rank runs episodes: in-process, every engine replica's leader (TP rank 0; loop/rollout.py);
    dispatched, rank 0."""
    if cfg.episodes.runner == "inprocess":
        return torch.distributed.get_rank(ctx.pgs.tp) == 0
    return ctx.rank == 0


def episode_runner(cfg: RunConfig, run_dir: Path):
    """Rank 0's thread pool of episodes: environments of the mixture, each with its reward weights and budget."""
    from megatron_rl.loop.episodes import ThreadEpisodeRunner

    factory = cfg.envs.factory(cfg.model.max_seq_length, judge=cfg.envs.judge(str(run_dir)))
    return ThreadEpisodeRunner(cfg.data.sandbox_config(), cfg.data.episode_workers, make_env=factory,
                               max_tokens=lambda name: factory.budget(name).max_tokens)


def sync_weights(job: Job, rollouts, version: int) -> None:
    """Reshard the trainer's weights into the engine (every layer and expert, checked complete), then push the
    engine's (rank 0's holds the whole model at TP=1) to a separate rollout server when there is one."""
    t0, counted = time.perf_counter(), [0]
    job.sync(job.engine, version, _counting(job.policy.global_named_tensors(), counted))
    rollouts.push_weights(version, engine_weights(job.engine))
    job.sync_stats = {"sync_bytes": float(counted[0]), "sync_s": time.perf_counter() - t0}
    if getattr(job.policy, "lora", None) is not None:
        from megatron_rl.trainer.lora import adapter_bytes

        job.sync_stats["sync_adapter_bytes"] = float(sum(adapter_bytes(c.module) for c in job.policy.chunks))


def _counting(named, counted: list):
    """`named` passed through, adding each tensor's bytes to counted[0]."""
    for name, t in named:
        counted[0] += t.numel() * t.element_size()
        yield name, t


def engine_weights(engine):
    """The engine's weights by name: every parameter and the buffers the forward reads (the MoE expert bias)."""
    from megatron_rl.trainer.policy import FORWARD_BUFFERS

    yield from engine.model.named_parameters()
    for name, b in engine.model.named_buffers():
        if name.endswith(FORWARD_BUFFERS):
            yield name, b


def say(job: Job, msg: str) -> None:
    if job.is_rank0:
        print(f"[megatron-rl] {msg}", flush=True)
