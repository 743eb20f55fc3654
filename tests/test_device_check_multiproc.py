"""The main job at TP=2 (2 torchrun ranks: warm-up, the rollout engine's TP broadcasts and logit gathers, the
trainer's TP reductions, the weight sync, the stop agreement, checkpoints) under the CPU device check
(MEGATRON_RL_DEVICE_CHECK=nccl): no collective of this code receives a tensor that was never placed on the
rank's device."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).parent / "megatron-rl")


@pytest.mark.slow
@pytest.mark.multiproc
def test_main_job_tp2_under_the_device_check(tmp_path):
    env = {**os.environ, "MEGATRON_RL_DEVICE_CHECK": "nccl"}
    proc = subprocess.run(
        [EXE, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}", "train.steps=2", "train.eval_every=2",
         "data.train_tasks=16", "data.heldout_tasks=8", "eval.k=2", "eval.every=0", "eval.tasks=4",
         "rl.prompts_per_step=2", "rl.group_size=4", "monitor.tensorboard=false", "rl.steps=2",
         "rl.dynamic_sampling=false", "export.enabled=false"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stderr.count("collectives check that their tensors are on the rank's device") == 2  # both ranks
    rows = [json.loads(x) for x in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "rl"] == [0, 1]
    assert (tmp_path / "demo" / "checkpoints" / "latest").read_text().strip() == "step-000002"
