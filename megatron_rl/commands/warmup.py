"""The supervised warm-up phase of a run: verified reference solutions -> HDF5 shards -> Megatron-Core training.

`prepare_data` runs in the driver process (environments and sandboxes); `warmup_phase` runs on every rank
(`commands/train.py: rank_main`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from megatron_rl.prompts import prompt_ids
from megatron_rl.run_config import RunConfig

TRAIN_SHARD, HELDOUT_SHARD = "warmup-train.h5", "warmup-heldout.h5"
log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- driver
def _trajectory(tok, task, answer: str, reward, episode: str):
    from megatron_rl.data.shards import Trajectory

    prompt = prompt_ids(tok, task)
    response = [*tok.encode(answer), tok.eos_id]
    tokens = np.asarray(prompt + response, dtype=np.int32)
    mask = np.asarray([0] * len(prompt) + [1] * len(response), dtype=np.uint8)
    return Trajectory(tokens=tokens, logprobs=np.zeros(len(tokens), np.float32), loss_mask=mask,
                      prompt_len=len(prompt), reward=float(reward.total), group_id=0, policy_version_first=0,
                      policy_version_last=0, env=task.domain, task_id=task.id, episode_id=episode,
                      reward_components=dict(reward.components), provenance={"source": "reference solution"})


RECHECKS = 2
"""How many more times a failing reference answer is checked, alone, before it is left out."""


def prepare_data(cfg: RunConfig, run_dir: Path) -> dict:
    """Check each task's reference answer (and a corrupted one) with the environment's reward in the sandbox
    (concurrently, on the episode runner the RL phase uses); write the verified ones as shards. Returns counts.

    A reference answer that fails is checked again, alone, up to `RECHECKS` times: under load a sandbox's
    wall-clock limit can fail a correct solution, and the warm-up data must not depend on the machine's load.
    One that still fails is left out, counted (`unverified`) and named in a warning."""
    import megatron_rl.envs.sandbox.bwrap  # noqa: F401  (registers the default backend)
    from megatron_rl.data.shards import write_shard
    from megatron_rl.loop.job import episode_runner, task_lists
    from megatron_rl.prompts import environment

    tok, shard_dir = cfg.tokenizer.build(cfg.model), run_dir / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    runner = episode_runner(cfg, run_dir)  # the run's environments (envs.mixture.EnvFactory), as in RL
    tasks = task_lists(cfg)
    stats = {"checked": 0, "verified": 0, "rejected": 0, "rechecked": 0, "unverified": 0,
             "shard_dir": str(shard_dir)}
    unverified = []
    try:
        for split, n, name in (("train", cfg.data.train_tasks, TRAIN_SHARD),
                               ("heldout", cfg.data.heldout_tasks, HELDOUT_SHARD)):
            answers = [(t, environment(t.domain).reference_response(t)) for t in tasks[split][:n]]
            futs = [(t, a, runner.submit(t, a), runner.submit(t, environment(t.domain).reference_response(t, True)))
                    for t, a in answers if a is not None]
            trajs = []
            for task, answer, good_f, bad_f in futs:
                good, bad = good_f.result(), bad_f.result()
                for _ in range(RECHECKS if not _verified(good) else 0):
                    stats["rechecked"] += 1
                    good = runner.submit(task, answer).result()
                    if _verified(good):
                        break
                stats["checked"] += 1
                stats["rejected"] += int(bad.components.get("correct", 0.0) == 0.0)
                if _verified(good):
                    stats["verified"] += 1
                    trajs.append(_trajectory(tok, task, answer, good, f"warmup-{task.id}"))
                else:
                    unverified.append(f"{task.id} ({good.status}: {_why(good)})")
            write_shard(shard_dir / name, trajs)
            stats[f"{split}_samples"] = len(trajs)
    finally:
        runner.close()
    stats["unverified"], stats["unverified_tasks"] = len(unverified), unverified[:20]
    if unverified:
        log.warning("warm-up: %d reference solutions failed %d checks each and are left out: %s",
                    len(unverified), 1 + RECHECKS, "; ".join(unverified)[:2000])
    return stats


def _verified(reward) -> bool:
    return reward.valid and reward.components.get("correct", 0.0) == 1.0


def _why(reward) -> str:
    return ("; ".join(f"{k}: {v}" for k, v in reward.reasons.items()) or "no reason given")[:200]


# --------------------------------------------------------------------------------------------- ranks
def _batches(path: Path, seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """All samples of a shard as fixed-length tensors: tokens/labels/loss_mask [N, S]."""
    from megatron_rl.data.shards import read_shard

    trajs = read_shard(path)
    n, s = len(trajs), seq_length
    tokens = torch.full((n, s + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((n, s + 1), dtype=torch.float32)
    for i, t in enumerate(trajs):
        L = min(len(t.tokens), s + 1)
        tokens[i, :L] = torch.from_numpy(t.tokens[:L].astype(np.int64))
        mask[i, :L] = torch.from_numpy(t.loss_mask[:L].astype(np.float32))
    # position i predicts token i+1: inputs [N, S], labels [N, S], mask on the label side
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "loss_mask": mask[:, 1:].contiguous()}


def _microbatches(data: dict, index: torch.Tensor, mbs: int, device: torch.device) -> list[dict]:
    """Micro-batches of the samples `index`, on the rank's `device` (the model's; NCCL's)."""
    s = data["tokens"].shape[1]
    pos = torch.arange(s).unsqueeze(0)
    out = []
    for chunk in index.split(mbs):
        mb = {k: v[chunk].to(device) for k, v in data.items()}
        mb["position_ids"] = pos.expand(len(chunk), s).to(device)
        out.append(mb)
    return out


