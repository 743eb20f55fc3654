"""Policy losses: hand-computed values, gradient regions, packing/DP invariance, registry contract, config."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.config import ConfigError, from_dict, undocumented_fields
from megatron_rl.rl import LOSSES, LossConfig, LossInputs, LossOutput, kl_penalty, normaliser, sample_token_counts
from megatron_rl.rl.config import AGGREGATIONS
from megatron_rl.rl.losses import kl_estimate, loss_defaults

LN2 = math.log(2.0)


def _inputs(ratio, adv, mask=None, sample_index=None, old=None, **extra) -> tuple[LossInputs, torch.Tensor]:
    """A batch whose ratio pi/pi_old is `ratio` exactly; returns it and the logprobs leaf."""
    ratio = torch.tensor(ratio, dtype=torch.float32)
    old = torch.zeros_like(ratio) if old is None else torch.tensor(old, dtype=torch.float32)
    logprobs = (old + ratio.log()).detach().requires_grad_(True)
    t = ratio.numel()
    batch = LossInputs(
        logprobs=logprobs, old_logprobs=old, advantages=torch.tensor(adv, dtype=torch.float32),
        loss_mask=torch.ones(t, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool),
        sample_index=torch.zeros(t, dtype=torch.long) if sample_index is None else torch.tensor(sample_index),
        **extra)
    return batch, logprobs


def _grad(out: LossOutput, leaf: torch.Tensor) -> list[float]:
    out.loss.backward()
    return leaf.grad.tolist()


# ----------------------------------------------------------------------------------- hand-computed
def test_ppo_clip_and_dual_clip_by_hand():
    # r:  1.5 (A=1, clipped), 0.5 (A=-1, clipped), 1.1 (A=2, inside), 0.5 (A=1, below: unclipped, min picks it),
    #     1.5 (A=-1, above: unclipped, under the dual cap 3), 4.0 (A=-1, dual-clipped at 3)
    ratio, adv = [1.5, 0.5, 1.1, 0.5, 1.5, 4.0], [1.0, -1.0, 2.0, 1.0, -1.0, -1.0]
    batch, lp = _inputs(ratio, adv)
    out = LOSSES.get("ppo")(batch, LossConfig(name="ppo", dual_clip=3.0))
    # per-token losses: -1.2, 0.8, -2.2, -0.5, 1.5, 3.0 -> sum 1.4, token-mean over 6
    assert out.loss.item() == pytest.approx(1.4 / 6, rel=1e-6)
    # d l_t / d log pi_t = -A r on unclipped tokens, 0 in the clip and dual-clip regions
    assert _grad(out, lp) == pytest.approx([0.0, 0.0, -2.2 / 6, -0.5 / 6, 1.5 / 6, 0.0], abs=1e-6)
    assert out.metrics["clip_fraction"].item() == pytest.approx(2 / 6)
    assert out.metrics["dual_clip_fraction"].item() == pytest.approx(1 / 6)
    assert out.metrics["ratio_max"].item() == pytest.approx(4.0)
    assert out.metrics["ratio_min"].item() == pytest.approx(0.5)
    assert out.metrics["num_tokens"].item() == 6

    batch, lp = _inputs(ratio, adv)
    out = LOSSES.get("ppo")(batch, LossConfig(name="ppo"))  # no dual clip: last token gives 4.0, gradient 4
    assert out.loss.item() == pytest.approx(2.4 / 6, rel=1e-6)
    assert _grad(out, lp)[5] == pytest.approx(4.0 / 6)


def test_grpo_seq_mean_token_mean_with_k3_kl_by_hand():
    # ratio 1 everywhere; sample 0 has 2 tokens (A=1), sample 1 one token (A=-0.5); a prompt token is masked.
    batch, lp = _inputs([1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, -0.5], mask=[0, 1, 1, 1], sample_index=[0, 0, 0, 1],
                        ref_logprobs=torch.tensor([0.0, -LN2, 0.0, LN2]))
    out = LOSSES.get("grpo")(batch, LossConfig(name="grpo", kl_coef=0.1))
    k3_up = 0.5 - 1 + LN2   # log pi - log ref = ln 2: exp(-ln 2) - 1 + ln 2
    k3_down = 2 - 1 - LN2   # log pi - log ref = -ln 2
    sample0 = ((-1 + 0.1 * k3_up) + (-1 + 0.0)) / 2
    sample1 = 0.5 + 0.1 * k3_down
    assert out.loss.item() == pytest.approx((sample0 + sample1) / 2, rel=1e-6)
    assert out.metrics["ref_kl"].item() == pytest.approx((k3_up + 0 + k3_down) / 3, rel=1e-6)
    # gradient on token 1: (1/2 samples) * (1/2 tokens) * d/dlogp[-A r + 0.1 k3] = 1/4 * (-1 + 0.1 * (1 - 1/2))
    assert _grad(out, lp)[1] == pytest.approx(0.25 * (-1 + 0.1 * 0.5), rel=1e-6)


def test_dr_grpo_sums_tokens_over_a_constant():
    # lengths 3 and 1; A = 1 on sample 0, -2 on sample 1; ratio 1: per-token loss -A.
    batch, lp = _inputs([1.0] * 4, [1.0, 1.0, 1.0, -2.0], sample_index=[0, 0, 0, 1])
    out = LOSSES.get("dr_grpo")(batch, LossConfig(name="dr_grpo", loss_constant=4.0))
    assert out.loss.item() == pytest.approx((-3 + 2) / (4.0 * 2))  # sum / (loss_constant * samples)
    # per-token gradient -A / 8: independent of the sample's length (no length normalisation)
    assert _grad(out, lp) == pytest.approx([-1 / 8, -1 / 8, -1 / 8, 2 / 8])
    batch, _ = _inputs([1.0] * 4, [1.0, 1.0, 1.0, -2.0], sample_index=[0, 0, 0, 1])
    grpo = LOSSES.get("grpo")(batch, LossConfig(name="grpo"))
    assert grpo.loss.item() == pytest.approx((-1 + 2) / 2)  # the length-normalised value differs


def test_dapo_clip_higher_and_token_mean_by_hand():
    # 1.25 is inside DAPO's [0.8, 1.28] but outside PPO's [0.8, 1.2]; 1.3 is clipped at 1.28.
    ratio, adv, idx = [1.25, 1.3, 0.7, 1.0], [1.0, 1.0, 1.0, -1.0], [0, 0, 0, 1]
    batch, lp = _inputs(ratio, adv, sample_index=idx)
    out = LOSSES.get("dapo")(batch, LossConfig(name="dapo"))
    assert out.loss.item() == pytest.approx((-1.25 - 1.28 - 0.7 + 1.0) / 4, rel=1e-6)
    assert _grad(out, lp) == pytest.approx([-1.25 / 4, 0.0, -0.7 / 4, 1.0 / 4], abs=1e-6)
    assert out.metrics["clip_fraction"].item() == pytest.approx(0.25)
    batch, lp = _inputs(ratio, adv, sample_index=idx)
    assert _grad(LOSSES.get("ppo")(batch, LossConfig(name="ppo")), lp)[0] == 0.0  # PPO clips 1.25


def test_gspo_sequence_ratio_by_hand():
    # sample 0: log-ratios (2e-4, 0) -> s = exp(1e-4) inside [1-3e-4, 1+4e-4]; A = -1
    # sample 1: log-ratios (2e-3, 4e-3, 0) -> s = exp(2e-3) > 1+4e-4; A = +1 -> clipped, no gradient
    lr = [2e-4, 0.0, 2e-3, 4e-3, 0.0]
    batch, lp = _inputs([math.exp(x) for x in lr], [-1.0, -1.0, 1.0, 1.0, 1.0], sample_index=[0, 0, 1, 1, 1])
    out = LOSSES.get("gspo")(batch, LossConfig(name="gspo"))
    s0 = math.exp(1e-4)
    assert out.loss.item() == pytest.approx((s0 - (1 + 4e-4)) / 2, abs=1e-7)
    # d/d log pi_t of  1/2 * (-A s0),  s0 = exp(mean of 2 log-ratios): s0 / 4 for each token of sample 0
    assert _grad(out, lp) == pytest.approx([s0 / 4, s0 / 4, 0.0, 0.0, 0.0], abs=1e-7)
    assert out.metrics["clip_fraction"].item() == pytest.approx(3 / 5)


def test_cispo_clipped_tokens_keep_their_gradient():
    # r = 3 (weight capped at 2), 0.5 (no lower bound), 1.5; old log-probs chosen so log pi is known.
    old = [-2.0, -1.0, -0.5]
    batch, lp = _inputs([3.0, 0.5, 1.5], [1.0, 1.0, -1.0], old=old)
    logp = [o + math.log(r) for o, r in zip(old, [3.0, 0.5, 1.5])]
    w, a = [2.0, 0.5, 1.5], [1.0, 1.0, -1.0]
    out = LOSSES.get("cispo")(batch, LossConfig(name="cispo"))
    assert out.loss.item() == pytest.approx(sum(-wi * ai * li for wi, ai, li in zip(w, a, logp)) / 3, rel=1e-6)
    assert _grad(out, lp) == pytest.approx([-2.0 / 3, -0.5 / 3, 1.5 / 3], rel=1e-6)  # -sg(w) A, clipped too
    assert out.metrics["clip_fraction"].item() == pytest.approx(1 / 3)


def test_reinforce_vanilla_policy_gradient():
    old = [-1.0, -0.25]
    batch, lp = _inputs([1.0, 1.0], [2.0, -1.0], old=old)
    out = LOSSES.get("reinforce")(batch, LossConfig(name="reinforce"))
    assert out.loss.item() == pytest.approx((-2.0 * -1.0 + 1.0 * -0.25) / 2)
    assert _grad(out, lp) == pytest.approx([-1.0, 0.5])


def test_kl_estimators_by_hand():
    x = torch.tensor([LN2, -LN2, 0.0])
    assert kl_estimate(x, "k1").tolist() == pytest.approx([LN2, -LN2, 0.0])
    assert kl_estimate(x, "k2").tolist() == pytest.approx([LN2 ** 2 / 2, LN2 ** 2 / 2, 0.0])
    assert kl_estimate(x, "k3").tolist() == pytest.approx([0.5 - 1 + LN2, 2 - 1 - LN2, 0.0])
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(x, "k4")


def test_kl_penalty_for_rewards_is_masked_and_gradient_free():
    logprobs = torch.tensor([0.0, -1.0, float("nan")], requires_grad=True)
    pen = kl_penalty(logprobs, torch.tensor([-LN2, -1.0, 0.0]), torch.tensor([1, 1, 0]), "k3")
    assert pen.tolist() == pytest.approx([0.5 - 1 + LN2, 0.0, 0.0])
    assert not pen.requires_grad


def test_entropy_bonus():
    entropy = torch.tensor([2.0, 1.0, 7.0], requires_grad=True)
    batch, _ = _inputs([1.0] * 3, [1.0, 1.0, 1.0], mask=[1, 1, 0], entropy=entropy)
    out = LOSSES.get("ppo")(batch, LossConfig(name="ppo", entropy_coef=0.1))
    assert out.loss.item() == pytest.approx((-1 - 1) / 2 - 0.1 * (2 + 1) / 2)
    assert _grad(out, entropy) == pytest.approx([-0.05, -0.05, 0.0])
    assert out.metrics["entropy_mean"].item() == pytest.approx(1.5)


def test_truncated_importance_sampling_token_level():
    # rho = pi_old / pi_behaviour = 3, 1, 0.5 -> TIS weights min(rho, 2) = 2, 1, 0.5; REINFORCE: -w A log pi
    old = [-1.0, -1.0, -1.0]
    behaviour = torch.tensor([-1.0 - math.log(3), -1.0, -1.0 + LN2])
    batch, lp = _inputs([1.0] * 3, [1.0, 1.0, 1.0], old=old, behaviour_logprobs=behaviour)
    out = LOSSES.get("reinforce")(batch, LossConfig(name="reinforce", is_correction="tis", is_cap=2.0))
    assert out.loss.item() == pytest.approx((2 + 1 + 0.5) * 1.0 / 3, rel=1e-6)
    assert _grad(out, lp) == pytest.approx([-2 / 3, -1 / 3, -0.5 / 3], rel=1e-6)
    assert out.metrics["is_weight_max"].item() == pytest.approx(2.0)
    assert out.metrics["is_truncated_fraction"].item() == pytest.approx(1 / 3)


def test_masked_importance_sampling_token_and_sequence_level():
    old = [-1.0] * 3
    # token level: rho = 3 (above 2: dropped), 1 (kept), 0.4 (below 0.5: dropped)
    behaviour = torch.tensor([-1.0 - math.log(3), -1.0, -1.0 - math.log(0.4)])
    cfg = LossConfig(name="reinforce", is_correction="mis", is_low=0.5, is_high=2.0)
    batch, lp = _inputs([1.0] * 3, [1.0] * 3, old=old, behaviour_logprobs=behaviour)
    out = LOSSES.get("reinforce")(batch, cfg)
    assert _grad(out, lp) == pytest.approx([0.0, -1 / 3, 0.0])
    assert out.metrics["is_masked_fraction"].item() == pytest.approx(2 / 3)
    # sequence level: sample 0 = tokens (rho 2, 0.75) -> 1.5 kept; sample 1 = (rho 3) -> dropped
    behaviour = torch.tensor([-1.0 - LN2, -1.0 - math.log(0.75), -1.0 - math.log(3)])
    cfg.is_level = "sequence"
    batch, lp = _inputs([1.0] * 3, [1.0] * 3, old=old, sample_index=[0, 0, 1], behaviour_logprobs=behaviour)
    assert _grad(LOSSES.get("reinforce")(batch, cfg), lp) == pytest.approx([-1.5 / 3, -1.5 / 3, 0.0], rel=1e-6)


def test_missing_optional_inputs_give_clear_errors():
    batch, _ = _inputs([1.0], [1.0])
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        LOSSES.get("ppo")(batch, LossConfig(is_correction="tis"))
    with pytest.raises(ValueError, match="ref_logprobs"):
        LOSSES.get("grpo")(batch, LossConfig(name="grpo", kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        LOSSES.get("ppo")(batch, LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="advantages has shape"):
        LossInputs(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.ones(3), torch.zeros(3))


# ------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("name", ["ppo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce"])
def test_masked_tokens_get_exactly_zero_gradient(name):
    nan, inf = float("nan"), float("inf")
    logprobs = torch.tensor([-0.5, -inf, -1.0, nan, -0.2], requires_grad=True)
    entropy = torch.tensor([1.0, nan, 0.5, inf, 0.3], requires_grad=True)
    batch = LossInputs(
        logprobs=logprobs, old_logprobs=torch.tensor([-0.6, -inf, -0.9, 0.0, -0.25]),
        advantages=torch.tensor([1.0, nan, -0.5, inf, 2.0]), loss_mask=torch.tensor([1, 0, 1, 0, 1]),
        sample_index=torch.tensor([0, 0, 0, 1, 1]), ref_logprobs=torch.tensor([-0.4, nan, -1.1, -inf, -0.3]),
        behaviour_logprobs=torch.tensor([-0.7, nan, -0.8, nan, -0.2]), entropy=entropy)
    cfg = LossConfig(name=name, kl_coef=0.1, entropy_coef=0.01, is_correction="tis", loss_constant=8.0)
    out = LOSSES.get(name)(batch, cfg)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert logprobs.grad[1].item() == 0.0 and logprobs.grad[3].item() == 0.0
    assert entropy.grad[1].item() == 0.0 and entropy.grad[3].item() == 0.0
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[[0, 2, 4]].abs().sum() > 0


# ------------------------------------------------------------------------- packing and DP invariance
def _random_batch(seed: int, n_samples: int = 6) -> dict[str, torch.Tensor]:
    """Samples of random length with a masked prompt, laid end to end; full-batch tensors."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n_samples,), generator=g)
    sample_index = torch.repeat_interleave(torch.arange(n_samples) * 7 + 3, lengths)  # arbitrary ids
    t = int(lengths.sum())
    mask = torch.ones(t, dtype=torch.bool)
    starts = torch.cumsum(lengths, 0) - lengths
    for s, n in zip(starts.tolist(), torch.randint(1, 3, (n_samples,), generator=g).tolist()):
        mask[s:s + n] = False  # prompt tokens
    old = -torch.rand(t, generator=g) * 2
    adv = torch.repeat_interleave(torch.randn(n_samples, generator=g), lengths)
    return dict(logprobs=(old + 0.3 * torch.randn(t, generator=g)).requires_grad_(True), old_logprobs=old,
                advantages=adv, loss_mask=mask, sample_index=sample_index,
                behaviour_logprobs=old + 0.2 * torch.randn(t, generator=g),
                ref_logprobs=old + 0.2 * torch.randn(t, generator=g),
                entropy=torch.rand(t, generator=g).requires_grad_(True))


