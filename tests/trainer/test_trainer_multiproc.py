"""Parity of the RL trainer on Megatron-Core: parallel layouts vs the one-process run (CPU, gloo).

Three GRPO steps (KL reference, recomputed old log-probs, TIS, entropy bonus, chunked log-probs, packed
micro-batches) in each layout must give the losses and updated weights of the one-process run within 1e-5
(fp32). Layouts use the fused log-prob path (hidden states + output weight through the fused kernel, the
default) except those named '*_logits'. Each is compared with the one-process run of the same path, and a
fused layout also with the one-process LOGITS run: losses and metrics within 1e-5, weights after three Adam
steps within CROSS_WEIGHT_TOL (Adam's update g / (sqrt(v) + eps) amplifies fp32 rounding differences of
gradients near eps; the gradients themselves agree to 1e-5 relative, tests/trainer/test_trainer_fused_logprob.py).
TP, SP, PP, VPP, EP, DP and tied embeddings are covered. Several layouts share one launch; rank 0 then
computes the one-process references in a fresh one-rank world, and checks that the real model's loss and
gradients do not depend on the packing.
"""
from __future__ import annotations

import pytest

from tests.mp.launch import REPO, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
SCRIPT = REPO / "tests" / "mp" / "trainer_parity.py"
TOL = 1e-5
CROSS_WEIGHT_TOL = 1e-4


def _check_layouts(records: list[dict], names: list[str]) -> None:
    got = {r["layout"]: r for r in records if "layout" in r}
    assert sorted(got) == sorted(names)
    for name, r in got.items():
        assert r["update_ok"], name
        assert not r["names_differ"], (name, r["names_differ"])
        assert r["loss_diff"] < TOL, (name, r["losses"], r["ref_losses"])
        assert r["metric_diff"] < TOL, (name, r["metric_diff"])
        assert r["weight_diff"] < TOL, (name, r["weight_diff"])
        assert r["replica_diff"] < TOL, (name, r["replica_diff"])  # DP replicas / tied embeddings agree
        assert len({round(x, 6) for x in r["losses"]}) == 3  # the weights moved between steps
        if r.get("impl") == "fused":  # fused layout (trainer_parity.py) vs the one-process logits path
            assert r["cross_loss_diff"] < TOL and r["cross_metric_diff"] < TOL, (name, r)
            assert r["cross_weight_diff"] < CROSS_WEIGHT_TOL, (name, r["cross_weight_diff"])


def test_world2_layouts_match_one_process_and_packing_invariance():
    names = ["tp2", "pp2", "pp2_vpp2", "ep2_moe", "dp2_distopt", "tp2_logits", "tp2_sp"]
    records = torchrun(SCRIPT, 2, ["--layouts", ",".join(names), "--packing"], timeout=500)
    _check_layouts(records, names)
    assert {r["impl"] for r in records if "layout" in r} == {"fused", "logits"}
    pack = next(r for r in records if r.get("packing"))
    assert len(set(pack["microbatches"])) == 3  # three really different packings
    assert max(pack["losses"]) - min(pack["losses"]) < TOL
    assert pack["grad_diff"] < TOL * pack["grad_max"] and pack["grad_max"] > 1e-3


def test_world4_tp2_pp2_matches_one_process():
    names = ["tp2_pp2", "tp2_pp2_logits"]
    _check_layouts(torchrun(SCRIPT, 4, ["--layouts", ",".join(names)], timeout=500), names)


def test_world2_kl_in_reward_matches_one_process():
    """REINFORCE++ with advantage.kl_coef > 0: the per-token KL gathered over DP, PP and CP ranks gives the
    one-process advantages, losses and weights."""
    names = ["dp2", "pp2", "cp2"]
    records = torchrun(REPO / "tests" / "mp" / "kl_reward_parity.py", 2, ["--layouts", ",".join(names)], timeout=500)
    got = {r["layout"]: r for r in records}
    assert sorted(got) == sorted(names)
    for name, r in got.items():
        assert r["update_ok"] and not r["names_differ"], (name, r)
        assert r["loss_diff"] < TOL and r["weight_diff"] < TOL and r["replica_diff"] < TOL, (name, r)
        assert r["metric_diff"] < TOL, (name, r["metric_diff"])
        assert abs(r["ref_kl"][0]) < 1e-6 and r["ref_kl"][-1] > 1e-4, (name, r["ref_kl"])  # the KL term is live


DSV3 = ["tp2_sp_dsv3", "ep2_dsv3", "pp2_dsv3", "tp2_mla", "tp2_sp_mtp"]


@pytest.fixture(scope="module")
def dsv3_records() -> list[dict]:
    """One world-2 launch for the DeepSeek-V3 layouts and pp2_mtp (tp2_sp_mtp's model: its one-process
    references are computed once), read by the two tests below."""
    return torchrun(SCRIPT, 2, ["--layouts", ",".join([*DSV3, "pp2_mtp"])], timeout=500)


def _of(records: list[dict], names: list[str]) -> list[dict]:
    return [r for r in records if r.get("layout") in names]


def test_world2_deepseek_v3_layouts_match_one_process(dsv3_records):
    """DeepSeek-V3 in miniature (MLA with YaRN, first layer dense, sigmoid router with expert bias, grouped
    top-k, routed scaling, shared expert) at TP=2 + SP, EP=2 and PP=2, and its attention alone at TP=2 without
    SP (the shared RoPE key's gradient summed over TP ranks), and with an MTP layer and its loss at TP=2 + SP: three
    GRPO steps equal to the one-process run (the MTP weights and mtp_loss included)."""
    _check_layouts(_of(dsv3_records, DSV3), DSV3)


def test_world2_mtp_on_the_last_pipeline_stage_matches_one_process(dsv3_records):
    """pp2: the MTP layer on the last stage with Megatron's embedding copy there (the tied weight it syncs; the
    output layer holds none, models/mtp.py); losses, mtp_loss and every weight equal the one-process run's."""
    records = _of(dsv3_records, ["pp2_mtp"])
    _check_layouts(records, ["pp2_mtp"])
    (r,) = [r for r in records if "layout" in r]
    assert all(x is not None and x > 0 for x in r["mtp_losses"]), r["mtp_losses"]  # the MTP loss ran at pp2
