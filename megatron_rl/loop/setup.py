"""The pieces the driver (`megatron_rl/driver.py`) wires together, and its per-step helpers."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_rl.config import ConfigError
from megatron_rl.data.shards import SEGMENT_MARK
from megatron_rl.prompts import prompt_ids
from megatron_rl.run_config import RunConfig
from megatron_rl.tokenizer import Tokenizer


def task_lists(cfg: RunConfig) -> dict:
    """Tasks: train and heldout of data.domain (the warm-up's), rl (the RL loop's, per domain of the mixture)
    and eval (held-out tasks of every domain of the mixture, eval.tasks each)."""
    if cfg.curriculum.enabled:
        from megatron_rl.envs.countdown.curriculum import generate

        heldout = generate(cfg.data.heldout_tasks, cfg.curriculum, cfg.seed, "heldout")
        return {"train": generate(cfg.data.train_tasks, cfg.curriculum, cfg.seed, "train"), "heldout": heldout,
                "rl": {"countdown": generate(cfg.curriculum.rl_tasks, cfg.curriculum, cfg.seed, "rl")},
                "eval": heldout[:cfg.eval.tasks], "levels": {}}
    from megatron_rl.envs.tasks import load_domain

    evals = cfg.envs.tasks("heldout")
    return {"train": load_domain(cfg.data.domain, split="train")[:cfg.data.train_tasks],
            "heldout": load_domain(cfg.data.domain, split="heldout")[:cfg.data.heldout_tasks],
            "rl": {d: ts for d, ts in cfg.envs.tasks("train").items() if cfg.envs.domains[d].weight > 0},
            "eval": [t for ts in evals.values() for t in ts[:cfg.eval.tasks]],
            "levels": cfg.envs.level_tasks()}  # domain -> train tasks per difficulty level (envs.domains.<d>.levels)


def fitting(tasks: dict, tok, cfg: RunConfig, say: bool = False) -> dict:
    """The RL and eval tasks whose prompt leaves room for a turn of rl.max_new_tokens in model.max_seq_length
    (the others are left out and counted); a domain with no task left is refused, naming the fix."""
    room = cfg.model.max_seq_length - cfg.rl.max_new_tokens
    fits = lambda ts: [t for t in ts if len(prompt_ids(tok, t)) <= room]  # noqa: E731
    rl = {d: fits(ts) for d, ts in tasks["rl"].items()}
    out = {**tasks, "rl": rl, "eval": fits(tasks["eval"]), "levels": {}}
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


def task_key(task) -> str:
    """A task's id in checkpoints (ids are unique within a domain only)."""
    return f"{task.domain}/{task.id}"


@dataclass
class Parts:
    cfg: RunConfig
    ctx: object
    tok: Tokenizer
    policy: object
    trainer: object
    engine: object
    runner: object
    sampler: object
    heldout: list
    tasks_by_id: dict
    monitor: object
    is_rank0: bool
    sync: object = None
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


def make_rollouts(parts: Parts, run_dir: Path):
    """The run's rollouts (`rollouts_for`)."""
    return rollouts_for(parts.cfg, parts.ctx, parts.engine, parts.runner, parts.tok, parts.prompt_fn, run_dir)


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


def build(cfg: RunConfig, run_dir: Path, ctx, warm_policy=None, monitor=None) -> Parts:
    from megatron_rl.convert.source import initializer
    from megatron_rl.envs.sampler import DomainSampler
    from megatron_rl.monitoring import Monitor
    from megatron_rl.trainer.policy import Policy
    from megatron_rl.trainer.rl_step import RLTrainer
    from megatron_rl.trainer.teacher import load_teacher

    tok = cfg.tokenizer.build(cfg.model)
    tasks, rank0 = fitting(task_lists(cfg), tok, cfg, say=ctx.rank == 0), ctx.rank == 0
    warm = warm_init(warm_policy) if warm_policy is not None else None
    t0 = time.monotonic()
    policy = Policy(cfg.model, cfg.rl.optim, ctx, total_steps=max(cfg.rl.steps, 1),
                    init=warm if warm is not None else initializer(cfg.model), lora=cfg.lora)
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
    return Parts(cfg, ctx, tok, policy, trainer,
                 engine, runner, sampler, tasks["eval"], by_id, monitor, rank0, sync)


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


