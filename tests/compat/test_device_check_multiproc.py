"""The main job under the CPU device check (MEGATRON_RL_DEVICE_CHECK=nccl): no collective of this code receives
a tensor that was never placed on the rank's device. At TP=2 in-process (2 torchrun ranks: warm-up, the
rollout engine's TP broadcasts and logit gathers, the trainer's TP reductions, the weight sync, the stop
agreement, checkpoints), and dispatched: with the TP=2 engine serving from its threads, and at PP=2 with a
separate rollout server (the stages' gather into rank 0's engine, the weight file pushed to the server)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


DISPATCHED = ("train.steps=0", "data.train_tasks=16", "data.heldout_tasks=4", "eval.k=1",
              "eval.every=0", "eval.tasks=2", "rl.prompts_per_step=2", "rl.group_size=4", "monitor.tensorboard=false",
              "rl.steps=2", "rl.dynamic_sampling=false", "export.enabled=false", "episodes.runner=dispatch",
              "episodes.dispatch.executor=local", "episodes.dispatch.episodes_per_task=8", "episodes.worker_threads=2")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [("episodes.server=separate", "parallel.tp=1", "parallel.pp=2",
                                     "rl.max_staleness=1")], ids=["separate_pp2"])
def test_dispatched_loops_under_the_device_check(tmp_path, layout):
    """(The colocated dispatched engine's serving thread is covered by test_device_check.py's thread test; its
    TP=2 loop case was dropped from CI for time: 4 min on 2 loaded cores.)"""
    env = {**os.environ, "MEGATRON_RL_DEVICE_CHECK": "nccl"}
    proc = subprocess.run([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}", *DISPATCHED, *layout],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stderr.count("collectives check that their tensors are on the rank's device") == 2  # both ranks
    run = tmp_path / "demo"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["kind"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1] and all(r["episodes_missing"] == 0 for r in rl)
    if "episodes.server=separate" in layout:  # the server (under the check too) loaded each pushed weight file
        log = (run / "rollout_server" / "server.log").read_text()
        assert "collectives check that their tensors are on the rank's device" in log
        assert log.count("rollout_server/weights.bin") >= 1, log[-2000:]
