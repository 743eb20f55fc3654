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
gradients do not depend on the packing. All world-2 layouts (those of tests/mp/kl_reward_parity.py too) run in
one launch (module fixture `world2`), and all world-4 ones in another (`world4`), read by the tests below; so do
the layouts of the context-parallel, LoRA, checkpoint and uneven-stage scripts (tests/mp/trainer_cp.py,
lora_tp.py, ckpt_resume.py, uneven_stages.py; formerly one launch each from their own test files).
"""
from __future__ import annotations

import pytest

from tests.mp.launch import REPO, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
SCRIPT = REPO / "tests" / "mp" / "trainer_parity.py"
TOL = 1e-5
CROSS_WEIGHT_TOL = 1e-4
LAUNCH_ENV = {"TORCHDYNAMO_DISABLE": "1"}
"""Megatron's torch.compile-decorated functions (the MoE router's, DeepSeek-V3's expert bias) run eagerly: compiling
them cost ~12 CPU-s in every rank that routes, for the same result (the deferred compile is tested in
tests/compat/test_deferred_compile.py). launch.torchrun already gives each rank one thread."""


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


WORLD2 = ["tp2", "pp2", "pp2_vpp2", "ep2_moe", "dp2_distopt", "tp2_logits", "tp2_sp"]
DSV3 = ["tp2_sp_dsv3", "ep2_dsv3", "pp2_dsv3", "tp2_mla", "tp2_sp_mtp"]
KL = ["dp2", "pp2", "cp2"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict[str, list[dict]]:
    """One world-2 launch for every world-2 layout: WORLD2 with the packing check, the DeepSeek-V3 layouts and
    pp2_mtp (tp2_sp_mtp's model: its one-process references are computed once), kl_reward_parity.py's layouts
    (--kl-layouts), trainer_cp.py's cp2 (--cp-layouts), lora_tp.py and uneven_stages.py (--also)."""
    ckpt = tmp_path_factory.mktemp("uneven") / "ckpt"
    records = torchrun(SCRIPT, 2, ["--layouts", ",".join([*WORLD2, *DSV3, "pp2_mtp"]), "--packing",
                                   "--kl-layouts", ",".join(KL), "--cp-layouts", "cp2",
                                   "--also", f"lora_tp,uneven_stages:{ckpt}"], timeout=1500, env=LAUNCH_ENV)
    return _split(records)


def _split(records: list[dict]) -> dict[str, list[dict]]:
    """The records of one launch by origin: parity (trainer_parity.py's layouts), kl (kl_reward_parity.py), cp
    (trainer_cp.py), and each --also script's name."""
    out = {"parity": [], "kl": [], "cp": []}
    for r in records:
        key = "kl" if r.get("kl_reward") else "cp" if r.get("cp") else r.get("script", "parity")
        out.setdefault(key, []).append(r)
    return out


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict[str, list[dict]]:
    """One world-4 launch: tp2_pp2 (fused and logits), trainer_cp.py's world-4 layouts and ckpt_resume.py."""
    ckpt = tmp_path_factory.mktemp("ckpt") / "ckpt"
    return _split(torchrun(SCRIPT, 4, ["--layouts", "tp2_pp2,tp2_pp2_logits", "--cp-layouts",
                                       "tp2_cp2,cp2_dp2_distopt", "--also", f"ckpt_resume:{ckpt}"], timeout=1200,
                           env=LAUNCH_ENV))


def test_world2_layouts_match_one_process_and_packing_invariance(world2):
    records = _of(world2["parity"], WORLD2) + [r for r in world2["parity"] if r.get("packing")]
    _check_layouts(records, WORLD2)
    assert {r["impl"] for r in records if "layout" in r} == {"fused", "logits"}
    pack = next(r for r in records if r.get("packing"))
    assert len(set(pack["microbatches"])) == 3  # three really different packings
    assert max(pack["losses"]) - min(pack["losses"]) < TOL
    assert pack["grad_diff"] < TOL * pack["grad_max"] and pack["grad_max"] > 1e-3


def test_world4_tp2_pp2_matches_one_process(world4):
    names = ["tp2_pp2", "tp2_pp2_logits"]
    _check_layouts(world4["parity"], names)


def test_world2_kl_in_reward_matches_one_process(world2):
    """REINFORCE++ with advantage.kl_coef > 0: the per-token KL gathered over DP, PP and CP ranks gives the
    one-process advantages, losses and weights."""
    records = world2["kl"]
    got = {r["layout"]: r for r in records}
    assert sorted(got) == sorted(KL) and len(records) == len(KL)
    for name, r in got.items():
        assert r["update_ok"] and not r["names_differ"], (name, r)
        assert r["loss_diff"] < TOL and r["weight_diff"] < TOL and r["replica_diff"] < TOL, (name, r)
        assert r["metric_diff"] < TOL, (name, r["metric_diff"])
        assert abs(r["ref_kl"][0]) < 1e-6 and r["ref_kl"][-1] > 1e-4, (name, r["ref_kl"])  # the KL term is live


def _of(records: list[dict], names: list[str]) -> list[dict]:
    return [r for r in records if r.get("layout") in names]


def test_world2_deepseek_v3_layouts_match_one_process(world2):
    """DeepSeek-V3 in miniature (MLA with YaRN, first layer dense, sigmoid router with expert bias, grouped
    top-k, routed scaling, shared expert) at TP=2 + SP, EP=2 and PP=2, and its attention alone at TP=2 without
    SP (the shared RoPE key's gradient summed over TP ranks), and with an MTP layer and its loss at TP=2 + SP: three
    GRPO steps equal to the one-process run (the MTP weights and mtp_loss included)."""
    _check_layouts(_of(world2["parity"], DSV3), DSV3)


def test_world2_mtp_on_the_last_pipeline_stage_matches_one_process(world2):
    """pp2: the MTP layer on the last stage with Megatron's embedding copy there (the tied weight it syncs; the
    output layer holds none, models/mtp.py); losses, mtp_loss and every weight equal the one-process run's."""
    records = _of(world2["parity"], ["pp2_mtp"])
    _check_layouts(records, ["pp2_mtp"])
    (r,) = [r for r in records if "layout" in r]
    assert all(x is not None and x > 0 for x in r["mtp_losses"]), r["mtp_losses"]  # the MTP loss ran at pp2


# Context parallelism (formerly tests/trainer/test_trainer_cp_multiproc.py; its layouts now run in the
# launches above, tests/mp/trainer_cp.py's run_layout): three GRPO steps with every packed sample split over the
# CP ranks (load-balanced, padded to 2*cp, the local spec's CPDotProductAttention) give the losses and updated
# weights of the one-process CP=1 run within 1e-5 (fp32), although packing differs (per-sample padding).
def _check_split(records: list[dict], world: int) -> None:
    for r in records:
        assert len(r["splits"]) == world
        for s in r["splits"]:
            assert s["cp_size"] == 2 and s["shape"] == [1, 20]  # max_tokens 40 split over 2 CP ranks
            assert s["core_attention"] == ["CPDotProductAttention"]


def test_cp2_matches_one_process(world2):
    records = world2["cp"]
    _check_layouts(records, ["cp2"])
    _check_split(records, 2)


def test_world4_tp2_cp2_and_cp2_dp2_match_one_process(world4):
    names = ["tp2_cp2", "cp2_dp2_distopt"]
    records = world4["cp"]
    _check_layouts(records, names)
    _check_split(records, 4)


# LoRA with tensor parallelism (formerly tests/trainer/test_lora_multiproc.py; tests/mp/lora_tp.py in the world-2
# launch): TP=2 equals the one-process run, column-parallel adapters with A replicated and B split, row-parallel
# ones with A split and B replicated.
def test_tp2_lora_steps_match_one_process(world2):
    [r] = world2["lora_tp"]
    assert r["ok"] and r["names"] == r["tp2_names"]
    assert len({round(x, 6) for x in r["losses"]}) == 3  # the adapters moved between steps
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < TOL, (r["losses"], r["ref_losses"])
    assert max(r["weight_diff"].values()) < TOL, r["weight_diff"]
    lora = {n: v for n, v in r["adapter_max"].items()}
    assert len(lora) == 16 and all(v > 0 for v in lora.values())  # every B trained away from zero


# Exact trainer checkpoints (formerly tests/trainer/test_checkpoint_multiproc.py; tests/mp/ckpt_resume.py in the
# world-4 launch): save at TP=2 x PP=2 with the DistributedOptimizer after two RL steps; resume at the same
# layout (bitwise-equal next step) and at TP=1 (the same next-step loss and weights as the unbroken run, fp32).
def test_save_tp2_pp2_resume_same_layout_bitwise_and_at_tp1(world4):
    records = world4["ckpt_resume"]
    same = next(r for r in records if r["kind"] == "same_layout")
    assert same["bitwise"] and same["step"] == 3, same
    tp1 = next(r for r in records if r["kind"] == "tp1")
    assert tp1["step"] == 3
    assert abs(tp1["loss"] - tp1["unbroken"]) < 1e-5, tp1
    assert tp1["weight_diff"] < 1e-5, tp1


# Uneven pipeline stages (formerly tests/convert/test_uneven_stages_multiproc.py; tests/mp/uneven_stages.py in the
# world-2 launch), a 5-layer model that pp x vpp (2, 4) does not divide: pp2 with parallel.first_stage_layers=2,
# and DeepSeek-V3 in miniature (MLA, MoE, an MTP layer) at pp2 x vpp2 with parallel.pipeline_layout 'Et|tt|tt|mL'
# (the last chunk: the MTP layer and the loss only, as in DeepSeek-V3's published layout). Three GRPO steps give
# the one-process losses, metrics, weights and log-probs, and the weight sync's global tensor names and values
# (what the rollout engine receives) are the one-process model's; a checkpoint saved in the uneven layout loads
# into one process with the same weights and the same next step.
def test_uneven_layouts_match_one_process_and_checkpoint_loads_into_one_stage(world2):
    records = world2["uneven_stages"]
    got = {r["layout"]: r for r in records if "layout" in r}
    assert sorted(got) == ["pp2_first2", "pp2_vpp2_layout_dsv3_mtp"]
    rank1 = next(r for r in records if r.get("rank") == 1)
    # the layers each rank built: 2 + 3, and [1, 2] + [2, 0] (rank 1's second chunk holds no layer)
    assert (got["pp2_first2"]["chunks"], rank1["chunks"]["pp2_first2"]) == ([2], [3])
    assert (got["pp2_vpp2_layout_dsv3_mtp"]["chunks"], rank1["chunks"]["pp2_vpp2_layout_dsv3_mtp"]) == ([1, 2], [2, 0])
    for name, r in got.items():
        assert r["update_ok"] and not r["names_differ"], (name, r)
        assert r["loss_diff"] < TOL and r["metric_diff"] < TOL and r["weight_diff"] < TOL, (name, r)
        assert r["logprobs"] > 100 and r["logprob_diff"] < TOL, (name, r)
        # the engine's weight sync: every tensor under its one-process name, with its value
        assert not r["sync_names_differ"] and r["sync_tensors"] > 20 and r["sync_diff"] < TOL, (name, r)
        assert len({round(x, 6) for x in r["losses"]}) == 3  # the weights moved between steps
    assert all(x > 0 for x in got["pp2_vpp2_layout_dsv3_mtp"]["mtp_losses"])  # the MTP loss ran on the last chunk
    back = next(r for r in records if r.get("kind") == "resume_one_process")
    assert back["loaded_diff"] == 0.0 and back["moved"] > 1e-4, back  # loaded = saved (not the final weights)
    assert abs(back["loss"] - back["unbroken"]) < TOL and back["weight_diff"] < TOL, back
