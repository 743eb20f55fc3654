"""Exact trainer checkpoints (dist_checkpointing, fully reshardable): save at TP=2 x PP=2 with the
DistributedOptimizer after two RL steps; resume at the same layout (bitwise-equal next step) and at TP=1
(the same next-step loss and weights as the unbroken run, fp32)."""
from __future__ import annotations

import pytest

from tests.mp.launch import REPO, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_save_tp2_pp2_resume_same_layout_bitwise_and_at_tp1(tmp_path):
    records = torchrun(REPO / "tests" / "mp" / "ckpt_resume.py", 4, ["--dir", str(tmp_path / "ckpt")], timeout=400)
    same = next(r for r in records if r["kind"] == "same_layout")
    assert same["bitwise"] and same["step"] == 3, same
    tp1 = next(r for r in records if r["kind"] == "tp1")
    assert tp1["step"] == 3
    assert abs(tp1["loss"] - tp1["unbroken"]) < 1e-5, tp1
    assert tp1["weight_diff"] < 1e-5, tp1
