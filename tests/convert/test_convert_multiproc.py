"""Conversion at parallel layouts (gloo, CPU): HF -> Megatron at TP=2 x PP=2 and at EP=2 -> HF bitwise equal;
reshard TP=2 x PP=2 -> TP=1 and TP=1 -> TP=2 give the logits of the HF model.

The CLI is run as users run it: with --tp/--pp/--ep above 1 it starts torchrun itself (the EP=2 round trip and
the failing layout). The other multi-rank conversions are the same CLI `main(argv)` in launched ranks, those of
one world size in one launch (tests/mp/convert_batch.py, module fixture `runs`): a launch per command would
only add the start-up of Python, torch and Megatron on every rank. The one-process steps (mcore-to-hf, reshard
to TP=1) run in this pytest process through the same `main(argv)` (as in test_convert.py).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.mp.convert_models import hf_tensors, make_hf_model
from tests.mp.launch import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
REPO = Path(__file__).resolve().parents[2]
BATCH = REPO / "tests" / "mp" / "convert_batch.py"
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


def convert_here_quiet(*argv: str) -> list[dict]:
    """convert_here for a module fixture (no capsys): stdout captured around the call."""
    from megatron_rl.tools.convert.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    assert rc == 0, err.getvalue()[-6000:]
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith('{"op"')]


def batch(tmp: Path, world: int, commands: dict[str, list[str]]) -> dict[str, list[dict]]:
    """Run `commands` (name -> convert argv) in one launch of `world` ranks, in order; name -> [its report]."""
    spec = tmp / f"commands-{world}.json"
    spec.write_text(json.dumps(list(commands.values())))
    records = torchrun(BATCH, world, [str(spec)], timeout=600)
    names = list(commands)
    got = {name: [r for r in records if r["i"] == i] for i, name in enumerate(names)}
    assert all(len(v) == 1 for v in got.values()), records
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """The multi-rank conversions of the tests below (except those through the CLI's own torchrun): a folder per
    test (HF model `hf`, outputs a, b, c) and name -> the command's reports. World 4, then the one-process reshard
    to TP=1 here, then world 2 (which reshards that back to TP=2)."""
    root = tmp_path_factory.mktemp("convert_mp")
    d = {k: root / k for k in ("dense", "mixed", "dsv3", "uneven")}
    make_hf_model("qwen2", d["dense"] / "hf", num_hidden_layers=4)  # QKV bias, tied embeddings
    make_hf_model("qwen2_moe", d["mixed"] / "hf", num_hidden_layers=4, mlp_only_layers=[1])
    make_hf_model("deepseek_v3", d["dsv3"] / "hf", num_hidden_layers=4)
    make_hf_model("qwen2", d["uneven"] / "hf", num_hidden_layers=3)  # tied embeddings: a copy on the last stage

    def to_mcore(k, *layout):
        return ["hf-to-mcore", "--hf", str(d[k] / "hf"), "--out", str(d[k] / "a"), *layout, "--verify"]

    def reshard(k, src, dst, *layout):
        return ["reshard", "--ckpt", str(d[k] / src), "--out", str(d[k] / dst), *layout, "--verify"]

    reps = batch(root, 4, {"dense_tp2_pp2": to_mcore("dense", "--tp", "2", "--pp", "2"),
                           "mixed_pp2_ep2": to_mcore("mixed", "--pp", "2", "--ep", "2"),
                           "dsv3_tp2_ep2": to_mcore("dsv3", "--tp", "2", "--ep", "2")})
    reps["dense_tp1"] = convert_here_quiet(*reshard("dense", "a", "b", "--tp", "1"))
    reps |= batch(root, 2, {"dense_tp1_to_tp2": reshard("dense", "b", "c", "--tp", "2"),
                            "mixed_to_ep2": reshard("mixed", "a", "b", "--ep", "2"),
                            "dsv3_to_pp2": reshard("dsv3", "a", "b", "--pp", "2"),
                            "uneven_pp2": to_mcore("uneven", "--pp", "2", "--first-stage-layers", "1"),
                            "uneven_to_layout": reshard("uneven", "a", "b", "--pp", "2", "--pipeline-layout",
                                                        "Ettt|L")})
    return root, reps


def test_tp2_pp2_round_trip_and_reshard_to_tp1(runs, capsys):
    root, runs = runs
    tmp_path, hf = root / "dense", root / "dense" / "hf"
    reps = runs["dense_tp2_pp2"]
    assert reps[0]["world_size"] == 4 and reps[0]["layout"] == {"tp": 2, "pp": 2, "ep": 1}
    tp2pp2 = logit_diffs(reps)
    assert tp2pp2 and max(tp2pp2) <= 1e-4  # logits at TP=2 x PP=2 vs the HF model
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf2"))
    assert_same_tensors(hf, tmp_path / "hf2", tied=True)
    reps = runs["dense_tp1"]
    assert max(logit_diffs(reps)) <= 1e-4  # TP=1 logits of the resharded checkpoint vs the HF model
    reps = runs["dense_tp1_to_tp2"]
    assert reps[0]["world_size"] == 2 and max(logit_diffs(reps)) <= 1e-4
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_moe_ep2_round_trip(tmp_path, capsys):
    """Through the CLI's own torchrun (as users run it): its ranks' report on this process's stdout."""
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


def test_mixed_dense_moe_layers_with_shared_expert_pp2_ep2(runs, capsys):
    """Qwen2-MoE with a dense layer (per-layer checkpoint keys) and the gated shared expert at PP=2 x EP=2."""
    root, runs = runs
    tmp_path, hf = root / "mixed", root / "mixed" / "hf"
    reps = runs["mixed_pp2_ep2"]
    assert reps[0]["world_size"] == 4 and max(logit_diffs(reps)) <= 1e-4
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf2"))
    assert_same_tensors(hf, tmp_path / "hf2", tied=False)
    reps = runs["mixed_to_ep2"]
    assert reps[0]["world_size"] == 2 and max(logit_diffs(reps)) <= 1e-4


def test_deepseek_v3_tp2_ep2_round_trip_and_reshard_to_pp2(runs, capsys):
    """DeepSeek-V3 (MLA, expert bias, grouped top-k, first layer dense) at TP=2 x EP=2 -> HF bitwise; resharded
    to PP=2 it gives the HF model's logits."""
    root, runs = runs
    tmp_path, hf = root / "dsv3", root / "dsv3" / "hf"
    reps = runs["dsv3_tp2_ep2"]
    assert reps[0]["layout"] == {"tp": 2, "pp": 1, "ep": 2} and max(logit_diffs(reps)) <= 1e-4
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf2"))
    assert_same_tensors(hf, tmp_path / "hf2", tied=False)
    reps = runs["dsv3_to_pp2"]
    assert reps[0]["world_size"] == 2 and max(logit_diffs(reps)) <= 1e-4


def test_uneven_pipeline_stages_round_trip_and_reshard(runs, capsys):
    """3 layers over PP=2 (uneven): written with --first-stage-layers 1 -> HF bitwise equal, logits of the HF model;
    resharded to --pipeline-layout 'Ettt|L' (the last rank: final norm and the tied output layer only) -> the HF
    model's logits (--verify: its reference reads the tied output layer's entry, stored under the embedding's key)
    and HF bitwise equal again; an impossible split is refused, in this process before any rank starts, naming
    the fix."""
    root, runs = runs
    tmp_path, hf = root / "uneven", root / "uneven" / "hf"
    reps = runs["uneven_pp2"]
    assert reps[0]["layout"] == {"tp": 1, "pp": 2, "ep": 1, "first_stage_layers": 1}
    assert max(logit_diffs(reps)) <= 1e-4
    convert_here(capsys, "mcore-to-hf", "--ckpt", str(tmp_path / "a"), "--out", str(tmp_path / "hf2"))
    assert_same_tensors(hf, tmp_path / "hf2", tied=True)
    reps = runs["uneven_to_layout"]
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
