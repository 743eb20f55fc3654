"""Rank script: save at TP=2 x PP=2 after two RL steps, resume at the same layout (bitwise) and, on rank 0
in a fresh one-rank world, at TP=1 (same next-step loss as the unbroken run).

    torchrun --nproc_per_node 4 tests/mp/ckpt_resume.py --dir CKPT

(tests/trainer/test_trainer_multiproc.py runs it inside trainer_parity.py's launch: --also ckpt_resume:CKPT.)
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from tests.mp.launch import emit
from tests.mp.trainer_parity import batch, build, full_weights, single_rank_world

LAYOUT = dict(tp=2, pp=2)


def reset() -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    parallel_state.destroy_model_parallel()
    get_cuda_rng_tracker().reset()


def unbroken(path: str) -> dict:
    """Steps 0, 1, save, step 2: the loss of step 2 and the weights after it."""
    from megatron_rl.trainer.checkpoint import save_checkpoint

    trainer = build(LAYOUT, 2, False, True)
    for s in range(2):
        trainer.step(batch(s))
    save_checkpoint(trainer.policy, path, reference=trainer.reference, extra={"data_step": 2})
    loss = trainer.step(batch(2))["loss"]
    weights = full_weights(trainer.policy)
    reset()
    return {"loss": loss, "weights": weights}


def resumed(path: str, parallel: dict, ctx=None) -> dict:
    from megatron_rl.trainer.checkpoint import load_checkpoint

    trainer = build(parallel, 2, False, True, ctx=ctx)
    extra = load_checkpoint(trainer.policy, path, reference=trainer.reference)
    loss = trainer.step(batch(extra["data_step"]))["loss"]
    return {"loss": loss, "weights": full_weights(trainer.policy), "step": trainer.policy.step_count}


def world_part(path: str) -> tuple[tuple[dict, dict], list[dict]]:
    """Every rank, in the launch's world of 4: the unbroken run (saving at `path`) and the resume at the same
    layout; (state, records of this rank)."""
    a = unbroken(path)
    b = resumed(path, LAYOUT)
    reset()
    return (a, b), []


def one_process_part(state: tuple[dict, dict], ctx, path: str) -> list[dict]:
    """Rank 0 in a one-rank world (`ctx`): the same-layout record, then the resume at TP=1 (its groups kept)."""
    a, b = state
    same = all(torch.equal(x, y) for k in a["weights"] for x, y in zip(a["weights"][k], b["weights"][k]))
    records = [{"kind": "same_layout", "loss": b["loss"], "unbroken": a["loss"],
                "bitwise": same and a["loss"] == b["loss"], "step": b["step"]}]
    c = resumed(path, {}, ctx=ctx)
    diff = max(float((c["weights"][k][0] - v[0]).abs().max()) for k, v in a["weights"].items())
    return records + [{"kind": "tp1", "loss": c["loss"], "unbroken": a["loss"], "weight_diff": diff,
                       "step": c["step"]}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    state, _ = world_part(args.dir)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return
    for record in one_process_part(state, single_rank_world(), args.dir):
        emit(record)


if __name__ == "__main__":  # required: dist_checkpointing save starts a multiprocessing manager
    main()