def make_loss_fn(global_tokens: float, scale: float):
    """Masked next-token NLL as a sum over this micro-batch's loss tokens / global_tokens, times `scale`
    (num_microbatches * dp, which Megatron's schedule and DDP divide out), so the step's gradient is that of
    the mean over every loss token of the global batch, however it is split."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    def loss_fn(logits: torch.Tensor, batch: dict):
        # logits: [b, s, V/tp] -> per-token NLL [b, s]
        nll = vocab_parallel_cross_entropy(logits.float().contiguous(), batch["labels"])
        tok_sum = (nll * batch["loss_mask"]).sum()
        return tok_sum / global_tokens * scale, {"loss_sum": tok_sum.detach(), "tokens": batch["loss_mask"].sum()}

    return loss_fn


def _global_tokens(mbs: list[dict], dp_group, device: torch.device) -> float:
    t = torch.tensor([sum(float(m["loss_mask"].sum()) for m in mbs)], device=device)
    torch.distributed.all_reduce(t, group=dp_group)
    return max(float(t.item()), 1.0)


def _from_last_stage(metrics: dict, keys: tuple[str, ...], pp_group, dp_group, device: torch.device) -> dict:
    """Sum `keys` over data-parallel ranks, taken from the last pipeline stage, known on every rank."""
    t = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, group=pp_group)  # only the last stage holds non-zero values
    torch.distributed.all_reduce(t, group=dp_group)
    return dict(zip(keys, t.tolist()))


def _run_step(policy, data, index, cfg, ctx, forward_only: bool) -> dict:
    mbs = _microbatches(data, index, cfg.train.micro_batch_size, ctx.device)
    n_tok = _global_tokens(mbs, ctx.pgs.dp, ctx.device)
    loss_fn = make_loss_fn(n_tok, len(mbs) * ctx.parallel.dp)
    run = policy.evaluate if forward_only else policy.train_step
    raw = run(mbs, loss_fn, cfg.train.seq_length)
    m = _from_last_stage(raw, ("loss_sum", "tokens"), ctx.pgs.pp, ctx.pgs.dp, ctx.device)
    out = {"loss": m["loss_sum"] / max(m["tokens"], 1.0), "tokens": m["tokens"]}
    if not forward_only:
        out.update(grad_norm=raw.get("grad_norm"), lr=policy.optimizer.param_groups[0]["lr"])
    return out


# ------------------------------------------------------------------------------ warm-up checkpoints
def warmup_latest(run_dir: Path) -> Path | None:
    """The newest complete warm-up checkpoint when the run's pointer names one (trainer/latest.py), or None."""
    from megatron_rl.trainer.latest import latest

    return latest(run_dir, "warmup")


def _save_warmup(policy, run_dir: Path, step: int, is_rank0: bool) -> Path:
    """Checkpoint the warm-up after `step` steps (model, optimizer, scheduler, RNG; trainer/checkpoint.py);
    only the newest is kept (it exists to resume the warm-up; the RL phase checkpoints itself)."""
    import shutil

    from megatron_rl.trainer.checkpoint import save_checkpoint
    from megatron_rl.trainer.latest import write_latest

    root = Path(run_dir) / "checkpoints" / "warmup"
    name = f"step-{step:06d}"
    save_checkpoint(policy, root / name, extra={"phase": "warmup", "step": step})
    torch.distributed.barrier()
    if is_rank0:
        write_latest(run_dir, root / name)
        for old in root.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    torch.distributed.barrier()
    return root / name


def _resume_warmup(policy, run_dir: Path) -> tuple[int, Path | None]:
    """Load the latest warm-up checkpoint into `policy`; (steps already done, its path), or (0, None)."""
    from megatron_rl.trainer.checkpoint import load_checkpoint

    path = warmup_latest(run_dir)
    if path is None:
        return 0, None
    return int(load_checkpoint(policy, path)["step"]), path


