"""Run under torchrun: initialise several parallel layouts in turn and print each rank's group members.

Emits one record per layout: {"layout": ..., "world": w, "rank": r, "groups": {name: [global ranks]}, ...}.
With --then 2 in a world of 4, ranks 0 and 1 then start a fresh world of 2 (a new rendezvous; ranks 2 and 3
leave) and do the same for the world-2 layouts: one launch for both worlds.
"""
import os
import sys

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.distributed import free_port, init_distributed
from megatron_rl.parallel import ParallelConfig
from tests.mp.launch import emit

LAYOUTS = {
    2: {"tp2": dict(tp=2), "pp2": dict(pp=2), "ep2": dict(ep=2), "dp2": dict()},
    4: {"tp2pp2": dict(tp=2, pp=2), "tp2dp2": dict(tp=2), "ep2dp2": dict(ep=2), "pp2vpp2": dict(pp=2, vpp=2),
        "ep4": dict(ep=4)},
}
GROUPS = ("tp", "pp", "dp", "cp", "ep", "expt_tp", "expt_dp", "mp", "dp_cp")


def layouts(world: int) -> None:
    """Each layout of `world` in turn (this process's world must be of that size); one record each."""
    for name, kw in LAYOUTS[world].items():
        ctx = init_distributed(ParallelConfig(**kw))
        assert ctx.world_size == world == dist.get_world_size(), (ctx.world_size, world)
        groups = {g: ctx.ranks(g) for g in GROUPS}
        out = {"layout": name, "world": world, "rank": ctx.rank, "dp_size": ctx.parallel.dp, "groups": groups,
               "coords": ctx.coordinates()}
        emit(out)
        parallel_state.destroy_model_parallel()


def smaller_world(size: int) -> bool:
    """Leave this world; ranks below `size` start a fresh one of `size` ranks (as torchrun would describe it
    to them); whether this rank is in it."""
    box = [free_port()]
    dist.broadcast_object_list(box, src=0)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank >= size:
        return False
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # else the new rendezvous waits for torchrun's store
    os.environ.update(WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size), MASTER_PORT=str(box[0]))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{box[0]}", rank=rank, world_size=size)
    return True


def main() -> int:
    world = int(os.environ["WORLD_SIZE"])
    layouts(world)
    if "--then" in sys.argv and smaller_world(int(sys.argv[sys.argv.index("--then") + 1])):
        layouts(dist.get_world_size())
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
