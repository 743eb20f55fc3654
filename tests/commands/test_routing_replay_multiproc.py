"""MoE routing replay through the product path: `megatron-rl train configs/moe_replay_cpu.yaml` (torchrun, one
rank), a bf16 rollout engine serving the fp32 trainer.

The same run twice, from the same seed (the engine's samples of step 0 are identical: recording changes
nothing in generation): routing_replay=off and =everywhere. bf16 rounding flips some of the engine's top-2
choices against the fp32 trainer's; a flipped expert changes the whole token's hidden state, so those tokens
dominate the train/rollout mismatch. A sharper random model (model.init_std=0.3) makes the log-probs
sensitive enough to see it in one step of 8 short samples. Measured here: mismatch_kl 0.0203 (off) vs 0.0040
(everywhere), routing_mismatch_frac 0.0047. Each run ends by exporting the policy as an HF (Mixtral) folder.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")


def _start(out: Path, mode: str, *overrides: str) -> subprocess.Popen:
    """`megatron-rl train configs/moe_replay_cpu.yaml` for one RL step of a sharper random model, replay `mode`."""
    args = [EXE, "train", "configs/moe_replay_cpu.yaml", f"output_dir={out}", "rl.steps=1", "model.init_std=0.3",
            f"rl.trainer.routing_replay={mode}", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _step0(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["kind"] == "rl" and r["step"] == 0)


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_routing_replay_records_stores_and_lowers_the_mismatch(tmp_path):
    from megatron_rl.data.shards import read_arrays

    procs = {mode: _start(tmp_path / mode, mode, "export.verify=true")  # side by side
             for mode in ("off", "everywhere")}
    for mode, p in procs.items():
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, f"{mode}: {out[-4000:]}"
    runs = {mode: tmp_path / mode / "moe_replay" for mode in procs}
    off, on = _step0(runs["off"]), _step0(runs["everywhere"])
    plain, replayed = (read_arrays(runs[m] / "rl_shards" / "step-000000.h5") for m in ("off", "everywhere"))
    np.testing.assert_array_equal(plain.tokens, replayed.tokens)  # the same samples in both runs
    assert plain.routed_experts is None  # off: nothing recorded, nothing stored
    routes = replayed.routed_experts  # [T, 2 MoE layers, top-2]
    assert routes.shape == (len(replayed.tokens), 2, 2) and routes.max() < 8
    last = replayed.offsets[1:] - 1  # each sample's last token is sampled, never run: not recorded
    assert (routes[last] == -1).all() and (np.delete(routes, last, axis=0) >= 0).all()
    assert off["trained_samples"] == on["trained_samples"] == len(replayed)
    # the engine and the trainer route some tokens differently (bf16 vs fp32) ...
    assert on["routing_mismatch_frac"] > 0 and off.get("routing_mismatch_frac") is None
    # ... and replaying the engine's choice removes most of the mismatch that caused
    assert off["mismatch_kl"] > 1e-3 and on["mismatch_kl"] < 0.5 * off["mismatch_kl"], (off, on)
    # the random MoE policy is exported as the architecture that describes it (every layer MoE: Mixtral), and
    # export.verify compared its transformers logits with the policy's (it used to fail: a Llama config)
    for run in runs.values():
        (folder,) = (run / "export").glob("hf-step-*")
        assert json.loads((folder / "config.json").read_text())["model_type"] == "mixtral"


LAYOUTS = Path(__file__).parents[1] / "mp" / "routing_replay_layouts.py"


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, dict]:
    """tests/mp/routing_replay_layouts.py's records of the two-rank layouts, one launch for all three."""
    from tests.mp.launch import torchrun

    return {r["layout"]: r for r in torchrun(LAYOUTS, 2, ["--layouts", "tp2,pp2,cp2"], timeout=600)}


@pytest.mark.slow
@pytest.mark.multiproc
def test_tp2_sequence_parallel_trainer_routes_like_the_engine_and_replays(two_ranks):
    r = two_ranks["tp2"]
    # each TP rank routes its own half of every micro-batch: together every input token once, per MoE layer
    assert r["world"] == 2 and r["compared"] == 2 * r["inputs"] and r["differ_own"] == 0
    assert r["differ_cmp"] == r["corrupted"] > 0  # the corrupted rows are found where they are, on either rank
    assert r["differ_bad"] >= r["corrupted"] and abs(r["loss_bad"] - r["loss_own"]) > 1e-6


@pytest.mark.slow
@pytest.mark.multiproc
def test_pipeline_and_context_parallel_trainers_replay_like_one_process(two_ranks):
    """pp2: each stage replays its own layer's column; cp2: each rank its chunks of the sequence. Counts and
    losses equal the one-process run's (tests/mp/routing_replay_layouts.py)."""
    from tests.mp.launch import torchrun

    (one,) = torchrun(LAYOUTS, 1, ["--layouts", "one"])
    assert one["compared"] == 2 * one["inputs"] and one["differ_own"] == 0 and one["differ_cmp"] == one["corrupted"] > 0
    assert abs(one["loss_bad"] - one["loss_own"]) > 1e-4  # the corrupted routes, replayed, change the loss
    for layout in ("pp2", "cp2"):
        r = two_ranks[layout]
        assert r["routes"] == one["routes"], layout  # the TP-only engine recorded the same experts
        # the trainer's own routing is the engine's, token for token, over both stages / both sequence halves
        assert (r["compared"], r["differ_own"]) == (one["compared"], 0), layout
        assert r["differ_cmp"] == one["corrupted"] and r["differ_bad"] == one["differ_bad"], layout
        for k in ("loss_own", "loss_replay_own", "loss_bad"):
            assert abs(r[k] - one[k]) < 1e-6, (layout, k, r[k], one[k])
