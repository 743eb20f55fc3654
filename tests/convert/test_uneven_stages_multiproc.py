"""Uneven pipeline stages on CPU (gloo, 2 ranks), a 5-layer model that pp x vpp (2, 4) does not divide:
pp2 with parallel.first_stage_layers=2, and DeepSeek-V3 in miniature (MLA, MoE, an MTP layer) at pp2 x vpp2 with
parallel.pipeline_layout 'Et|tt|tt|mL' (the last chunk: the MTP layer and the loss only, as in DeepSeek-V3's
published layout). Three GRPO steps give the one-process losses, metrics, weights and log-probs, and the weight
sync's global tensor names and values (what the rollout engine receives) are the one-process model's; a checkpoint
saved in the uneven layout loads into one process with the same weights and the same next step."""
from __future__ import annotations

import pytest

from tests.mp.launch import REPO, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
TOL = 1e-5


def test_uneven_layouts_match_one_process_and_checkpoint_loads_into_one_stage(tmp_path):
    records = torchrun(REPO / "tests" / "mp" / "uneven_stages.py", 2, ["--dir", str(tmp_path / "ckpt")],
                       timeout=600)
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