# --------------------------------------------------------------------------------------- the phase
def warmup_phase(cfg: RunConfig, run_dir: Path, ctx, stop=None, monitor=None):
    """Supervised training on the verified solutions, resumed from its latest checkpoint if there is one
    (same data order: the sampler is replayed up to that step). Checkpoints every train.checkpoint_every steps,
    at the end, and when `stop` (driver.StopFlag) reports a signal. Returns (the Policy, the stop reason or
    None); (None, reason) when stopped before its end. Rows go to `monitor` (the run's `Monitor`, shared with the
    RL phase; one of its own, closed at the end, when None)."""
    from megatron_rl.loop.job import monitor_config, new_policy
    from megatron_rl.monitoring import Monitor

    tok = cfg.tokenizer.build(cfg.model)
    train = _batches(run_dir / "shards" / TRAIN_SHARD, cfg.train.seq_length, tok.pad_id)
    held = _batches(run_dir / "shards" / HELDOUT_SHARD, cfg.train.seq_length, tok.pad_id)
    policy = new_policy(cfg, ctx, "warmup")
    start, resumed = _resume_warmup(policy, run_dir)
    per_step, steps, every = cfg.train.micro_batch_size * cfg.train.num_microbatches, cfg.train.steps, \
        cfg.train.checkpoint_every
    gen = torch.Generator().manual_seed(cfg.seed)
    dp_rank, dp = torch.distributed.get_rank(ctx.pgs.dp), ctx.parallel.dp

    def draw() -> torch.Tensor:  # one step's sample indices [per_step * dp], the same on every rank
        return torch.randint(len(train["tokens"]), (per_step * dp,), generator=gen)

    for _ in range(start):
        draw()  # the data order of the steps already done
    own = monitor is None
    monitor = Monitor(monitor_config(cfg), run_dir, ctx.rank == 0) if own else monitor
    monitor.restart_clock()  # the warm-up rows' time_s counts from here, as before
    log = _Rows(monitor, print_every=max(1, steps // 30))
    if resumed is not None:
        log.note(f"resumed the warm-up from {resumed} at step {start}", kind="resume", step=start,
                 phase="warmup", checkpoint=str(resumed))
    held_mine = torch.arange(len(held["tokens"]))[dp_rank::dp]
    for step in range(start, steps):
        if step % cfg.train.eval_every == 0:
            log.write("sft_eval", step, _run_step(policy, held, held_mine, cfg, ctx, True))
        mine = draw()[dp_rank * per_step:(dp_rank + 1) * per_step]
        log.write("sft", step, _run_step(policy, train, mine, cfg, ctx, False))
        reason = stop.agreed(None, ctx.device) if stop is not None else None
        if step + 1 < steps and (reason or (every and (step + 1) % every == 0)):
            path = _save_warmup(policy, run_dir, step + 1, ctx.rank == 0)
            if reason:
                log.note(f"stopped after warm-up step {step} ({reason}); checkpoint saved in {path}, rerun the "
                         "same command to resume")
                if own:
                    monitor.close()
                return None, reason
    if start < steps:
        log.write("sft_eval", steps, _run_step(policy, held, held_mine, cfg, ctx, True))
        _save_warmup(policy, run_dir, steps, ctx.rank == 0)
    reason = stop.agreed(None, ctx.device) if stop is not None else None
    if reason:
        log.note(f"stopped after the warm-up ({reason}); checkpoint saved, rerun the same command to resume")
    if own:
        monitor.close()
    return policy, reason


class _Rows:
    """The warm-up's rows through the run's `Monitor` (metrics.jsonl, TensorBoard, W&B, Prometheus) and its
    console lines (rank 0: every eval row, every `print_every`-th sft row)."""

    def __init__(self, monitor, print_every: int = 1):
        self.monitor, self.print_every = monitor, print_every

    def write(self, kind: str, step: int, metrics: dict) -> None:
        self.monitor.log(kind, step, metrics)
        if not self.monitor.active or (kind == "sft" and step % self.print_every):
            return
        extra = f" grad_norm {metrics['grad_norm']:.3f}" if metrics.get("grad_norm") is not None else ""
        print(f"[megatron-rl] {kind:5s} step {step:4d} loss {metrics['loss']:.4f}{extra}", flush=True)

    def note(self, msg: str, kind: str | None = None, step: int = 0, **fields) -> None:
        """Print `msg` (rank 0); with `kind`, also log a row {kind, step, **fields} (e.g. a resume marker)."""
        if kind is not None:
            self.monitor.log(kind, step, fields)
        if self.monitor.active:
            print(f"[megatron-rl] {msg}", flush=True)
