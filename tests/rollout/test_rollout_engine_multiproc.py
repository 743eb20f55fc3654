"""Rollout engine with tensor parallelism (torchrun, gloo, CPU): TP=2 generation equals TP=1, before and
after a bucketed broadcast weight update (full tensors from rank 0, each rank cutting its TP slice).

One TP=1 and one TP=2 launch of tests/mp/rollout_tp.py run both models (module fixture `direct`), read by the
parametrized test and by the serving test's comparison with the engine run directly."""
from pathlib import Path

import pytest
import torch

from tests.mp.launch import torchrun

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
SCRIPT = Path(__file__).parents[1] / "mp" / "rollout_tp.py"


def _by_key(records, model: str | None = None):
    return {(r["tag"], r["kind"], r["i"]): r for r in records if model is None or r["model"] == model}


@pytest.fixture(scope="module")
def direct() -> dict[int, list[dict]]:
    """TP size -> the records of one launch of rollout_tp.py running both models."""
    return {tp: torchrun(SCRIPT, tp, ["--models", "gqa,dsv3"]) for tp in (1, 2)}


@pytest.mark.parametrize("model", ["gqa", "dsv3"])
def test_tp2_generation_equals_tp1_before_and_after_broadcast_update(direct, model):
    """dsv3: DeepSeek-V3 in miniature (multi-latent attention over the compressed-latent cache, MoE)."""
    tp1, tp2 = _by_key(direct[1], model), _by_key(direct[2], model)
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


SERVE = Path(__file__).parents[1] / "mp" / "rollout_tp_serve.py"


def test_tp2_http_serving_equals_tp1(direct):
    """TP rank 0 serves HTTP and broadcasts requests/updates; TP=2 answers equal TP=1 answers."""
    tp1, tp2 = _by_key(torchrun(SERVE, 1)), _by_key(torchrun(SERVE, 2))
    assert ("error", "error", 0) not in tp2, tp2.get(("error", "error", 0))
    assert ("error", "error", 0) not in tp1, tp1.get(("error", "error", 0))
    assert tp1.keys() == tp2.keys() and len(tp1) == 2 * 6 + 4
    for key, a in tp1.items():
        b = tp2[key]
        assert b["free_blocks"] == 64
        if key[1] in ("greedy", "sampled", "compressed"):
            assert a["tokens"] == b["tokens"], key
        if "logprobs" in a:
            for la, lb in zip(a["logprobs"], b["logprobs"]):
                torch.testing.assert_close(lb, la, atol=1e-4, rtol=0)
        if key[1] == "greedy":
            assert all(v == (0 if key[0] == "before" else 1) for vs in b["versions"] for v in vs)
    assert tp2[("update", "update", 0)]["policy_version"] == 1 and tp2[("update", "update", 0)]["tensors"] > 0
    assert tp2[("after", "health", 0)]["policy_version"] == 1
    comp = tp2[("before", "compressed", 0)]
    assert comp["prompt"] == [257, *range(20, 25), 300, *range(37, 44)]
    assert comp["compression"]["dropped_turns"] == [1, 2]
    # the served TP=2 greedy answers equal the TP=1 engine run directly (tests/mp/rollout_tp.py)
    direct = _by_key(direct[1], "gqa")
    for i in range(6):
        assert tp2[("before", "greedy", i)]["tokens"] == direct[("before", "greedy", i)]["tokens"]
        assert tp2[("after", "greedy", i)]["tokens"] == direct[("after", "greedy", i)]["tokens"]
