"""Under torchrun (gloo, CPU, 2 ranks): LoRA RL steps with TP=2 against the one-process run.

Three GRPO steps (KL to the frozen reference, recomputed old log-probs, TIS: tests/mp/trainer_parity.py's
config) of a 2-layer model with adapters on qkv/proj/fc1/fc2; the losses and the unsharded adapters and base
weights after the steps are emitted by rank 0 next to those of a one-rank world started afterwards.

    torchrun --nproc_per_node=2 tests/mp/lora_tp.py

(tests/trainer/test_trainer_multiproc.py runs it inside trainer_parity.py's launch: --also lora_tp.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.mp.launch import emit
from tests.mp.trainer_parity import SEED, batch, full_weights, init_model, model_config, rl_config, single_rank_world

STEPS = 3


def run(ctx) -> dict:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_rl.trainer.lora import LoRAConfig
    from megatron_rl.trainer.policy import OptimConfig, Policy
    from megatron_rl.trainer.rl_step import RLTrainer

    get_cuda_rng_tracker().reset()
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    policy = Policy(model_config(2, False), OptimConfig(lr=1e-2, clip_grad=1.0, distributed_optimizer=False), ctx,
                    total_steps=STEPS, init=init_model, lora=LoRAConfig(enabled=True, rank=4, alpha=8.0))
    trainer = RLTrainer(policy, rl_config(40, "fused"))
    metrics = [trainer.step(batch(s)) for s in range(STEPS)]
    return {"losses": [m["loss"] for m in metrics], "ok": all(m["update_ok"] for m in metrics),
            "weights": {k: v[0] for k, v in full_weights(policy).items()}}


def world_part(_arg: str | None = None) -> tuple[dict, list[dict]]:
    """Every rank, in the launch's world of 2: the TP=2 run (its Megatron groups torn down after); (state, records
    of this rank)."""
    from megatron.core import parallel_state

    from megatron_rl.distributed import init_distributed
    from megatron_rl.parallel import ParallelConfig

    tp2 = run(init_distributed(ParallelConfig(tp=2)))
    parallel_state.destroy_model_parallel()
    return tp2, []


def one_process_part(tp2: dict, ctx, _arg: str | None = None) -> list[dict]:
    """Rank 0 in a one-rank world (`ctx`): the one-process run and the record comparing both."""
    one = run(ctx)
    names = sorted(one["weights"])
    diff = {n: float((tp2["weights"][n] - one["weights"][n]).abs().max()) for n in names if n in tp2["weights"]}
    return [{"losses": tp2["losses"], "ref_losses": one["losses"], "ok": tp2["ok"], "names": names,
             "tp2_names": sorted(tp2["weights"]), "weight_diff": diff,
             "adapter_max": {n: float(one["weights"][n].abs().max()) for n in names if "lora_" in n}}]


def main() -> None:
    tp2, _ = world_part()
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return
    for record in one_process_part(tp2, single_rank_world()):
        emit(record)


if __name__ == "__main__":
    main()
