"""The supervised warm-up phase of a run: verified reference solutions -> HDF5 shards -> Megatron-Core training.

`prepare_data` runs in the driver process (environments and sandboxes); `worker_main` runs on every rank.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from megatron_rl.prompts import prompt_ids
from megatron_rl.run_config import RunConfig

TRAIN_SHARD, HELDOUT_SHARD = "warmup-train.h5", "warmup-heldout.h5"


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


def prepare_data(cfg: RunConfig, run_dir: Path) -> dict:
    """Check each task's reference answer (and a corrupted one) with the environment's reward in the sandbox
    (concurrently, on the episode runner the RL phase uses); write the verified ones as shards. Returns counts."""
    import envs.sandbox.bwrap  # noqa: F401  (registers the default backend)
    from megatron_rl.data.shards import write_shard
    from megatron_rl.loop.episodes import ThreadEpisodeRunner
    from megatron_rl.loop.setup import task_lists

    tok, shard_dir = cfg.tokenizer.build(cfg.model), run_dir / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    runner = ThreadEpisodeRunner(cfg.data.sandbox_config(), cfg.data.episode_workers)
    tasks = task_lists(cfg)
    stats = {"checked": 0, "verified": 0, "rejected": 0, "shard_dir": str(shard_dir)}
    try:
        for split, n, name in (("train", cfg.data.train_tasks, TRAIN_SHARD),
                               ("heldout", cfg.data.heldout_tasks, HELDOUT_SHARD)):
            answers = [(t, f"<answer>{t.payload['solution']}</answer>") for t in tasks[split][:n]]
            futs = [(t, a, runner.submit(t, a), runner.submit(t, a.replace("<answer>", "<answer>1 + ")))
                    for t, a in answers]
            trajs = []
            for task, answer, good_f, bad_f in futs:
                good, bad = good_f.result(), bad_f.result()
                stats["checked"] += 1
                stats["rejected"] += int(bad.components.get("correct", 0.0) == 0.0)
                if good.valid and good.components.get("correct", 0.0) == 1.0:
                    stats["verified"] += 1
                    trajs.append(_trajectory(tok, task, answer, good, f"warmup-{task.id}"))
            write_shard(shard_dir / name, trajs)
            stats[f"{split}_samples"] = len(trajs)
    finally:
        runner.close()
    return stats


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


def _microbatches(data: dict, index: torch.Tensor, mbs: int) -> list[dict]:
    s = data["tokens"].shape[1]
    pos = torch.arange(s).unsqueeze(0)
    out = []
    for chunk in index.split(mbs):
        mb = {k: v[chunk] for k, v in data.items()}
        mb["position_ids"] = pos.expand(len(chunk), s)
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


def _global_tokens(mbs: list[dict], dp_group) -> float:
    t = torch.tensor([sum(float(m["loss_mask"].sum()) for m in mbs)])
    torch.distributed.all_reduce(t, group=dp_group)
    return max(float(t.item()), 1.0)


def _from_last_stage(metrics: dict, keys: tuple[str, ...], pp_group, dp_group) -> dict:
    """Sum `keys` over data-parallel ranks, taken from the last pipeline stage, known on every rank."""
    t = torch.tensor([float(metrics.get(k, 0.0)) for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(t, group=pp_group)  # only the last stage holds non-zero values
    torch.distributed.all_reduce(t, group=dp_group)
    return dict(zip(keys, t.tolist()))


def _run_step(policy, data, index, cfg, ctx, forward_only: bool) -> dict:
    mbs = _microbatches(data, index, cfg.train.micro_batch_size)
    n_tok = _global_tokens(mbs, ctx.pgs.dp)
    loss_fn = make_loss_fn(n_tok, len(mbs) * ctx.parallel.dp)
    run = policy.evaluate if forward_only else policy.train_step
    raw = run(mbs, loss_fn, cfg.train.seq_length)
    m = _from_last_stage(raw, ("loss_sum", "tokens"), ctx.pgs.pp, ctx.pgs.dp)
    out = {"loss": m["loss_sum"] / max(m["tokens"], 1.0), "tokens": m["tokens"]}
    if not forward_only:
        out.update(grad_norm=raw.get("grad_norm"), lr=policy.optimizer.param_groups[0]["lr"])
    return out


def worker_main(cfg: RunConfig, run_dir: Path) -> int:
    """One rank: the supervised warm-up (unless resuming an RL run), then the RL loop."""
    from megatron.core import tensor_parallel

    from megatron_rl.distributed import destroy_distributed, init_distributed
    from megatron_rl.driver import run_rl
    from megatron_rl.loop.state import latest

    ctx = init_distributed(cfg.parallel, cfg.launch.backend, timeout_minutes=cfg.launch.timeout_minutes)
    torch.manual_seed(cfg.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    warm = None if latest(run_dir) or cfg.train.steps == 0 else warmup_phase(cfg, run_dir, ctx)
    rc = run_rl(cfg, run_dir, ctx, warm) if cfg.rl.steps > 0 else 0
    destroy_distributed()
    return rc


def warmup_phase(cfg: RunConfig, run_dir: Path, ctx):
    """Supervised training on the verified solutions; returns the trained Policy."""
    from megatron_rl.models.source import initializer
    from megatron_rl.trainer.policy import Policy

    tok = cfg.tokenizer.build(cfg.model)
    train = _batches(run_dir / "shards" / TRAIN_SHARD, cfg.train.seq_length, tok.pad_id)
    held = _batches(run_dir / "shards" / HELDOUT_SHARD, cfg.train.seq_length, tok.pad_id)
    policy = Policy(cfg.model, cfg.optim, ctx, total_steps=cfg.train.steps, init=initializer(cfg.model))
    per_step = cfg.train.micro_batch_size * cfg.train.num_microbatches
    gen = torch.Generator().manual_seed(cfg.seed)
    dp_rank, dp = torch.distributed.get_rank(ctx.pgs.dp), ctx.parallel.dp
    log = _Logger(run_dir / "metrics.jsonl", ctx.rank == 0, print_every=max(1, cfg.train.steps // 30))
    held_mine = torch.arange(len(held["tokens"]))[dp_rank::dp]
    for step in range(cfg.train.steps):
        if step % cfg.train.eval_every == 0:
            log.write("sft_eval", step, _run_step(policy, held, held_mine, cfg, ctx, True))
        index = torch.randint(len(train["tokens"]), (per_step * dp,), generator=gen)  # same on every rank
        mine = index[dp_rank * per_step:(dp_rank + 1) * per_step]
        log.write("sft", step, _run_step(policy, train, mine, cfg, ctx, False))
    log.write("sft_eval", cfg.train.steps, _run_step(policy, held, held_mine, cfg, ctx, True))
    return policy


class _Logger:
    def __init__(self, path: Path, active: bool, print_every: int = 1):
        self.path, self.active, self.t0, self.print_every = path, active, time.time(), print_every

    def write(self, kind: str, step: int, metrics: dict) -> None:
        if not self.active:
            return
        rec = {"kind": kind, "step": step, "time_s": round(time.time() - self.t0, 3), **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if kind == "sft" and step % self.print_every:
            return
        extra = f" grad_norm {metrics['grad_norm']:.3f}" if metrics.get("grad_norm") is not None else ""
        print(f"[megatron-rl] {kind:5s} step {step:4d} loss {metrics['loss']:.4f}{extra}", flush=True)
