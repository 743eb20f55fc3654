"""The RL loop, on every trainer rank (torchrun/srun), with the rollout engine in-process on the same ranks.

    sample prompts across the mixture's domains -> episodes (envs/episode.py: generate with the engine ->
    env step in rank 0's sandboxed thread pool -> next turn ...) -> composed reward -> HDF5 shard
    -> advantages + policy update (Megatron) -> weights copied into the engine by name (policy_version += 1)
    -> evaluate / checkpoint / log, repeated.

The engine shares the trainer's TP group and model definition but holds the whole model (TP only): the weight
sync gathers pipeline stages and experts into it by global name (rollout/reshard.py), and each TP group is an
engine replica generating its own share of the prompts (loop/rollout.py).
`rl.max_staleness` = 0 is synchronous training; k >= 1 submits each step's prompts k steps early, so their
generation overlaps the steps in between (the engine batches them with the current ones, rewards are scored
while the trainer trains) and requests in flight continue across weight updates with per-token versions;
truncated importance sampling against the behaviour log-probs of the shards corrects the lag. Checkpoints
hold the trainer, the sampler, the rollout buffer (in-flight requests are finished first) and the RNGs, so a
restart continues the same trajectory. Episodes run in-process (`loop.rollout`: the engine generates, rank 0's
sandboxed thread pool scores) or, with `episodes.runner: dispatch`, on rollout workers dispatched by submitit
to local processes or a Slurm CPU partition, which call the engine's HTTP server and publish HDF5 shards
(`loop.dispatched`).
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch

from megatron_rl.loop import state as S
from megatron_rl.run_config import RunConfig
from megatron_rl.slurm_env import SlurmEnv


def run_rl(cfg: RunConfig, run_dir: Path, ctx, warm_policy=None, stop: StopFlag | None = None,
           monitor=None) -> int:
    """Run (or resume) the RL phase on this rank; returns 0, or 3 when stopped by a signal or an alert (`stop`:
    the flag installed at the rank's start, so a signal during the set-up is not lost; `monitor`: the run's
    Monitor when the warm-up already logged through it)."""
    from megatron_rl.loop import evaluation, handoff, metrics
    from megatron_rl.loop.job import build, make_rollouts, say, sync_weights

    job = build(cfg, run_dir, ctx, warm_policy, monitor)  # policy, trainer, engine, runner, sampler, monitor
    rollouts = make_rollouts(job, run_dir)  # in-process engine + scorer, or dispatched episodes
    start = S.resume(job, rollouts, run_dir) if S.latest(run_dir) else 0
    sync_weights(job, rollouts, version=start)
    stop = stop or StopFlag()
    if start == 0:
        evaluation.evaluate(job, rollouts, step=0)
    last = cfg.rl.steps - 1
    for step in range(start, cfg.rl.steps):
        clock = metrics.Clock(rollouts)
        rollouts.fill(upto=step + cfg.rl.max_staleness, sampler=job.sampler, last_step=last)
        groups, sampling = rollouts.batch(step, job.sampler)
        cols, sampling["dropped_stale"] = handoff.to_shard(job, rollouts, groups, step, run_dir)
        clock.mark("rollout")
        train = job.trainer.step(cols) if cols is not None else {"update_skipped": True}
        clock.mark("train")
        sync_weights(job, rollouts, version=step + 1)
        clock.mark("sync")
        row = metrics.step_metrics(job, rollouts, cols, train, sampling, clock)
        job.monitor.log("rl", step, row)
        job.monitor.check(step, row)
        if evaluation.eval_due(cfg, step):
            evaluation.evaluate(job, rollouts, step=step + 1)
        reason = stop.agreed(job.monitor.should_stop, ctx.device)
        if reason or step == last or (cfg.rl.checkpoint_every and (step + 1) % cfg.rl.checkpoint_every == 0):
            S.checkpoint(job, rollouts, run_dir, step + 1)
        if reason and step != last:
            say(job, f"stopped after step {step} ({reason}); checkpoint saved, rerun the same command to resume")
            rollouts.close()
            return 3
    rollouts.close()
    job.close()
    return 0


class StopFlag:
    """SIGTERM / SIGUSR1 (Slurm preemption) or a stopping alert: every rank agrees to stop at the same step."""

    def __init__(self):
        self.signal: str | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)
        senv = SlurmEnv.from_environ()
        if senv is not None and senv.in_step:
            # Slurm delivers a step's USR1 (--signal=B:USR1@..., forwarded by the sbatch scripts) to EVERY process
            # of the step: it would kill this rank's helpers mid-step (the checkpoint writer's spawned manager,
            # sandboxes). Blocked here, it stays blocked in the threads and processes started from here on (they
            # never see it); a thread of its own takes it for the flag.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
            threading.Thread(target=self._take_usr1, name="stop-usr1", daemon=True).start()

    def _take_usr1(self) -> None:
        while True:
            self._handler(signal.sigwait({signal.SIGUSR1}), None)

    def _handler(self, signum, _frame) -> None:
        self.signal = signal.Signals(signum).name

    def agreed(self, alert: str | None, device: torch.device) -> str | None:
        """Whether any rank was signalled or alerted; `device`: the rank's (ctx.device; NCCL needs its GPU)."""
        t = torch.tensor([float(self.signal is not None), float(alert is not None)], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        if t[0] > 0:
            return f"signal {self.signal or 'on another rank'}"
        return f"alert ({alert or 'on rank 0'})" if t[1] > 0 else None
