"""Fast single-process tests of the trainer's pieces: log-probs/entropy, packing, masks, bad input.

The Megatron-Core paths (TP/PP/EP/DP parity, packing invariance of the real model) are in
tests/trainer/test_trainer_multiproc.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.data.shards import Trajectory, TrajectoryColumns
from megatron_rl.rl.config import AdvantageConfig, LossConfig
from megatron_rl.rl.losses import LossInputs, normaliser
from megatron_rl.trainer.logprobs import naive_logprobs_and_entropy, token_logprobs_and_entropy
from megatron_rl.trainer.packing import (
    PackingConfig,
    attention_inputs,
    block_causal_mask,
    check_samples,
    first_fit_decreasing,
    pack,
)
from megatron_rl.trainer.rl_step import RLConfig, token_advantages

VOCAB = 40


# ------------------------------------------------------------------------------------------ log-probs
def _grads(fn, x, *args, g):
    lp, ent = fn(x, *args)
    return lp, ent, torch.autograd.grad((lp * g[0] + ent * g[1]).sum(), x)[0]


@pytest.mark.parametrize("chunk", [None, 1, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_equal_naive_with_chunking_and_temperature(chunk, temperature):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 9, VOCAB, generator=gen, dtype=torch.float64)).requires_grad_()  # [b, s, V]
    t = torch.randint(0, VOCAB, (2, 9), generator=gen)
    g = torch.randn(2, 2, 9, generator=gen, dtype=torch.float64)  # upstream grads of (lp, entropy)
    lp, ent, grad = _grads(lambda x, t: token_logprobs_and_entropy(x, t, None, temperature, chunk), x, t, g=g)
    lp0, ent0, grad0 = _grads(lambda x, t: naive_logprobs_and_entropy(x, t, temperature), x, t, g=g)
    assert lp.shape == ent.shape == (2, 9)
    torch.testing.assert_close(lp, lp0, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent0, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, grad0, rtol=0, atol=1e-12)


def test_logprobs_fp32_and_bf16_inputs_close_to_naive():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(17, VOCAB, generator=gen)  # [N, V]
    t = torch.randint(0, VOCAB, (17,), generator=gen)
    lp, ent = token_logprobs_and_entropy(x, t, chunk_size=4)
    lp0, ent0 = naive_logprobs_and_entropy(x.double(), t)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp0, rtol=0, atol=1e-5)
    xb = x.bfloat16().requires_grad_()
    lpb, _ = token_logprobs_and_entropy(xb, t, chunk_size=4)
    lpb.sum().backward()
    assert lpb.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lpb.double(), naive_logprobs_and_entropy(xb.double(), t)[0], rtol=0, atol=1e-5)


def test_hidden_and_weight_path_equals_naive():
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(2, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)  # [b, s, h]
    w = torch.randn(VOCAB, 8, generator=gen, dtype=torch.float64, requires_grad=True)  # [V, h]
    t = torch.randint(0, VOCAB, (2, 6), generator=gen)
    g = torch.randn(2, 2, 6, generator=gen, dtype=torch.float64)
    lp, ent = token_logprobs_and_entropy((h, w), t, None, 0.8, 5)
    a = torch.autograd.grad((lp * g[0] + ent * g[1]).sum(), (h, w))
    lp0, ent0 = naive_logprobs_and_entropy(h @ w.t(), t, 0.8)
    b = torch.autograd.grad((lp0 * g[0] + ent0 * g[1]).sum(), (h, w))
    torch.testing.assert_close(lp, lp0, rtol=0, atol=1e-12)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-11)


def test_logprobs_reject_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs_and_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))


# ------------------------------------------------------------------------------------------- packing
def _traj(i: int, length: int, prompt: int, reward: float, group: int, gen: np.random.Generator,
          tokens=None) -> Trajectory:
    toks = gen.integers(0, VOCAB, length).astype(np.int32) if tokens is None else np.asarray(tokens, np.int32)
    mask = (np.arange(length) >= prompt).astype(np.uint8)
    return Trajectory(tokens=toks, logprobs=np.where(mask, -gen.random(length) * 3, 0).astype(np.float32),
                      loss_mask=mask, prompt_len=prompt, reward=reward, group_id=group, policy_version_first=0,
                      policy_version_last=0, env="test", task_id=f"t{group}", episode_id=f"ep{i}")


def make_batch(lengths=(9, 5, 14, 7, 11, 3, 8, 6), seed: int = 0) -> TrajectoryColumns:
    gen = np.random.default_rng(seed)
    trajs = [_traj(i, n, min(3, n - 1), float(gen.normal()), i // 4, gen) for i, n in enumerate(lengths)]
    return TrajectoryColumns.from_trajectories(trajs)


def test_first_fit_decreasing_packs_every_sample_once_within_budget():
    lengths = np.array([7, 3, 9, 2, 5, 5, 1, 8])
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(lengths[b].sum() <= 10 for b in bins)
    assert len(bins) == int(np.ceil(lengths.sum() / 10))  # this instance packs perfectly


def test_microbatches_hold_samples_whole_with_restarting_positions():
    cols, cfg = make_batch(), PackingConfig(max_tokens=16)
    keep, stats = check_samples(cols, VOCAB, cfg)
    mbs, stats = pack(cols, keep, cfg, 0, 1, stats=stats)
    seen = set()
    for mb in mbs:
        assert mb["tokens"].shape == (1, 16) and mb["position_ids"].shape == (1, 16)
        cu = mb["cu_seqlens"].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            sid = int(mb["sample_index"][0, a])
            assert mb["position_ids"][0, a:b].tolist() == list(range(b - a))
            if sid < 0:
                assert not mb["loss_mask"][0, a:b].any()
                continue
            s, e = cols.offsets[sid], cols.offsets[sid + 1]
            assert (mb["sample_index"][0, a:b] == sid).all() and b - a == e - s - 1
            assert mb["tokens"][0, a:b].tolist() == cols.tokens[s:e - 1].tolist()
            assert mb["labels"][0, a:b].tolist() == cols.tokens[s + 1:e].tolist()
            assert mb["loss_mask"][0, a:b].tolist() == cols.loss_mask[s + 1:e].tolist()
            seen.add(sid)
    assert seen == set(range(len(cols))) and stats.samples == len(cols)


def test_dp_ranks_get_equal_microbatch_counts_and_disjoint_samples():
    cols, cfg = make_batch(), PackingConfig(max_tokens=16)
    keep, _ = check_samples(cols, VOCAB, cfg)
    per_rank = [pack(cols, keep, cfg, r, 3)[0] for r in range(3)]
    assert len({len(m) for m in per_rank}) == 1
    ids = [int(i) for mbs in per_rank for mb in mbs for i in mb["sample_index"].unique() if i >= 0]
    assert sorted(ids) == list(range(len(cols)))


def test_block_causal_mask_blocks_other_samples():
    mask = block_causal_mask(torch.tensor([0, 2, 5, 6], dtype=torch.int32), 6)[0, 0]  # [S, S], True = masked
    allowed = ~mask
    assert allowed[1, 0] and allowed[4, 2] and not allowed[2, 1] and not allowed[0, 1] and not allowed[5, 4]
    assert allowed.diagonal().all()
    m, params = attention_inputs({"tokens": torch.zeros(1, 6), "cu_seqlens": torch.tensor([0, 2, 6])}, "local")
    assert params is None and m.shape == (1, 1, 6, 6)


class ToyCausalLM(torch.nn.Module):
    """One attention layer that honours the [1, 1, S, S] mask (True = masked): enough to see leaks."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.emb = torch.nn.Parameter(torch.randn(VOCAB, 16, generator=gen, dtype=torch.float64) * 0.5)
        self.pos = torch.nn.Parameter(torch.randn(32, 16, generator=gen, dtype=torch.float64) * 0.5)
        self.qkv = torch.nn.Parameter(torch.randn(16, 48, generator=gen, dtype=torch.float64) * 0.3)

    def forward(self, tokens, position_ids, mask):
        x = self.emb[tokens] + self.pos[position_ids]  # [1, S, 16]
        q, k, v = (x @ self.qkv).split(16, dim=-1)  # each [1, S, 16]
        scores = (q @ k.transpose(1, 2)).masked_fill(mask[:, 0], -1e4)  # [1, S, S]
        return (x + scores.softmax(-1) @ v) @ self.emb.t()  # [1, S, V]


