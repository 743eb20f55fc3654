"""Driver checkpoints: the trainer's (model, optimizer, scheduler, step, RNG; `trainer/checkpoint.py`) plus the
driver's own state in the checkpoint's common part: the sampler position per domain, the rollout buffer
(scored groups destined for later steps; requests in flight are finished first) and the alert history.

The KL reference (`rl.trainer.reference`) is SAVED in every checkpoint and restored on resume, by design: it is
the policy at the start of the RL phase (the warm-up's result or model.init's weights), which a resumed job
does not rebuild (the warm-up is not rerun, and the trainer is built before the checkpoint loads, from the
model's initialiser), so a resumed run computes its KL term against exactly the reference of the unbroken run.
The PPO critic (advantage gae) is saved and restored with them: its model, value head, optimizer and schedule.
`<run>/checkpoints/latest` names the newest complete checkpoint (written after the save, atomically; the run's one
pointer, shared with the warm-up: trainer/latest.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_rl.trainer import latest as pointer

if TYPE_CHECKING:
    from megatron_rl.loop.job import Job


def latest(run_dir: Path) -> Path | None:
    """The newest complete RL checkpoint of the run, or None (none yet, or the newest is the warm-up's)."""
    return pointer.latest(run_dir, "rl")


def checkpoint(job: Job, rollouts, run_dir: Path, step: int) -> Path:
    from megatron_rl.trainer.checkpoint import save_checkpoint

    rollouts.drain()
    alerts = [job.monitor.rewards]  # kept on rank 0 (the monitor's); the common state must match on every rank
    world = job.ctx.world
    torch.distributed.broadcast_object_list(alerts, src=torch.distributed.get_global_rank(world, 0), group=world)
    state = {"step": step, "sampler": job.sampler.state_dict(), "rollouts": rollouts.state_dict(),
             "alert_rewards": alerts[0]}
    name = f"step-{step:06d}"
    path = Path(run_dir) / "checkpoints" / name
    save_checkpoint(job.policy, path, reference=job.trainer.reference, extra={"driver": json.dumps(state)},
                    critic=job.trainer.critic)
    torch.distributed.barrier(group=world)
    if job.is_rank0:
        pointer.write_latest(run_dir, path)
    torch.distributed.barrier(group=world)
    return path


def resume(job: Job, rollouts, run_dir: Path) -> int:
    """Load the latest checkpoint into the policy, sampler and rollout buffer; returns the step to run next."""
    from megatron_rl.trainer.checkpoint import load_checkpoint

    path = latest(run_dir)
    state = json.loads(load_checkpoint(job.policy, path, reference=job.trainer.reference,
                                       critic=job.trainer.critic)["driver"])
    job.sampler.load_state_dict(state["sampler"])
    rollouts.load_state_dict(state["rollouts"], job.tasks_by_id)
    job.monitor.rewards = list(state["alert_rewards"])
    job.monitor.log("resume", int(state["step"]), {"phase": "rl", "checkpoint": str(path)})  # rows are appended
    if job.is_rank0:
        print(f"[megatron-rl] resumed from {path} at RL step {state['step']} "
              f"({len(rollouts.ready)} buffered groups)", flush=True)
    return int(state["step"])
