"""Rank script: REINFORCE++ with KL-in-reward (advantage.kl_coef > 0) in parallel layouts vs the one-process run.

    torchrun --nproc_per_node 2 tests/mp/kl_reward_parity.py --layouts dp2,pp2,cp2

The per-token KL log pi_old - log pi_ref is computed on each rank's micro-batches (last pipeline stage, this
CP rank's tokens) and gathered into the global batch's layout before the advantages (whitened over the whole
batch) are computed: every layout must give the one-process losses and weights. Same model, batches and
initialisation as tests/mp/trainer_parity.py; rank 0 runs the reference in a fresh one-rank world.
(trainer_parity.py --kl-layouts runs these layouts in its own launch: run_layouts, emit_compared.)
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from tests.mp.launch import emit
from tests.mp.trainer_parity import SEED, STEPS, batch, compare, full_weights, model_config, single_rank_world

LAYOUTS = {"dp2": dict(), "pp2": dict(pp=2), "cp2": dict(cp=2)}


def build(parallel_kwargs: dict, ctx=None):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.distributed import init_distributed
    from megatron_rl.kernels.logprob import LogprobKernelConfig
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.rl.config import AdvantageConfig, LossConfig
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.policy import OptimConfig, Policy
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer

    ctx = ctx or init_distributed(ParallelConfig(**parallel_kwargs))
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    policy = Policy(model_config(2, False), OptimConfig(lr=1e-3, clip_grad=1.0, distributed_optimizer=False), ctx,
                    total_steps=STEPS, init=lambda m: init_weights_by_name(m, SEED))
    cfg = RLConfig(loss=LossConfig(name="reinforce"), advantage=AdvantageConfig(name="reinforce++", kl_coef=0.5),
                   packing=PackingConfig(max_tokens=40), old_logprobs="recompute", reference=True,
                   logprob_kernel=LogprobKernelConfig(impl="torch"))
    return RLTrainer(policy, cfg)


def run(trainer) -> dict:
    metrics = [trainer.step(batch(s)) for s in range(STEPS)]
    return {"metrics": metrics, "weights": full_weights(trainer.policy)}


def run_layouts(names: list[str]) -> list[dict]:
    """Each layout's run in this world, one after another (Megatron's groups torn down after each)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    results = []
    for name in names:
        start = time.perf_counter()
        res = run(build(LAYOUTS[name]))
        results.append({**res, "layout": name, "seconds": round(time.perf_counter() - start, 2)})
        parallel_state.destroy_model_parallel()
        get_cuda_rng_tracker().reset()
    return results


def emit_compared(results: list[dict], ctx) -> None:
    """Rank 0 in its one-rank world (`ctx`): the one-process reference, then a record per layout (kl_reward: True)."""
    ref = run(build({}, ctx=ctx))
    for res in results:
        emit({**compare(res, ref), "ref_kl": [m.get("ref_kl") for m in res["metrics"]], "kl_reward": True})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True)
    args = parser.parse_args()
    results = run_layouts(args.layouts.split(","))
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return
    emit_compared(results, single_rank_world())


if __name__ == "__main__":
    main()
