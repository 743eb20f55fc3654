"""Routing replay at TP=2 with sequence parallelism (each TP rank routes its half of every micro-batch): the
trainer's own routing equals the engine's token for token, and replayed routes reach the loss."""
from __future__ import annotations


def main() -> None:
    import os

    import torch.distributed as dist

    from megatron_rl.distributed import destroy_distributed, init_distributed
    from megatron_rl.parallel import ParallelConfig
    from tests.mp.launch import emit
    from tests.rollout.test_routing_replay import _corrupted_passes, _pass, _policy, _rollouts, _trainer

    world = int(os.environ["WORLD_SIZE"])
    ctx = init_distributed(ParallelConfig(tp=world, sequence_parallel=world > 1))
    policy = _policy(ctx)
    cols = _rollouts(policy)
    inputs = int((cols.lengths - 1).sum())
    loss_own, differ_own, compared = _pass(_trainer(policy, "off"), cols)
    bad = _corrupted_passes(policy, cols)
    if dist.get_rank() == 0:
        emit({"world": world, "inputs": inputs, "compared": compared, "differ_own": differ_own, "loss_own": loss_own,
              **bad})
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
