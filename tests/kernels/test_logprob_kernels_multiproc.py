"""Vocab-parallel (TP=2 over gloo) fused log-prob/entropy equals the TP=1 naive full-logits computation."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.mp.launch import torchrun
from tests.mp.logprob_tp import CASES, TP, make_case

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]
SCRIPT = Path(__file__).parents[1] / "mp" / "logprob_tp.py"
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def naive(name: str) -> dict:
    """TP=1 full logits, fp64, on the real vocab; grad of W is 0 on padding rows."""
    hidden, weight, targets, ca, cc, vocab_size, temperature = make_case(name)
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    logp_all = torch.log_softmax(h @ w[:vocab_size].T / temperature, dim=-1)  # [T, vocab_size]
    logprob = logp_all.gather(1, targets[:, None]).squeeze(1)  # [T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [T]
    (ca.double() * logprob + cc.double() * entropy).sum().backward()
    return {"logprob": logprob, "entropy": entropy, "grad_h": h.grad, "grad_w": w.grad}


def _check(records: list[dict], impl: str, world: int) -> None:
    for name in CASES:
        want = naive(name)
        recs = [r for r in records if r["case"] == name and r["impl"] == impl]
        assert sorted(r["rank"] for r in recs) == list(range(world)), (name, impl)
        for r in recs:
            for key in ("logprob", "entropy", "grad_h"):
                where = f"{name}/{impl} rank {r['rank']} {key}"
                torch.testing.assert_close(torch.tensor(r[key], dtype=torch.float64), want[key], atol=2e-5,
                                           rtol=1e-4, msg=lambda m, w=where: f"{w}: {m}")
        for start in range(0, world, TP):  # each TP group's slices make up the full grad of W
            group = sorted((r for r in recs if start <= r["rank"] < start + TP), key=lambda r: r["tp_rank"])
            grad_w = torch.cat([torch.tensor(r["grad_w"], dtype=torch.float64) for r in group])  # [V, H]
            torch.testing.assert_close(grad_w, want["grad_w"], atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def records() -> list[dict]:
    """One world-4 launch: torch on both TP groups, then (if installed) triton's interpreter on ranks 0 and 1."""
    return torchrun(SCRIPT, 4, ["torch", *(["triton"] if HAVE_TRITON else [])], timeout=360,
                    env={"TRITON_INTERPRET": "1"})


def test_tp2_torch_matches_naive_tp1(records):
    """World 4 = two TP=2 groups passed explicitly; the group rank picks the slice (global rank 2 is slice 0)."""
    _check(records, "torch", 4)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton); interpreter needs it")
def test_tp2_triton_interpreter_matches_naive_tp1(records):
    _check(records, "triton", 2)
