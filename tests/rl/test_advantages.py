"""Advantage estimators: hand-computed values, degenerate groups, bad input, registry contract, config."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.config import ConfigError, from_dict, undocumented_fields
from megatron_rl.rl import ADVANTAGES, AdvantageConfig, AdvantageInputs, AdvantageOutput


def _run(name: str, rewards, group_ids, **kwargs) -> AdvantageOutput:
    cfg_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in AdvantageConfig.__dataclass_fields__}
    inputs = AdvantageInputs(torch.tensor(rewards, dtype=torch.float32), torch.tensor(group_ids), **kwargs)
    return ADVANTAGES.get(name)(inputs, AdvantageConfig(name=name, **cfg_kwargs))


# ----------------------------------------------------------------------------------- group estimators
def test_grpo_group_normalised_by_hand():
    # group 7: rewards 1, 0, 0, 1 (interleaved with others) -> mean 0.5, unbiased std sqrt(1/3)
    # group 3: all equal (2, 2) -> 0; group 5: a single sample -> 0
    rewards, groups = [1.0, 2.0, 0.0, 5.0, 0.0, 2.0, 1.0], [7, 3, 7, 5, 7, 3, 7]
    out = _run("grpo", rewards, groups, eps=1e-12)
    z = 0.5 / math.sqrt(1 / 3)
    assert out.advantages.tolist() == pytest.approx([z, 0.0, -z, 0.0, -z, 0.0, z], rel=1e-6)
    assert out.returns is None
    assert _run("grpo", rewards, groups, scale_by_std=False).advantages.tolist() == pytest.approx(
        [0.5, 0.0, -0.5, 0.0, -0.5, 0.0, 0.5])  # Dr.GRPO: mean-centred only
    assert _run("grpo", rewards, groups, unbiased_std=False, eps=1e-12).advantages.tolist() == pytest.approx(
        [1.0, 0.0, -1.0, 0.0, -1.0, 0.0, 1.0], rel=1e-6)  # population std 0.5


def test_rloo_leave_one_out_by_hand():
    # group 0: 1, 2, 6 -> r_i - mean of the others: 1 - 4, 2 - 3.5, 6 - 1.5; group 1 single -> 0
    out = _run("rloo", [1.0, 2.0, 9.0, 6.0], [0, 0, 1, 0])
    assert out.advantages.tolist() == pytest.approx([-3.0, -1.5, 0.0, 4.5])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce++"])
def test_degenerate_groups_give_exact_zero_without_nan(name):
    # float64 0.1 three times: the float mean differs from 0.1 by ~1e-17, the advantage must still be exactly 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 3.0], dtype=torch.float64)
    groups = torch.tensor([1, 1, 1, 2]) if name != "reinforce++" else torch.tensor([1, 2, 3, 4])
    n = 3 if name == "reinforce++" else 4  # reinforce++ normalises over the whole batch: all-equal batch
    out = ADVANTAGES.get(name)(AdvantageInputs(rewards[:n], groups[:n]), AdvantageConfig(name=name))
    assert out.advantages.tolist() == [0.0] * n
    assert _run(name, [4.0], [0]).advantages.tolist() == [0.0]  # a single sample


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce++", "gae"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_names_the_sample(name, bad):
    with pytest.raises(ValueError, match=r"sample 2 \(group 11\)"):
        _run(name, [1.0, 0.0, bad], [10, 10, 11])


def test_token_level_broadcast_to_loss_tokens():
    # sample 0 -> tokens 0-2 (token 0 is prompt), sample 1 -> tokens 3-4
    out = _run("grpo", [1.0, 0.0], [0, 0], sample_index=torch.tensor([0, 0, 0, 1, 1]),
               loss_mask=torch.tensor([0, 1, 1, 1, 1]), scale_by_std=False)
    assert out.advantages.tolist() == pytest.approx([0.0, 0.5, 0.5, -0.5, -0.5])


# ----------------------------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_sample_level_batch_normalised():
    out = _run("reinforce++", [1.0, 2.0, 3.0, 4.0], [0, 0, 1, 1], eps=1e-12)
    std = math.sqrt(1.25)  # population std of 1..4 around 2.5
    assert out.advantages.tolist() == pytest.approx([-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std], rel=1e-6)


def test_reinforce_pp_token_level_with_kl_in_reward_by_hand():
    # sample 0: loss tokens 0, 1 (kl 0.5, 1.0), reward 1; token 2 is an observation; sample 1: token 3 (kl 2), reward 0
    kwargs = dict(sample_index=torch.tensor([0, 0, 0, 1]), loss_mask=torch.tensor([1, 1, 0, 1]),
                  kl=torch.tensor([0.5, 1.0, 99.0, 2.0]), kl_coef=0.1, eps=1e-12)
    out = _run("reinforce++", [1.0, 0.0], [0, 1], **kwargs)
    # token rewards: -0.05, 1 - 0.1, -0.2  ->  returns (gamma = 1): 0.85, 0.9, -0.2
    assert out.returns.tolist() == pytest.approx([0.85, 0.9, 0.0, -0.2], rel=1e-6)
    mean = (0.85 + 0.9 - 0.2) / 3
    std = math.sqrt(((0.85 - mean) ** 2 + (0.9 - mean) ** 2 + (-0.2 - mean) ** 2) / 3)
    assert out.advantages.tolist() == pytest.approx(
        [(0.85 - mean) / std, (0.9 - mean) / std, 0.0, (-0.2 - mean) / std], rel=1e-5)
    out = _run("reinforce++", [1.0, 0.0], [0, 1], gamma=0.5, **kwargs)
    assert out.returns.tolist() == pytest.approx([-0.05 + 0.5 * 0.9, 0.9, 0.0, -0.2], rel=1e-6)


def test_kl_in_reward_needs_kl():
    with pytest.raises(ValueError, match="AdvantageInputs.kl"):
        _run("reinforce++", [1.0], [0], sample_index=torch.tensor([0]), loss_mask=torch.tensor([1]), kl_coef=0.1)


# ------------------------------------------------------------------------------------------------ GAE
def test_gae_by_hand_skips_observation_tokens():
    # one sample: loss tokens V = 0.5, 0.2, [observation token], 0.4; reward 1 at the last token
    # delta: 0 + 0.9*0.2 - 0.5 = -0.32 ; 0 + 0.9*0.4 - 0.2 = 0.16 ; 1 + 0 - 0.4 = 0.6
    # A (gamma*lam = 0.72): 0.6 ; 0.16 + 0.72*0.6 = 0.592 ; -0.32 + 0.72*0.592 = 0.10624
    out = _run("gae", [1.0], [0], sample_index=torch.tensor([0, 0, 0, 0, 0]),
               loss_mask=torch.tensor([0, 1, 1, 0, 1]), values=torch.tensor([7.0, 0.5, 0.2, 9.9, 0.4]),
               gamma=0.9, lam=0.8)
    assert out.advantages.tolist() == pytest.approx([0.0, 0.10624, 0.592, 0.0, 0.6], rel=1e-5)
    assert out.returns.tolist() == pytest.approx([0.0, 0.60624, 0.792, 0.0, 1.0], rel=1e-5)


def test_gae_lambda_one_gamma_one_returns_are_rewards_to_go():
    # two packed samples, a dense token reward of 0.25 on sample 1's first token
    values = torch.tensor([0.3, -0.2, 0.9, 0.1, 0.4])
    out = _run("gae", [2.0, -1.0], [0, 0], sample_index=torch.tensor([0, 0, 1, 1, 1]),
               loss_mask=torch.tensor([1, 1, 1, 1, 1]), values=values,
               token_rewards=torch.tensor([0.0, 0.0, 0.25, 0.0, 0.0]), gamma=1.0, lam=1.0)
    assert out.returns.tolist() == pytest.approx([2.0, 2.0, -0.75, -1.0, -1.0])
    torch.testing.assert_close(out.advantages, out.returns - values)


def test_gae_whiten():
    out = _run("gae", [1.0, 0.0], [0, 1], sample_index=torch.tensor([0, 0, 1]), loss_mask=torch.tensor([1, 1, 1]),
               values=torch.tensor([0.1, 0.2, 0.3]), whiten=True)
    assert out.advantages.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert out.advantages.std(correction=0).item() == pytest.approx(1.0, rel=1e-4)


def test_gae_needs_token_inputs():
    with pytest.raises(ValueError, match="gae.*sample_index"):
        _run("gae", [1.0], [0])
    with pytest.raises(ValueError, match="gae.*values"):
        _run("gae", [1.0], [0], sample_index=torch.tensor([0]), loss_mask=torch.tensor([1]))


# ------------------------------------------------------------------------------------ input checking
def test_bad_token_inputs_are_rejected():
    with pytest.raises(ValueError, match="sample_index must index the 2 samples"):
        _run("grpo", [1.0, 0.0], [0, 0], sample_index=torch.tensor([0, 2]), loss_mask=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="values has shape"):
        _run("gae", [1.0], [0], sample_index=torch.tensor([0, 0]), loss_mask=torch.tensor([1, 1]),
             values=torch.zeros(3))
    with pytest.raises(ValueError, match="values is not finite .* sample 1"):
        _run("gae", [1.0, 0.0], [0, 0], sample_index=torch.tensor([0, 1]), loss_mask=torch.tensor([1, 1]),
             values=torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="needs sample_index"):
        _run("grpo", [1.0], [0], values=torch.zeros(1))


# ----------------------------------------------------------------------------------- registry contract
@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_registry_contract(name):
    assert {"grpo", "rloo", "reinforce++", "gae"} <= set(ADVANTAGES.names())
    g = torch.Generator().manual_seed(0)
    n, t = 8, 40
    sample_index = torch.sort(torch.randint(0, n, (t,), generator=g)).values
    token = AdvantageInputs(torch.randn(n, generator=g), torch.arange(n) // 4, sample_index=sample_index,
                            loss_mask=torch.rand(t, generator=g) > 0.3, values=torch.randn(t, generator=g),
                            kl=torch.rand(t, generator=g), teacher_kl=torch.randn(t, generator=g))
    cfg = AdvantageConfig(name=name, kl_coef=0.05)
    cfg.validate()
    out = cfg.build()(token)
    assert isinstance(out, AdvantageOutput)
    assert out.advantages.shape == (t,) and torch.isfinite(out.advantages).all()
    assert out.advantages[~token.loss_mask].eq(0).all()
    assert out.returns is None or out.returns.shape == (t,)
    if name not in ("gae", "distill"):  # sample-level use: [N]
        out = AdvantageConfig(name=name).build()(AdvantageInputs(token.rewards, token.group_ids))
        assert out.advantages.shape == (n,) and torch.isfinite(out.advantages).all()


# ------------------------------------------------------------------------------------------------ config
def test_advantage_config_fields_documented_and_validated():
    assert undocumented_fields(AdvantageConfig) == []
    assert from_dict(AdvantageConfig, {"name": "gae", "lam": 0.9}).lam == 0.9
    with pytest.raises(ConfigError, match="unknown advantage estimator 'gpro'; known: distill, gae, grpo, reinforce"):
        AdvantageConfig(name="gpro").validate()
    with pytest.raises(ConfigError, match="gamma"):
        AdvantageConfig(gamma=1.5).validate()
    with pytest.raises(ConfigError, match="eps"):
        AdvantageConfig(eps=0.0).validate()
    with pytest.raises(ConfigError, match="kl_coef"):
        AdvantageConfig(kl_coef=-0.1).validate()