def sync_weights(parts: Parts, rollouts, version: int) -> None:
    """Reshard the trainer's weights into the engine (every layer and expert, checked complete), then push the
    engine's (rank 0's holds the whole model at TP=1) to a separate rollout server when there is one."""
    t0, counted = time.perf_counter(), [0]
    parts.sync(parts.engine, version, _counting(parts.policy.global_named_tensors(), counted))
    rollouts.push_weights(version, engine_weights(parts.engine))
    parts.sync_stats = {"sync_bytes": float(counted[0]), "sync_s": time.perf_counter() - t0}
    if getattr(parts.policy, "lora", None) is not None:
        from megatron_rl.trainer.lora import adapter_bytes

        parts.sync_stats["sync_adapter_bytes"] = float(sum(adapter_bytes(c.module) for c in parts.policy.chunks))


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


def say(parts: Parts, msg: str) -> None:
    if parts.is_rank0:
        print(f"[megatron-rl] {msg}", flush=True)


def eval_due(cfg: RunConfig, step: int) -> bool:
    return step == cfg.rl.steps - 1 or bool(cfg.eval.every and (step + 1) % cfg.eval.every == 0)


# ------------------------------------------------------------------------------------------ shards
def to_shard(parts: Parts, rollouts, groups: list, step: int, run_dir: Path):
    """Write the step's trajectories as an HDF5 shard (rank 0) and read it back on every rank, keeping samples
    within the staleness bound; None when the batch is empty."""
    from megatron_rl.data.shards import read_arrays, write_shard

    trajs = rollouts.trajectories(groups, tag=f"s{step}")
    path = Path(run_dir) / "rl_shards" / f"step-{step:06d}.h5"
    if trajs and parts.is_rank0:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_shard(path, trajs)
    torch.distributed.barrier(group=parts.ctx.world)
    if not trajs:
        return None
    cols = read_arrays(path)
    episode = cols.episode_index()  # [N] the rows of a split agent episode are kept or dropped together
    first = np.full(int(episode.max()) + 1, np.iinfo(np.int64).max)
    np.minimum.at(first, episode, np.asarray(cols.policy_version_first, np.int64))
    fresh = first[episode] >= step - parts.cfg.rl.max_staleness
    return cols if fresh.all() else cols.select(np.flatnonzero(fresh))


# ------------------------------------------------------------------------------------------ metrics
class Clock:
    """Wall time of a step's phases; generation and env-wait come from the rollouts' own timers."""

    def __init__(self, rollouts):
        self.rollouts, self.t0, self.cpu0 = rollouts, time.perf_counter(), _rank_cpu_s()
        self.start = dict(rollouts.timers)
        self.marks: dict[str, float] = {}
        self.last = self.t0

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.marks[name] = now - self.last
        self.last = now

    def summary(self) -> dict:
        total = time.perf_counter() - self.t0
        gen = self.rollouts.timers["generate_s"] - self.start["generate_s"]
        env = self.rollouts.timers["env_wait_s"] - self.start["env_wait_s"]
        train = self.marks.get("train", 0.0)
        return {"time_step_s": total, "time_generate_s": gen, "time_env_wait_s": env, "time_train_s": train,
                "time_sync_s": self.marks.get("sync", 0.0), "trainer_idle_frac": 1.0 - train / max(total, 1e-9),
                "cpu_step_s": _rank_cpu_s() - self.cpu0}


def _rank_cpu_s() -> float:
    """User + system CPU seconds of this rank (every thread: trainer, in-process engine, episode threads) and of
    its children that were waited for (sandboxes): summed over steps, the CPU cost of a run on this rank."""
    import resource

    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


