"""Context parallelism of the RL trainer on Megatron-Core vs the one-process run (CPU, gloo).

Three GRPO steps (KL reference, recomputed old log-probs, TIS, entropy bonus, chunked log-probs) with every
packed sample split over the CP ranks (load-balanced, padded to 2*cp, the local spec's CPDotProductAttention)
must give the losses and updated weights of the one-process CP=1 run within 1e-5 (fp32), although packing
differs (per-sample padding). One launch per world size: CP=2 alone, then TP=2xCP=2 and CP=2xDP=2
(distributed optimizer) in one 4-rank launch.
"""
from __future__ import annotations

import pytest

from tests.mp.launch import REPO, torchrun
from tests.trainer.test_trainer_multiproc import _check_layouts

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
SCRIPT = REPO / "tests" / "mp" / "trainer_cp.py"


def _check_split(records: list[dict], world: int) -> None:
    for r in records:
        assert len(r["splits"]) == world
        for s in r["splits"]:
            assert s["cp_size"] == 2 and s["shape"] == [1, 20]  # max_tokens 40 split over 2 CP ranks
            assert s["core_attention"] == ["CPDotProductAttention"]


def test_cp2_matches_one_process():
    records = torchrun(SCRIPT, 2, ["--layouts", "cp2"], timeout=400)
    _check_layouts(records, ["cp2"])
    _check_split(records, 2)


def test_world4_tp2_cp2_and_cp2_dp2_match_one_process():
    names = ["tp2_cp2", "cp2_dp2_distopt"]
    records = torchrun(SCRIPT, 4, ["--layouts", ",".join(names)], timeout=500)
    _check_layouts(records, names)
    _check_split(records, 4)