def _toy_loss_and_grads(cols, max_tokens: int, loss_cfg: LossConfig):
    model, cfg = ToyCausalLM(), PackingConfig(max_tokens=max_tokens)
    keep, stats = check_samples(cols, VOCAB, cfg)
    adv = token_advantages(cols, AdvantageConfig())
    mbs, _ = pack(cols, keep, cfg, 0, 1, {"advantages": adv}, stats)
    z = sum(normaliser(loss_cfg, mb["loss_mask"].view(-1), mb["sample_index"].view(-1)) for mb in mbs)
    total = 0.0
    for mb in mbs:
        mask, _ = attention_inputs(mb, "local")
        lp, ent = token_logprobs_and_entropy(model(mb["tokens"], mb["position_ids"], mask), mb["labels"],
                                             chunk_size=7)
        inputs = LossInputs(logprobs=lp.view(-1), old_logprobs=mb["behaviour_logprobs"].view(-1).double(),
                            advantages=mb["advantages"].view(-1), loss_mask=mb["loss_mask"].view(-1),
                            sample_index=mb["sample_index"].view(-1), entropy=ent.view(-1), normaliser=z)
        loss = loss_cfg.build()(inputs).loss
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad for n, p in model.named_parameters()}, len(mbs)


@pytest.mark.parametrize("loss_name", ["grpo", "dapo"])
def test_loss_and_gradients_do_not_depend_on_packing(loss_name):
    cols = make_batch()
    loss_cfg = LossConfig(name=loss_name, entropy_coef=0.01)
    results = [_toy_loss_and_grads(cols, budget, loss_cfg) for budget in (13, 20, 31)]
    assert len({r[2] for r in results}) == 3  # really different packings
    for loss, grads, _ in results[1:]:
        assert loss == pytest.approx(results[0][0], abs=1e-7)  # the losses' per-token terms are fp32
        for name, g in grads.items():
            torch.testing.assert_close(g, results[0][1][name], rtol=1e-5, atol=1e-7)


