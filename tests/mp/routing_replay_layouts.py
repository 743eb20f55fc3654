"""Rank script: routing replay with the trainer split over the tensor dimension with sequence parallelism (tp2),
over pipeline stages (pp2) or the sequence (cp2), against the same script in one process. Several layouts run
one after another in one launch (each rank's start-up, mostly imports, is paid once):

    torchrun --nproc_per_node 2 tests/mp/routing_replay_layouts.py --layouts tp2,pp2,cp2   # 1 rank: --layouts one

tp2: each TP rank routes its own half of every micro-batch (sequence parallel); the engine is the trainer's TP
layout, loaded with the policy's weights. pp2, cp2 and one: the engine is TP-only whatever the trainer's layout
(rollout/reshard.engine_layout: the whole model on every rank), so it records every MoE layer; its weights are
the trainer's (both initialised from the global names). Each pipeline stage replays its own layers' columns
(global MoE-layer index); each CP rank its own chunks of the sequence (packing.split_microbatch cuts
routed_experts like the tokens). Records (rank 0, one per layout): the counts and losses of own routing,
corrupted routes compared, corrupted routes replayed.
"""
from __future__ import annotations

import argparse

LAYOUTS = {"one": {}, "pp2": {"pp": 2}, "cp2": {"cp": 2}, "tp2": {"tp": 2, "sequence_parallel": True}}


def run(layout: str) -> dict:
    """One layout's record; Megatron's groups torn down after it (torch.distributed stays up for the next)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.distributed import init_distributed
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.rollout.reshard import engine_layout
    from tests.rollout.test_routing_replay import _corrupted_passes, _pass, _policy, _rollouts, _trainer

    ctx = init_distributed(ParallelConfig(**LAYOUTS[layout]))
    policy = _policy(ctx)
    if layout == "tp2":
        cols = _rollouts(policy)
    else:
        par, pgs = engine_layout(ctx)  # collective
        cols = _rollouts(policy, engine_ctx=(par, pgs), init=lambda m: init_weights_by_name(m, 3))
    inputs = int((cols.lengths - 1).sum())
    loss_own, differ_own, compared = _pass(_trainer(policy, "off"), cols)
    rec = {"layout": layout, "world": ctx.launch.world_size, "inputs": inputs, "compared": compared,
           "differ_own": differ_own, "loss_own": loss_own}
    if layout != "tp2":
        rec["loss_replay_own"], _, _ = _pass(_trainer(policy, "everywhere"), cols)
        rec["routes"] = cols.routed_experts.tolist()  # before _corrupted_passes corrupts them
    rec.update(_corrupted_passes(policy, cols))
    parallel_state.destroy_model_parallel()
    get_cuda_rng_tracker().reset()
    return rec


def main() -> None:
    import torch.distributed as dist

    from megatron_rl.distributed import destroy_distributed
    from tests.mp.launch import emit

    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True, help="comma-separated: " + ", ".join(LAYOUTS))
    for layout in p.parse_args().layouts.split(","):
        rec = run(layout)
        if dist.get_rank() == 0:
            emit(rec)
        dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