TRAIN_KEYS = ("loss", "grad_norm", "clip_fraction", "approx_kl", "ref_kl", "entropy_mean", "behaviour_kl",
              "is_weight_mean", "samples", "update_skipped", "lr", "routing_mismatch_frac", "value_loss",
              "value_clip_fraction", "explained_variance", "value_mean", "value_grad_norm", "mtp_loss",
              "teacher_kl")


def step_metrics(parts: Parts, rollouts, cols, train: dict, sampling: dict, clock: Clock) -> dict:
    from megatron_rl.registry import plugin_failures

    domains = parts.sampler.metrics.summary(reset=True)
    m = {**domains, **sampling, **{k: train[k] for k in TRAIN_KEYS if train.get(k) is not None},
         **clock.summary()}
    counts = {k.rsplit("/", 1)[0]: v for k, v in domains.items() if k.endswith("/count")}  # names may hold '/'
    valid = {d: c * (1.0 - domains[f"{d}/infra_error_frac"]) for d, c in counts.items()}  # scored episodes
    m["reward_mean"] = sum(domains[f"{d}/reward_mean"] * c for d, c in valid.items()) / (sum(valid.values()) or 1.0)
    m["sandbox_error_rate"] = sum(c - valid[d] for d, c in counts.items()) / (sum(counts.values()) or 1.0)
    for d in parts.sampler.domains:  # every domain of the mixture, sampled this step or not
        if d not in counts:
            m.update({f"{d}/count": 0.0, f"{d}/reward_mean": None, f"{d}/turns_mean": None,
                      f"{d}/infra_error_frac": None})
    m.update({f"{d}/weight": p for d, p in parts.sampler.probabilities().items()})  # the next draws' (curriculum)
    m.update(parts.sampler.level_metrics())  # '<domain>/level' of the domains that climb difficulty levels
    if train.get("mismatch_kl") is not None:  # KL(engine's behaviour log-probs || trainer's, before the update)
        m["mismatch_kl"] = train["mismatch_kl"]
    m.update(_batch_metrics(cols, parts.engine.version - 1, clock))
    m.update(_runner_metrics(parts.runner))
    if getattr(parts.engine, "restarts", None) is not None:  # engine.backend=vllm: its process restarts so far
        m["vllm_restarts"] = parts.engine.restarts
    m.update(parts.sync_stats)  # bytes and seconds of the weight sync after this update
    m["plugins_failed"] = sum(plugin_failures().values())  # each logged with its reason when it failed
    return m


def _batch_metrics(cols, version: int, clock: Clock) -> dict:
    if cols is None:
        return {"trained_samples": 0}
    lengths = np.diff(np.asarray(cols.offsets)) - np.asarray(cols.prompt_len)  # [N] response tokens
    lag = version - np.asarray(cols.policy_version_first)
    gen = max(clock.summary()["time_generate_s"], 1e-9)
    return {**_agent_metrics(cols), "trained_samples": len(cols), "response_len_mean": float(lengths.mean()),
            "response_len_max": int(lengths.max()), "policy_lag_mean": float(lag.mean()),
            "policy_lag_max": int(lag.max()), "tokens_per_s": float(lengths.sum()) / gen,
            "mixed_version_samples": int((np.asarray(cols.policy_version_last)
                                          != np.asarray(cols.policy_version_first)).sum())}


def _agent_metrics(cols) -> dict:
    """Black-box agent episodes of the batch (envs.agents): calls per episode, and history splits (each one an
    extra row of its episode: an earlier exact segment, trained with it); {} without any."""
    t = cols.timings
    if "agent.calls" not in t:
        return {}
    return {"agent_calls_mean": float(np.nanmean(t["agent.calls"])),
            "agent_splits": float(np.nansum(t.get("agent.splits", 0.0))),
            "agent_segment_rows": int(sum(SEGMENT_MARK in str(e) for e in cols.episode_id))}


def _runner_metrics(runner) -> dict:
    if runner is None:
        return {}
    s = runner.stats()
    pending = s["submitted"] - s["finished"]
    return {"episodes_pending": pending, "episodes_stalled_s": time.monotonic() - s["last_finish"] if pending else 0.0}