def test_masked_tokens_get_zero_gradient():
    cols, cfg = make_batch(), PackingConfig(max_tokens=64)
    keep, stats = check_samples(cols, VOCAB, cfg)
    mb = pack(cols, keep, cfg, 0, 1, {"advantages": token_advantages(cols, AdvantageConfig())}, stats)[0][0]
    logits = torch.randn(1, 64, VOCAB, dtype=torch.float64, requires_grad=True)  # [1, S, V]
    lp, ent = token_logprobs_and_entropy(logits, mb["labels"], chunk_size=10)
    mask = mb["loss_mask"].view(-1)
    inputs = LossInputs(logprobs=lp.view(-1), old_logprobs=lp.view(-1).detach() - 0.1,
                        advantages=mb["advantages"].view(-1) + 1.0, loss_mask=mask,
                        sample_index=mb["sample_index"].view(-1), entropy=ent.view(-1))
    LossConfig(name="grpo", entropy_coef=0.1).build()(inputs).loss.backward()
    row_norm = logits.grad[0].abs().sum(-1)  # [S]
    assert (row_norm[mask == 0] == 0).all() and (row_norm[mask == 1] > 0).all()
    assert (mask == 0).any()


# ------------------------------------------------------------------------------------------ bad input
def test_overlong_sample_raises_naming_it_or_is_skipped_and_counted():
    cols = make_batch(lengths=(5, 30, 6))
    with pytest.raises(ValueError, match=r"sample 1 \(episode 'ep1'\).*max_tokens"):
        check_samples(cols, VOCAB, PackingConfig(max_tokens=16))
    keep, stats = check_samples(cols, VOCAB, PackingConfig(max_tokens=16, overlong="skip"))
    assert keep.tolist() == [True, False, True] and stats.skipped_overlong == 1 and stats.skipped_ids == ["ep1"]
    mbs, stats = pack(cols, keep, PackingConfig(max_tokens=16), 0, 1, stats=stats)
    assert 1 not in torch.cat([mb["sample_index"] for mb in mbs], 1).tolist()[0]


def test_empty_loss_mask_is_skipped_and_counted():
    gen = np.random.default_rng(0)
    trajs = [_traj(0, 6, 2, 1.0, 0, gen), _traj(1, 6, 6, 0.0, 0, gen), _traj(2, 5, 2, 0.5, 0, gen)]
    keep, stats = check_samples(TrajectoryColumns.from_trajectories(trajs), VOCAB, PackingConfig(max_tokens=16))
    assert keep.tolist() == [True, False, True] and stats.skipped_empty == 1 and stats.skipped_ids == ["ep1"]


def test_nan_reward_raises_naming_the_sample():
    cols = make_batch(lengths=(5, 6, 7))
    cols.reward[2] = np.nan  # columns built by a caller (shards refuse NaN at write time)
    with pytest.raises(ValueError, match=r"sample 2 \(episode 'ep2'\).*non-finite reward"):
        check_samples(cols, VOCAB, PackingConfig(max_tokens=16))


def test_token_out_of_vocabulary_raises_naming_the_sample():
    gen = np.random.default_rng(0)
    trajs = [_traj(0, 5, 2, 1.0, 0, gen), _traj(1, 4, 1, 1.0, 0, gen, tokens=[1, 2, VOCAB + 3, 4])]
    with pytest.raises(ValueError, match=r"sample 1 \(episode 'ep1'\).*outside the vocabulary \[0, 40\)"):
        check_samples(TrajectoryColumns.from_trajectories(trajs), VOCAB, PackingConfig(max_tokens=16))


def test_rl_config_rejects_impossible_combinations():
    with pytest.raises(ConfigError, match="recompute"):
        RLConfig(epochs=2).validate()
    with pytest.raises(ConfigError, match="reference"):
        RLConfig(loss=LossConfig(name="grpo", kl_coef=0.1)).validate()
    with pytest.raises(ConfigError, match="max_tokens"):
        RLConfig(packing=PackingConfig(max_tokens=0)).validate()
    RLConfig(loss=LossConfig(name="grpo", kl_coef=0.1), reference=True, epochs=2, old_logprobs="recompute").validate()