def _piece(full: dict, idx: torch.Tensor, **extra) -> LossInputs:
    return LossInputs(**{k: v[idx] for k, v in full.items()}, **extra)


def _sample_aligned_pieces(full: dict, order: list[int], cuts: list[int]) -> list[torch.Tensor]:
    """Token indices of micro-batches holding whole samples: samples in `order`, split after positions `cuts`."""
    ids = full["sample_index"].unique().tolist()
    token_lists = [torch.nonzero(full["sample_index"] == ids[i]).flatten() for i in order]
    bounds = [0, *cuts, len(order)]
    return [torch.cat(token_lists[a:b]) for a, b in zip(bounds, bounds[1:])]


def _split_loss(full: dict, pieces: list[torch.Tensor], cfg: LossConfig):
    """Sum of micro-batch losses with the externally summed normaliser; grads accumulate into the leaves."""
    counts = sample_token_counts(full["loss_mask"], full["sample_index"])  # [T] over whole samples
    z = sum(normaliser(cfg, full["loss_mask"][i], full["sample_index"][i], counts[i]) for i in pieces)
    total = 0.0
    for idx in pieces:
        out = LOSSES.get(cfg.name)(_piece(full, idx, sample_num_tokens=counts[idx], normaliser=z), cfg)
        out.loss.backward()
        total += out.loss.item()
    return (total, *_grads(full))


