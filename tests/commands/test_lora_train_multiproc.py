"""`megatron-rl train configs/post_train_lora_cpu.yaml` on a tiny HF model built here: the RL loop trains LoRA
adapters (only adapters in the checkpoints), logs the weight sync's bytes (merged weights vs adapters) and
seconds, resumes from an adapters-only checkpoint, and exports the merged HF folder and the PEFT adapter
folder at the end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_tiny import tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")
SHORT = ("rl.prompts_per_step=2", "rl.group_size=4", "rl.max_new_tokens=16", "eval.tasks=4", "eval.k=2",
         "model.max_seq_length=128", "rl.trainer.loss.entropy_coef=0.05", "rl.optim.lr=1e-2",
         "engine.num_blocks=128", "monitor.tensorboard=false", "rl.dynamic_sampling=false",
         "rl.checkpoint_every=1")

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _train(tmp_path, folder, steps: int, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([EXE, "train", "configs/post_train_lora_cpu.yaml", f"output_dir={tmp_path}",
                           f"model.init=hf:{folder}", f"rl.steps={steps}", *SHORT, *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_lora_main_job_trains_resumes_and_exports(tmp_path):
    from megatron.core import dist_checkpointing

    from megatron_rl.convert.hf_io import HFReader

    folder = tmp_path / "hf"
    tiny_llama(folder, tiny_tokenizer(folder))
    _train(tmp_path, folder, 1, "export.enabled=false")  # the export read below is the resumed launch's
    run = tmp_path / "post_train_lora"
    keys = list(dist_checkpointing.load_tensors_metadata(str(run / "checkpoints" / "step-000001")))
    assert keys and all("lora_" in k for k in keys)  # adapters (and their Adam moments) only
    proc = _train(tmp_path, folder, 2)  # the same command with one more step: resumes from step 1
    assert "resum" in proc.stdout.lower()
    rl = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        assert 0 < r["sync_adapter_bytes"] < r["sync_bytes"] and r["sync_s"] > 0  # rank 16 on a 64-wide model: ~0.3
    merged, base = HFReader(run / "export" / "hf-step-2"), HFReader(folder)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (merged.get(q) - base.get(q)).abs().max() > 0  # the adapters reached the export
    norm = "model.layers.0.input_layernorm.weight"
    assert (merged.get(norm) == base.get(norm)).all()  # frozen outside the adapted projections
    peft = json.loads((run / "export" / "adapter-step-2" / "adapter_config.json").read_text())
    assert peft["peft_type"] == "LORA" and peft["r"] == 16 and peft["lora_alpha"] == 32
