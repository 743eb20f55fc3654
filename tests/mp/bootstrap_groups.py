"""Run under torchrun: initialise several parallel layouts in turn and print each rank's group members.

Emits one record per layout: {"layout": ..., "rank": r, "groups": {name: [global ranks]}, ...}.
"""
import sys

from megatron.core import parallel_state

from megatron_rl.distributed import init_distributed
from megatron_rl.parallel import ParallelConfig
from tests.mp.launch import emit

LAYOUTS = {
    2: {"tp2": dict(tp=2), "pp2": dict(pp=2), "ep2": dict(ep=2), "dp2": dict()},
    4: {"tp2pp2": dict(tp=2, pp=2), "tp2dp2": dict(tp=2), "ep2dp2": dict(ep=2), "pp2vpp2": dict(pp=2, vpp=2),
        "ep4": dict(ep=4)},
}
GROUPS = ("tp", "pp", "dp", "cp", "ep", "expt_tp", "expt_dp", "mp", "dp_cp")


def main() -> int:
    ctx = None
    world = int(__import__("os").environ["WORLD_SIZE"])
    for name, kw in LAYOUTS[world].items():
        ctx = init_distributed(ParallelConfig(**kw))
        groups = {g: ctx.ranks(g) for g in GROUPS}
        out = {"layout": name, "rank": ctx.rank, "dp_size": ctx.parallel.dp, "groups": groups,
               "coords": ctx.coordinates()}
        emit(out)
        parallel_state.destroy_model_parallel()
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
