"""The README's main job (`megatron-rl train configs/demo_cpu.yaml`) end to end, shortened: sandboxed
verification of the data, HDF5 shards, 2 ranks of Megatron-Core at TP=2 on CPU, metrics and summary."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).parent / "megatron-rl")


def _train(*overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "train", "configs/demo_cpu.yaml", *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.multiproc
def test_main_job_short_run(tmp_path):
    proc = _train(f"output_dir={tmp_path}", "train.steps=8", "train.eval_every=4", "data.train_tasks=64",
                  "data.heldout_tasks=16")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "demo"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(8)) and [r["step"] for r in evals] == [0, 4, 8]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, train  # byte-level model learns the format fast
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert "verified in the 'bwrap' sandbox: 80/80 correct, corrupted answers rejected: 80/80" in proc.stdout
    from megatron_rl.data.shards import read_shard

    shard = read_shard(run / "shards" / "warmup-train.h5")
    assert len(shard) == 64 and all(t.reward > 0.99 for t in shard)
    assert all(t.loss_mask[: t.prompt_len].sum() == 0 and t.loss_mask[t.prompt_len:].all() for t in shard)


def test_impossible_layout_fails_before_any_work(tmp_path):
    proc = _train(f"output_dir={tmp_path}", "parallel.tp=3", timeout=60)
    assert proc.returncode == 2
    assert "model.num_attention_heads=4 is not divisible by parallel.tp=3" in proc.stderr
    assert not (tmp_path / "demo").exists()


def test_unknown_key_names_it(tmp_path):
    proc = _train(f"output_dir={tmp_path}", "train.stepz=3", timeout=60)
    assert proc.returncode == 2 and "unknown config key 'train.stepz' (did you mean 'steps'?)" in proc.stderr
