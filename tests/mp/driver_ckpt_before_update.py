"""Rank script: a checkpoint saved BEFORE the first optimizer update (every RL step so far skipped, e.g. all
groups filtered) saves, loads and continues exactly. Torch Adam creates its state lazily, and Megatron's
DistributedOptimizer state_dict (no TE/Apex) asserted one distinct `step` among zero states.

    torchrun --nproc_per_node 2 tests/mp/driver_ckpt_before_update.py --dir CKPT
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from tests.mp.ckpt_resume import reset
from tests.mp.launch import emit
from tests.mp.trainer_parity import batch, build, full_weights

LAYOUT = dict(tp=2)


def run(path: str, load: bool) -> dict:
    """Save (or load) at step 0, then two RL steps and a save after them: the losses and final weights."""
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint

    trainer = build(LAYOUT, 2, False, True)
    refused = None
    if load:
        try:  # saved without the trainer's KL reference: loading it with one is refused, naming the checkpoint
            load_checkpoint(trainer.policy, f"{path}/step0", reference=trainer.reference)
        except ValueError as e:
            refused = str(e)
        load_checkpoint(trainer.policy, f"{path}/step0")
    else:
        save_checkpoint(trainer.policy, f"{path}/step0")
    losses = [trainer.step(batch(s))["loss"] for s in range(2)]
    steps = {float(st["step"]) for inner in _inner(trainer.policy.optimizer) for st in inner.state.values()}
    save_checkpoint(trainer.policy, f"{path}/step2-{'resumed' if load else 'unbroken'}")
    out = {"losses": losses, "weights": full_weights(trainer.policy), "adam_steps": sorted(steps), "refused": refused}
    reset()
    return out


def _inner(optimizer) -> list:
    return [s.optimizer for s in getattr(optimizer, "chained_optimizers", [optimizer])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    a, b = run(args.dir, load=False), run(args.dir, load=True)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0:
        same = all(torch.equal(x, y) for k in a["weights"] for x, y in zip(a["weights"][k], b["weights"][k]))
        emit({"unbroken": a["losses"], "resumed": b["losses"], "weights_bitwise": same,
              "adam_steps": [a["adam_steps"], b["adam_steps"]], "refused": b["refused"]})


if __name__ == "__main__":  # required: dist_checkpointing save starts a multiprocessing manager
    main()
