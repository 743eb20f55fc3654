"""The local spec's core attention through torch SDPA (models/sdpa_attention.py) computes what Megatron-Core's
DotProductAttention computes: outputs and gradients within fp32 rounding, for the trainer's packed block-causal
mask (one causal SDPA per segment), another boolean mask and no mask; and the trainer's policy uses it."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.models.sdpa_attention import SDPADotProductAttention, block_causal_segments
from megatron_rl.trainer.packing import block_causal_mask
from tests.rollout.test_rollout_engine import _init_single

CU = torch.tensor([0, 5, 6, 13, 20, 24], dtype=torch.int32)  # segments 5, 1, 7, 7, 4 (the last: padding)


def test_segments_are_read_from_the_packing_mask_and_other_masks_are_not_taken_for_block_causal():
    assert block_causal_segments(block_causal_mask(CU, 24)) == [(0, 5), (5, 6), (6, 13), (13, 20), (20, 24)]
    causal = ~torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    assert block_causal_segments(causal) == [(0, 6)]
    leak = block_causal_mask(CU, 24).clone()
    leak[0, 0, 7, 2] = False  # a query of segment 3 sees a key of segment 1
    assert block_causal_segments(leak) is None
    hole = block_causal_mask(CU, 24).clone()
    hole[0, 0, 9, 7] = True  # a key hidden inside a segment
    assert block_causal_segments(hole) is None


def _modules():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    pgs = _init_single()
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            kv_channels=8, attention_dropout=0.0, use_cpu_initialization=True)
    args = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                pg_collection=pgs)
    return DotProductAttention(**args), SDPADotProductAttention(**args)


def _run(module, q, k, v, mask, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask)  # [s, b, np*d]
    out.backward(grad)
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("case", ["packed", "other_mask", "no_mask"])
def test_sdpa_attention_equals_megatrons_dot_product_attention(case, monkeypatch):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    megatron, ours = _modules()
    gen = torch.Generator().manual_seed(0)
    s = 24
    q = torch.randn(s, 1, 4, 8, generator=gen)  # [s, b, np, d]
    k, v = (torch.randn(s, 1, 2, 8, generator=gen) for _ in range(2))  # [s, b, ng, d]: GQA, 2 queries per group
    mask = {"packed": block_causal_mask(CU, s), "no_mask": None,
            "other_mask": (torch.rand(1, 1, s, s, generator=gen) < 0.4) & ~torch.eye(s, dtype=torch.bool)}[case]
    grad = torch.randn(s, 1, 32, generator=gen)
    want, want_grads = _run(megatron, q, k, v, mask, grad)
    monkeypatch.setattr(DotProductAttention, "forward", None)  # ours must not fall back to Megatron's arithmetic
    got, got_grads = _run(ours, q, k, v, mask, grad)
    assert got.shape == want.shape == (s, 1, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    if case == "packed":  # really per segment: the first query of segment 3 sees nothing of segments 1-2
        assert torch.allclose(got[6, 0].view(4, 8), v[6, 0].repeat_interleave(2, 0), atol=1e-6)


def test_the_trainers_local_spec_policy_uses_sdpa_attention():
    from megatron_rl.models.gpt import ModelConfig, build_gpt
    from megatron_rl.parallel import ParallelConfig

    pgs = _init_single()
    model = build_gpt(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                  max_seq_length=32), ParallelConfig(), pgs)
    kinds = {type(layer.self_attention.core_attention).__name__ for layer in model.decoder.layers}
    assert kinds == {"SDPADotProductAttention"}


@pytest.mark.slow
def test_trainer_micro_batches_end_after_their_samples_with_the_same_loss_and_gradients(monkeypatch):
    """RLTrainer (pp = cp = ep = 1) packs micro-batches only as long as their samples (rounded up to 16
    slots), not the whole max_tokens budget: the same loss and gradients as the full-length packing."""
    from megatron_rl.trainer.rl_step import RLTrainer
    from tests.mp.trainer_parity import batch
    from tests.trainer.test_trainer_fused_logprob import _ctx, _trainer

    ctx, results = _ctx(), {}
    for trim in (True, False):
        if not trim:
            monkeypatch.setattr(RLTrainer, "_trim_to", lambda self: 0)
        trainer = _trainer(ctx, "fused", True, max_tokens=120)
        lengths = [mb["tokens"].shape[-1] for mb in trainer.prepare(batch(0))[0]]
        results[trim] = (*trainer.compute_gradients(batch(0)), lengths)
    (loss, grads, lengths), (loss_full, grads_full, lengths_full) = results[True], results[False]
    assert set(lengths_full) == {120} and sum(lengths) < sum(lengths_full)
    assert all(n % 16 == 0 or n == 120 for n in lengths)  # rounded up to 16 slots, at most max_tokens
    assert abs(loss_full) > 1e-4 and loss == pytest.approx(loss_full, abs=1e-6)
    assert sorted(grads) == sorted(grads_full)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_full[name], rtol=1e-5, atol=1e-6)
