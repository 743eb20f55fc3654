"""LoRA with tensor parallelism (TP=2, gloo, two processes) equals the one-process run (tests/mp/lora_tp.py):
column-parallel adapters with A replicated and B split, row-parallel ones with A split and B replicated."""
from __future__ import annotations

import pytest

from tests.mp.launch import REPO, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
TOL = 1e-5


def test_tp2_lora_steps_match_one_process():
    [r] = torchrun(REPO / "tests" / "mp" / "lora_tp.py", 2, [], timeout=300)
    assert r["ok"] and r["names"] == r["tp2_names"]
    assert len({round(x, 6) for x in r["losses"]}) == 3  # the adapters moved between steps
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) < TOL, (r["losses"], r["ref_losses"])
    assert max(r["weight_diff"].values()) < TOL, r["weight_diff"]
    lora = {n: v for n, v in r["adapter_max"].items()}
    assert len(lora) == 16 and all(v > 0 for v in lora.values())  # every B trained away from zero