def _full_loss(full: dict, cfg: LossConfig):
    out = LOSSES.get(cfg.name)(LossInputs(**full), cfg)
    out.loss.backward()
    return (out.loss.item(), *_grads(full))


def _grads(full: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the logprobs and entropy leaves (zeros where a leaf was not used)."""
    return tuple(torch.zeros_like(full[k]) if full[k].grad is None else full[k].grad.clone()
                 for k in ("logprobs", "entropy"))


def _zero_grads(full: dict) -> None:
    full["logprobs"].grad = None
    full["entropy"].grad = None


def _configs():
    for name in LOSSES.names():
        for agg in loss_defaults(name).aggregations:
            yield LossConfig(name=name, aggregation=agg, loss_constant=6.0, kl_coef=0.05, entropy_coef=0.01,
                             is_correction="tis", dual_clip=3.0)
        yield LossConfig(name=name, loss_constant=6.0, kl_coef=0.05, kl_estimator="k1", is_correction="mis",
                         is_level="sequence", is_low=0.8, is_high=1.25)


@pytest.mark.parametrize("cfg", list(_configs()), ids=lambda c: f"{c.name}-{c.aggregation}-{c.is_correction}")
def test_packing_invariance_every_loss_and_aggregation(cfg):
    full = _random_batch(seed=1)
    expected = _full_loss(full, cfg)
    packings = [([0, 1, 2, 3, 4, 5], [1, 3]), ([5, 2, 0, 4, 1, 3], [2]), ([3, 1, 5, 0, 2, 4], [1, 2, 3, 4, 5])]
    for order, cuts in packings:
        _zero_grads(full)
        got = _split_loss(full, _sample_aligned_pieces(full, order, cuts), cfg)
        assert got[0] == pytest.approx(expected[0], rel=1e-5, abs=1e-7)
        torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[2], expected[2], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_samples_split_across_micro_batches_with_sample_num_tokens(agg):
    """Token-level losses stay exact when a sample is cut in the middle (as context parallelism does)."""
    full = _random_batch(seed=2)
    cfg = LossConfig(name="ppo", aggregation=agg, loss_constant=6.0, kl_coef=0.05, entropy_coef=0.01)
    expected = _full_loss(full, cfg)
    _zero_grads(full)
    t = full["logprobs"].numel()
    pieces = [torch.arange(0, 5), torch.arange(5, 11), torch.arange(11, t)]  # cuts inside samples
    got = _split_loss(full, pieces, cfg)
    assert got[0] == pytest.approx(expected[0], rel=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_dp_invariance_two_ranks(agg):
    """2 simulated DP ranks with unequal shares: all-reduced normaliser, summed losses and gradients."""
    full = _random_batch(seed=3, n_samples=7)
    cfg = LossConfig(name="grpo", aggregation=agg, loss_constant=6.0, kl_coef=0.05, is_correction="tis")
    expected = _full_loss(full, cfg)
    _zero_grads(full)
    ranks = [_sample_aligned_pieces(full, [0, 1], [1]), _sample_aligned_pieces(full, [2, 3, 4, 5, 6], [3])]
    counts = sample_token_counts(full["loss_mask"], full["sample_index"])
    local_z = [sum(normaliser(cfg, full["loss_mask"][i], full["sample_index"][i]) for i in r) for r in ranks]
    z = sum(local_z)  # the all-reduce (SUM) over the DP group
    grads, total = [], 0.0
    for rank in ranks:
        for idx in rank:
            out = LOSSES.get(cfg.name)(_piece(full, idx, sample_num_tokens=counts[idx], normaliser=z), cfg)
            out.loss.backward()
            total += out.loss.item()
        grads.append(full["logprobs"].grad.clone())  # per-rank gradient (disjoint tokens) ...
        full["logprobs"].grad = None
    assert total == pytest.approx(expected[0], rel=1e-5)
    torch.testing.assert_close(grads[0] + grads[1], expected[1], rtol=1e-5, atol=1e-7)  # ... SUM-reduced
    # negative control: normalising each rank by its own Z and averaging does not give the full-batch loss
    naive = 0.0
    for rank, zr in zip(ranks, local_z):
        naive += sum(LOSSES.get(cfg.name)(_piece(full, i, normaliser=zr), cfg).loss.item() for i in rank) / 2
    assert naive != pytest.approx(expected[0], rel=1e-3)


def test_normaliser_values():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0])
    idx = torch.tensor([4, 4, 4, 4, 9, 9, 2])  # sample 2 has no loss token
    assert normaliser(LossConfig(aggregation="token-mean"), mask, idx).item() == 4
    assert normaliser(LossConfig(aggregation="seq-mean-token-mean"), mask, idx).item() == pytest.approx(2)
    assert normaliser(LossConfig(aggregation="seq-mean-token-sum"), mask, idx).item() == pytest.approx(2)
    assert normaliser(LossConfig(name="dr_grpo", loss_constant=100.0), mask, idx).item() == pytest.approx(200)
    # a sample split over two pieces contributes 1 in total (3 loss tokens: 1/3 + 2/3)
    counts = sample_token_counts(mask, idx)
    cfg = LossConfig(aggregation="seq-mean-token-mean")
    parts = [normaliser(cfg, mask[a:b], idx[a:b], counts[a:b]).item() for a, b in [(0, 2), (2, 7)]]
    assert sum(parts) == pytest.approx(2) and parts[0] == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match="loss_constant"):
        normaliser(LossConfig(aggregation="constant"), mask, idx)


# ------------------------------------------------------------------------------ registry contract
@pytest.mark.parametrize("name", LOSSES.names())
def test_registry_contract(name):
    assert {"ppo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce"} <= set(LOSSES.names())
    full = _random_batch(seed=4)
    for cfg in (LossConfig(name=name, loss_constant=5.0),
                LossConfig(name=name, loss_constant=5.0, kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01,
                           is_correction="mis", is_level="sequence", dual_clip=2.0)):
        cfg.validate()
        out = cfg.build()(LossInputs(**full))
        assert isinstance(out, LossOutput)
        assert out.loss.dim() == 0 and torch.isfinite(out.loss)
        assert {"clip_fraction", "approx_kl", "ratio_mean", "num_tokens"} <= set(out.metrics)
        assert all(v.dim() == 0 and torch.isfinite(v) and not v.requires_grad for v in out.metrics.values())
        out.loss.backward()
        assert torch.isfinite(full["logprobs"].grad).all()


# ----------------------------------------------------------------------------------------- config
def test_loss_config_fields_documented_and_loadable():
    assert undocumented_fields(LossConfig) == []
    cfg = from_dict(LossConfig, {"name": "dapo", "eps_low": 0.2})
    assert cfg.resolved().eps_high == 0.28 and cfg.resolved().aggregation == "token-mean"
    assert LossConfig(name="gspo").resolved().eps_low == 3e-4
    with pytest.raises(ConfigError, match="aggregation"):
        from_dict(LossConfig, {"aggregation": "mean"})


@pytest.mark.parametrize("kwargs, match", [
    ({"name": "ppo2"}, "unknown loss 'ppo2'; known: cispo, dapo, dr_grpo, grpo, gspo, ppo, reinforce"),
    ({"eps_high": -0.1}, "eps_high"),
    ({"eps_low": 1.5}, "eps_low"),
    ({"name": "dapo", "aggregation": "seq-mean-token-mean"}, "contradicts loss 'dapo'"),
    ({"name": "dr_grpo"}, "loss_constant"),
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"is_low": 2.0, "is_high": 1.0}, "is_low"),
    ({"kl_estimator": "k5"}, "kl_estimator"),
    ({"kl_coef": -1.0}, "kl_coef"),
])
def test_loss_config_validate_rejects_impossible_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LossConfig(**kwargs).validate()