# ------------------------------------------------------------------------------------------ evaluation
def evaluate(parts: Parts, rollouts, step: int) -> dict:
    """Held-out success of every domain of the mixture, logged as an `eval` row (rank 0; {} on other ranks)."""
    cfg = parts.cfg
    m = heldout_success(rollouts, parts.heldout, cfg, tag=f"eval{step}")
    if not parts.is_rank0:
        return {}
    parts.monitor.log("eval", step, m)
    say(parts, f"eval  step {step:3d}: held-out success greedy {m['success_greedy']:.3f}  pass@1 {m['pass@1']:.3f}"
               f"  pass@{cfg.eval.k} {m[f'pass@{cfg.eval.k}']:.3f}  ({m['tasks']} tasks)")
    return m


def heldout_success(rollouts, tasks: list, cfg: RunConfig, tag: str) -> dict:
    """Greedy success, pass@1 and pass@k (eval.k samples at the rollout temperature) on `tasks`, overall and per
    domain, each episode judged by its environment's own success definition (`Environment.success`) after the
    same episode loop as training (multi-turn included). Samples whose episode failed for an infrastructure
    reason are left out (counted in infra_error_frac), never scored as failures. Every rank runs the engine;
    rank 0 (the runner's) returns the metrics, the others {}."""
    return heldout_run(rollouts, tasks, cfg, tag)[0]


def heldout_run(rollouts, tasks: list, cfg: RunConfig, tag: str) -> tuple[dict, list[dict]]:
    """`heldout_success`'s metrics and one row per task (`megatron_rl.eval_report.task_rows`); ({}, []) off rank 0."""
    from megatron_rl.eval_report import task_rows
    from megatron_rl.rollout import SamplingParams

    tok = rollouts.tok
    greedy = [SamplingParams(temperature=0.0, max_new_tokens=cfg.rl.max_new_tokens, stop_token_ids=list(tok.stop_ids))
              for _ in tasks]
    sampled = [rollouts.params(10**7 + i, n=cfg.eval.k) for i in range(len(tasks))]
    t0 = time.perf_counter()
    groups = rollouts.run_now(tasks + tasks, greedy + sampled, tag=tag)
    if not rollouts.is_scorer:
        return {}, []
    n, out = len(tasks), {}
    solved = [_solved(g) for g in groups]  # per group: 0/1 per valid sample
    for d in sorted({t.domain for t in tasks}):
        idx = [i for i, t in enumerate(tasks) if t.domain == d]
        out.update({f"{d}/{k}": v for k, v in _success([solved[i] for i in idx], [solved[n + i] for i in idx],
                                                       cfg.eval.k).items()})
        out[f"{d}/turns_mean"] = float(np.mean([x for i in idx for x in groups[n + i].turns] or [0]))
    samples = [r for g in groups for r in g.rewards]
    rows = task_rows(tasks, solved[:n], solved[n:], [g.turns for g in groups[n:]], cfg.eval.k)
    return {**_success(solved[:n], solved[n:], cfg.eval.k), **out, "time_s": time.perf_counter() - t0,
            "infra_error_frac": float(np.mean([r[2] != "ok" for r in samples])) if samples else 0.0}, rows


def _solved(g) -> list[int]:
    from megatron_rl.envs.base import RewardResult
    from megatron_rl.prompts import environment

    env = environment(g.task.domain)
    return [int(env.success(RewardResult(r[0], dict(r[1]), status=r[2]))) for r in g.rewards if r[2] == "ok"]


def _success(greedy: list[list[int]], sampled: list[list[int]], k: int) -> dict:
    """Means over the tasks that have a valid sample (greedy and sampled separately)."""
    g, s = [c[0] for c in greedy if c], [c for c in sampled if c]
    return {"success_greedy": float(np.mean(g)) if g else 0.0, "pass@1": float(np.mean([np.mean(c) for c in s]))
            if s else 0.0, f"pass@{k}": float(np.mean([max(c) for c in s])) if s else 0.0, "tasks": len(greedy)}
