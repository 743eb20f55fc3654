"""Conversion at parallel layouts (gloo, CPU): HF -> Megatron at TP=2 x PP=2 and at EP=2 -> HF bitwise equal;
reshard TP=2 x PP=2 -> TP=1 and TP=1 -> TP=2 give the logits of the HF model.

The CLI is run as users run it: with --tp/--pp/--ep above 1 it starts torchrun itself. The one-process steps
(mcore-to-hf, reshard to TP=1) run in this pytest process through the same `main(argv)` (as in test_convert.py):
a subprocess each would only add the start-up of Python, torch and Megatron.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.mp.convert_models import hf_tensors, make_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
REPO = Path(__file__).resolve().parents[2]


def convert(*argv: str) -> list[dict]:
    """Run `python -m megatron_rl.tools.convert.cli ARGV`; return the JSON reports printed (one per reporting rank)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in [k for k in env if k.startswith(("SLURM_", "OMPI_", "PMI"))] + ["RANK", "WORLD_SIZE"]:
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.tools.convert.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"op"')]


def convert_here(capsys, *argv: str) -> list[dict]:
    """A one-process conversion in this process (`main(argv)`, its gloo group of size 1 reused); its JSON report."""
    from megatron_rl.tools.convert.cli import main

    capsys.readouterr()
    assert main(list(argv)) == 0, capsys.readouterr().err[-6000:]
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"op"')]


def logit_diffs(reports: list[dict]) -> list[float]:
    return [r["verify"]["max_abs_logit_diff"] for r in reports if "max_abs_logit_diff" in r.get("verify", {})]


def assert_same_tensors(a_dir: Path, b_dir: Path, tied: bool) -> None:
    a, b = hf_tensors(a_dir), hf_tensors(b_dir)
    if tied:
        a.pop("lm_head.weight", None)
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_tp2_pp2_round_trip_and_reshard_to_tp1(tmp_path, capsys):
    hf = make_hf_model("qwen2", tmp_path / "hf", num_hidden_layers=4)  # QKV bias, tied embeddings
    reps = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "a"), "--tp", "2", "--pp", "2",
                   "--verify")
    assert reps[0]["world_size"] == 4 and reps[0]["layout"] == {"tp": 2, "pp": 2, "ep": 1}
    tp2pp2 = logit_diffs(reps)
    assert tp2pp2 and max(tp2pp2) <= 1e-4  # logits at TP=2 x PP=2 vs the HF model
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf2"))
    assert_same_tensors(hf, tmp_path / "hf2", tied=True)
    reps = convert_here(capsys, "reshard", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--tp", "1",
                        "--verify")
    assert max(logit_diffs(reps)) <= 1e-4  # TP=1 logits of the resharded checkpoint vs the HF model
    reps = convert("reshard", "--ckpt", str(tmp_path / "b"), "--out", str(tmp_path / "c"), "--tp", "2", "--verify")
    assert reps[0]["world_size"] == 2 and max(logit_diffs(reps)) <= 1e-4
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_moe_ep2_round_trip(tmp_path, capsys):
    hf = make_hf_model("qwen3_moe", tmp_path / "hf")
    reps = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "a"), "--ep", "2", "--verify")
    assert reps[0]["world_size"] == 2 and max(logit_diffs(reps)) <= 1e-4
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf2"))
    assert_same_tensors(hf, tmp_path / "hf2", tied=False)


def test_failure_on_one_rank_leaves_nothing(tmp_path):
    """An impossible layout fails on the ranks; the launcher removes the temporary folder."""
    hf = make_hf_model("llama", tmp_path / "hf")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.tools.convert.cli", "hf-to-mcore", "--hf", str(hf),
                           "--out", str(tmp_path / "a"), "--tp", "2", "--verify", "--tol", "-1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "logits differ" in proc.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("a")] == []


def test_mixed_dense_moe_layers_with_shared_expert_pp2_ep2(tmp_path, capsys):
    """Qwen2-MoE with a dense layer (per-layer checkpoint keys) and the gated shared expert at PP=2 x EP=2."""
    hf = make_hf_model("qwen2_moe", tmp_path / "hf", num_hidden_layers=4, mlp_only_layers=[1])
    reps = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "a"), "--pp", "2", "--ep", "2",
                   "--verify")
    assert reps[0]["world_size"] == 4 and max(logit_diffs(reps)) <= 1e-4
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf2"))
    assert_same_tensors(hf, tmp_path / "hf2", tied=False)
    reps = convert("reshard", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--ep", "2", "--verify")
    assert reps[0]["world_size"] == 2 and max(logit_diffs(reps)) <= 1e-4


def test_deepseek_v3_tp2_ep2_round_trip_and_reshard_to_pp2(tmp_path, capsys):
    """DeepSeek-V3 (MLA, expert bias, grouped top-k, first layer dense) at TP=2 x EP=2 -> HF bitwise; resharded
    to PP=2 it gives the HF model's logits."""
    hf = make_hf_model("deepseek_v3", tmp_path / "hf", num_hidden_layers=4)
    reps = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "a"), "--tp", "2", "--ep", "2",
                   "--verify")
    assert reps[0]["layout"] == {"tp": 2, "pp": 1, "ep": 2} and max(logit_diffs(reps)) <= 1e-4
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf2"))
    assert_same_tensors(hf, tmp_path / "hf2", tied=False)
    reps = convert("reshard", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--pp", "2", "--verify")
    assert reps[0]["world_size"] == 2 and max(logit_diffs(reps)) <= 1e-4


def test_uneven_pipeline_stages_round_trip_and_reshard(tmp_path, capsys):
    """3 layers over PP=2 (uneven): written with --first-stage-layers 1 -> HF bitwise equal, logits of the HF model;
    resharded to --pipeline-layout 'Ettt|L' (the last rank: final norm and the tied output layer only) -> the HF
    model's logits (--verify: its reference reads the tied output layer's entry, stored under the embedding's key)
    and HF bitwise equal again; an impossible split is refused, in this process before any rank starts, naming
    the fix."""
    hf = make_hf_model("qwen2", tmp_path / "hf", num_hidden_layers=3)  # tied embeddings: a copy on the last stage
    reps = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "a"), "--pp", "2",
                   "--first-stage-layers", "1", "--verify")
    assert reps[0]["layout"] == {"tp": 1, "pp": 2, "ep": 1, "first_stage_layers": 1}
    assert max(logit_diffs(reps)) <= 1e-4
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf2"))
    assert_same_tensors(hf, tmp_path / "hf2", tied=True)
    reps = convert("reshard", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--pp", "2",
                   "--pipeline-layout", "Ettt|L", "--verify")
    assert reps[0]["layout"]["pipeline_layout"] == "Ettt|L"
    assert len(logit_diffs(reps)) == 1 and max(logit_diffs(reps)) <= 1e-4
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "b"), "--out", str(tmp_path / "hf3"))
    assert_same_tensors(hf, tmp_path / "hf3", tied=True)
    from megatron_rl.convert.arch.base import ConvertError
    from megatron_rl.tools.convert.cli import build_parser, run

    args = build_parser().parse_args(["reshard", "--ckpt", str(tmp_path / "b"), "--out", str(tmp_path / "c"),
                                      "--pp", "2", "--pipeline-layout", "Ett|L"])
    with pytest.raises(ConvertError, match=r"places 2 transformer layers 't'; model.num_layers=3.*--pipeline-layout"):
        run(args)
    assert not (tmp_path / "c").exists()
