"""Rank script: routing replay with the trainer split over pipeline stages (pp2) or the sequence (cp2), against
the same script in one process.

    torchrun --nproc_per_node 2 tests/mp/routing_replay_layouts.py --layout pp2   # or cp2; 1 rank: --layout one

The engine is TP-only whatever the trainer's layout (rollout/reshard.engine_layout: the whole model on every
rank), so it records every MoE layer; its weights are the trainer's (both initialised from the global names).
Each pipeline stage replays its own layers' columns (global MoE-layer index); each CP rank its own chunks of the
sequence (packing.split_microbatch cuts routed_experts like the tokens). Records: the counts and losses of
`tests/mp/routing_replay_tp.py` (own routing, corrupted routes compared, corrupted routes replayed).
"""
from __future__ import annotations

import argparse

LAYOUTS = {"one": {}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}


def main() -> None:
    import torch.distributed as dist

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.distributed import destroy_distributed, init_distributed
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.rollout.reshard import engine_layout
    from tests.mp.launch import emit
    from tests.rollout.test_routing_replay import _corrupted_passes, _pass, _policy, _rollouts, _trainer

    p = argparse.ArgumentParser()
    p.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    layout = p.parse_args().layout
    ctx = init_distributed(ParallelConfig(**LAYOUTS[layout]))
    policy = _policy(ctx)
    par, pgs = engine_layout(ctx)  # collective
    cols = _rollouts(policy, engine_ctx=(par, pgs), init=lambda m: init_weights_by_name(m, 3))
    inputs = int((cols.lengths - 1).sum())
    loss_own, differ_own, compared = _pass(_trainer(policy, "off"), cols)
    loss_replay_own, _, _ = _pass(_trainer(policy, "everywhere"), cols)
    bad = _corrupted_passes(policy, cols)
    if dist.get_rank() == 0:
        emit({"layout": layout, "inputs": inputs, "compared": compared, "differ_own": differ_own,
              "loss_own": loss_own, "loss_replay_own": loss_replay_own, **bad, "routes": cols.routed_experts.tolist()})
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
