"""Rank script: RL steps (GRPO) with context parallelism vs the one-process (CP=1) run.

    torchrun --nproc_per_node W tests/mp/trainer_cp.py --layouts cp2,...

Same model, batches, losses and weight initialisation as tests/mp/trainer_parity.py (KL reference, recomputed
old log-probs, TIS, entropy bonus, chunked log-probs); each layout splits every packed sample over the CP
ranks (padded to a multiple of 2*cp) and runs attention through the local spec's CPDotProductAttention.
Rank 0 then runs the one-process reference in a fresh one-rank world and emits one record per layout.
(tests/trainer/test_trainer_multiproc.py runs these layouts through trainer_parity.py --cp-layouts.)
Besides the parity record, each layout emits the per-rank shares of a micro-batch (how the split went).
"""
from __future__ import annotations

import argparse

import torch.distributed as dist

from tests.mp.launch import emit
from tests.mp.trainer_parity import (
    LAYOUTS,
    STEPS,
    batch,
    build,
    compare,
    full_weights,
    reference,
    single_rank_world,
)

CP_LAYOUTS = {  # name -> (ParallelConfig kwargs, num_layers, moe, distributed optimizer)
    "cp2": (dict(cp=2), 2, False, False),
    "tp2_cp2": (dict(tp=2, cp=2), 2, False, False),
    "cp2_dp2_distopt": (dict(cp=2), 2, False, True),
}


def run_layout(name: str) -> dict:
    import time

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    par, layers, moe, distopt = CP_LAYOUTS[name]
    start = time.perf_counter()
    trainer = build(par, layers, moe, distopt)
    mbs, _ = trainer.prepare(batch(0))
    split = {"rank": dist.get_rank(), "shape": list(mbs[0]["tokens"].shape),
             "cp_size": mbs[0].get("cp_size", 1), "loss_tokens": float(sum(mb["loss_mask"].sum() for mb in mbs)),
             "core_attention": sorted({type(m).__name__ for c in trainer.policy.chunks for n, m in
                                       c.module.named_modules() if n.endswith("core_attention")})}
    metrics = [trainer.step(batch(s)) for s in range(STEPS)]
    weights = full_weights(trainer.policy)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, split)
    parallel_state.destroy_model_parallel()
    get_cuda_rng_tracker().reset()
    return {"layout": name, "model": (layers, moe), "metrics": metrics, "weights": weights, "splits": everyone,
            "seconds": round(time.perf_counter() - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="cp2")
    args = parser.parse_args()
    assert not set(CP_LAYOUTS) & set(LAYOUTS)
    results = [run_layout(n) for n in args.layouts.split(",") if n]
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return
    ctx = single_rank_world()
    refs = {}
    for res in results:
        key = tuple(res["model"])
        if key not in refs:
            refs[key] = reference(*key, ctx)
        emit({**compare(res, refs[key]), "splits": res["splits"]})


if __name__ == "__main__":
    main()
