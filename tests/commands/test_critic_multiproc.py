"""PPO with a critic through the product path: `megatron-rl train configs/demo_cpu.yaml` with
`rl.trainer.advantage.name=gae` (it failed at the first step: no values reached GAE) on one torchrun rank.
It runs under the CPU device check (MEGATRON_RL_DEVICE_CHECK=nccl: warm-up, RL steps, stop agreement,
checkpoints). The value loss falls over the steps, the final export ignores the critic's tensors, and a run
resumed from the step-1 checkpoint (critic model, value head, optimizer and schedule restored) equals the
unbroken run."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")
# a 2-step warm-up (the tiny model is nearly random: rewards are 0, the critic learns their level), one rank,
# 3 RL steps of 4 x 4 samples; under the device check (collectives refuse tensors not on the rank's device)
GAE = ("train.steps=2", "train.eval_every=2", "data.train_tasks=16", "data.heldout_tasks=8", "eval.k=2",
       "eval.every=0", "eval.tasks=4",
       "rl.prompts_per_step=4", "rl.group_size=4", "monitor.tensorboard=false", "launch.nproc_per_node=1",
       "parallel.tp=1", "rl.dynamic_sampling=false", "rl.steps=3", "rl.checkpoint_every=1",
       "rl.trainer.advantage.name=gae", "rl.trainer.loss.name=ppo", "rl.trainer.critic.optim.lr=1e-4")


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MEGATRON_RL_DEVICE_CHECK": "nccl"}
    return subprocess.run([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={out}", *GAE, *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)


def _rl_rows(run: Path) -> dict[int, dict]:
    """The last `rl` row of each step (a resumed run appends)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "rl"}


@pytest.mark.slow
@pytest.mark.multiproc
def test_ppo_gae_through_megatron_rl_train_learns_values_and_resumes_exactly(tmp_path):
    proc = _train(tmp_path / "a")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "a" / "demo"
    assert "collectives check that their tensors are on the rank's device" in proc.stderr
    a = _rl_rows(run)
    assert sorted(a) == [0, 1, 2] and not any(r["update_skipped"] for r in a.values())
    losses = [a[s]["value_loss"] for s in range(3)]
    assert losses[0] > 1e-3 and losses[2] < 0.6 * losses[0], losses  # the critic fits the returns
    assert all(0.0 <= a[s]["value_clip_fraction"] <= 1.0 and a[s]["value_grad_norm"] > 0 for s in a)
    assert all(math.isfinite(a[s]["explained_variance"]) for s in a)
    assert (run / "export").is_dir()  # the end-of-run HF export skips the critic's tensors

    # resume from the step-1 checkpoint of a copy: steps 1 and 2 again, from the restored critic and policy
    b_run = tmp_path / "b" / "demo"
    shutil.copytree(run, b_run)
    for ckpt in ("step-000002", "step-000003"):
        shutil.rmtree(b_run / "checkpoints" / ckpt)
    shutil.rmtree(b_run / "export")
    (b_run / "checkpoints" / "latest").write_text("step-000001\n")
    for shard in (b_run / "rl_shards").glob("*.h5"):
        if int(shard.stem.split("-")[1]) >= 1:
            shard.unlink()
    resumed = _train(tmp_path / "b", "export.enabled=false")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resuming from" in resumed.stdout and "step-000001" in resumed.stdout
    b = _rl_rows(b_run)
    keys = ("value_loss", "explained_variance", "value_mean", "value_grad_norm", "loss", "grad_norm",
            "reward_mean", "trained_samples")
    for s in (1, 2):
        assert {k: a[s][k] for k in keys} == {k: b[s][k] for k in keys}, (s, a[s], b[s])
