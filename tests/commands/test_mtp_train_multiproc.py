"""Multi-token prediction through the product path: `megatron-rl train configs/deepseek_v3_mtp_cpu.yaml` (torchrun,
two pipeline stages: the MTP layer on the last, with Megatron's embedding copy; the rollout engine, one stage, on
every rank): a tiny DeepSeek-V3 (MLA, sigmoid-routed MoE, one MTP layer) trained with GRPO; the MTP loss is logged
every step, the RL checkpoint is written (the last stage ties its embedding copy), and the run's export is a
DeepseekV3ForCausalLM folder with the MTP layer, verified against the policy's logits (export.verify in the
config). pp=1 MTP training: tests/models/test_deepseek_v3.py; pp2 parity: tests/trainer/test_trainer_multiproc.py."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_deepseek_v3_with_an_mtp_layer_logs_its_loss_and_exports_it(tmp_path):
    args = [EXE, "train", "configs/deepseek_v3_mtp_cpu.yaml", f"output_dir={tmp_path}", "rl.steps=1",
            "launch.nproc_per_node=2", "parallel.pp=2"]
    p = subprocess.run(args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    run = tmp_path / "dsv3_mtp"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if r["kind"] == "rl"]
    assert 1.0 < step["mtp_loss"] < math.log(384) + 1.0, step  # an NLL over the 384-token vocabulary
    (folder,) = (run / "export").glob("hf-step-*")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    names = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f"model.layers.2.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head.norm")} <= set(names)
    assert "verified: max |logit diff|" in p.stdout + p.stderr
