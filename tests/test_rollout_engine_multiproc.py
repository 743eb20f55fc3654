"""Rollout engine with tensor parallelism (torchrun, gloo, CPU): TP=2 generation equals TP=1, before and
after a bucketed broadcast weight update (full tensors from rank 0, each rank cutting its TP slice)."""
from pathlib import Path

import pytest
import torch

from tests.mp.launch import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
SCRIPT = Path(__file__).parent / "mp" / "rollout_tp.py"


def _by_key(records):
    return {(r["tag"], r["kind"], r["i"]): r for r in records}


def test_tp2_generation_equals_tp1_before_and_after_broadcast_update():
    tp1, tp2 = _by_key(torchrun(SCRIPT, 1)), _by_key(torchrun(SCRIPT, 2))
    assert tp1.keys() == tp2.keys() and len(tp1) == 2 * (6 + 3)
    for key, a in tp1.items():
        b = tp2[key]
        assert a["tokens"] == b["tokens"], key
        for la, lb in zip(a["logprobs"], b["logprobs"]):
            torch.testing.assert_close(lb, la, atol=1e-4, rtol=0)
        version = 0 if key[0] == "before" else 1
        assert all(v == version for vs in b["versions"] for v in vs)
        assert b["free_blocks"] == 64 and b["loaded"] == a["loaded"] > 0
    # the update changed the model: the log-probs of the greedy continuations moved
    before = torch.tensor([tp2[("before", "greedy", i)]["logprobs"][0] for i in range(6)])
    after = torch.tensor([tp2[("after", "greedy", i)]["logprobs"][0] for i in range(6)])
    assert (before - after).abs().max() > 1e-2
