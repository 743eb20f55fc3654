"""PPO's critic: the clipped value loss by hand, explained variance, config validation (gae builds a critic by
default, refuses to run without one), and the Megatron-Core value model inside the RL trainer (one process):
its values sit at the right tokens, GAE's advantages and returns come from them, and its value loss falls."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.rl.value import explained_variance, value_loss


def test_value_loss_clipped_by_hand():
    v = torch.tensor([1.0, 0.0, 2.0, 5.0], requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    ret = torch.tensor([1.0, 1.0, 0.0, 9.0])
    mask = torch.tensor([1, 1, 1, 0])
    out = value_loss(v, old, ret, mask, clip=0.5, normaliser=6.0)
    # token 0: plain 0, clipped (0.5 - 1)^2 = 0.25 -> 0.125; token 1: plain 1, clipped 0.25 -> 0.5;
    # token 2: plain 4, clipped 0.25 -> 2.0; token 3 off the mask
    assert float(out.loss.detach()) == pytest.approx((0.125 + 0.5 + 2.0) / 6.0)
    assert float(out.metrics["value_clip_sum"]) == 1.0 and float(out.metrics["tokens"]) == 3.0
    out.loss.backward()
    # the clipped branch (token 0) has zero gradient; tokens 1, 2: (v - R) / Z
    torch.testing.assert_close(v.grad, torch.tensor([0.0, -1.0 / 6.0, 2.0 / 6.0, 0.0]))
    plain = value_loss(v, old, ret, mask, clip=None, normaliser=3.0)
    assert float(plain.loss.detach()) == pytest.approx((0.0 + 0.5 + 2.0) / 3.0)
    assert float(plain.metrics["value_clip_sum"]) == 0


def test_explained_variance():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    assert explained_variance(r, r, mask) == 1.0
    assert explained_variance(torch.full((5,), 2.5), r, mask) == pytest.approx(0.0)
    assert explained_variance(torch.zeros(5), r, mask) == pytest.approx(0.0)  # a constant explains nothing
    # V reversed: R - V = [-3, -1, 1, 3], variance 5 against Var(R) = 1.25
    assert explained_variance(torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0]), r, mask) == pytest.approx(1.0 - 5.0 / 1.25)
    assert explained_variance(torch.zeros(5), torch.ones(5), mask) == 0.0  # nothing to explain


def test_gae_builds_a_critic_by_default_and_refuses_to_run_without_one():
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    cfg = C.load(RunConfig, None, ["rl.trainer.advantage.name=gae", "rl.trainer.loss.name=ppo"])
    assert cfg.rl.trainer.critic.active("gae") and not cfg.rl.trainer.critic.active("grpo")
    with pytest.raises(ConfigError, match="advantage.name='gae' needs a critic .* critic.enabled=false"):
        C.load(RunConfig, None, ["rl.trainer.advantage.name=gae", "rl.trainer.critic.enabled=false"])
    with pytest.raises(ConfigError, match="critic.enabled=true, but advantage.name='grpo' does not use values"):
        C.load(RunConfig, None, ["rl.trainer.critic.enabled=true"])
    with pytest.raises(ConfigError, match="critic.value_clip must be >= 0"):
        C.load(RunConfig, None, ["rl.trainer.advantage.name=gae", "rl.trainer.critic.value_clip=-1"])
    with pytest.raises(ConfigError, match="unknown config key 'rl.trainer.critic.lr'"):
        C.load(RunConfig, None, ["rl.trainer.critic.lr=1e-3"])


# ------------------------------------------------------------------------------------------ the value model
def _trainer(lr: float = 3e-3):
    from kernels.logprob import LogprobKernelConfig
    from megatron_rl.rl.config import AdvantageConfig, LossConfig
    from megatron_rl.trainer.critic import CriticConfig
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.policy import OptimConfig
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer
    from tests.trainer.test_rl_exact_state import _policy

    cfg = RLConfig(loss=LossConfig(name="ppo"), advantage=AdvantageConfig(name="gae", gamma=1.0, lam=0.95),
                   packing=PackingConfig(max_tokens=40), logprob_kernel=LogprobKernelConfig(impl="torch"),
                   critic=CriticConfig(optim=OptimConfig(lr=lr, distributed_optimizer=False), value_clip=0.2))
    return RLTrainer(_policy(warmup_steps=0, layers=1), cfg)


def _critic_values(critic, cols) -> np.ndarray:
    """float64 [T] V(s_t) by an unpacked forward of the critic per sample, label side (token t's value is the
    head on the hidden state at t - 1; 0 at each sample's first token)."""
    from megatron_rl.models.output_head import emit_hidden

    model = critic.model.chunks[0].module
    out = np.zeros(len(cols.tokens))
    model.eval()
    for i in range(len(cols)):
        s, e = int(cols.offsets[i]), int(cols.offsets[i + 1])
        toks = torch.as_tensor(cols.tokens[s:e - 1], dtype=torch.long)[None]  # [1, L-1]
        with torch.no_grad(), emit_hidden(model):
            hidden = model(toks, torch.arange(toks.shape[1])[None], None)  # [1, L-1, h]
            out[s + 1:e] = model.value_head(hidden)[0, :, 0].double().numpy()
    model.train()
    return out


def _gathered(cols, mbs, key: str) -> np.ndarray:
    offsets, got = np.asarray(cols.offsets), np.zeros(len(cols.tokens))
    for mb in mbs:
        si, pos = mb["sample_index"].reshape(-1).numpy(), mb["position_ids"].reshape(-1).numpy()
        real = si >= 0
        got[offsets[si[real]] + 1 + pos[real]] = mb[key].reshape(-1).numpy()[real]
    return got


@pytest.mark.slow
def test_critic_values_align_with_tokens_and_feed_gae():
    """The packed critic's values equal unpacked forwards at the label positions; the micro-batches' advantages
    and returns equal GAE's on those values (the estimator used to fail: no values reached it), with
    multi-turn masks: observation tokens inside a response carry no return."""
    from megatron_rl.rl.config import AdvantageConfig
    from megatron_rl.trainer.rl_step import advantage_output
    from tests.mp.trainer_parity import batch

    trainer = _trainer()
    cols = batch(0)
    for i in range(len(cols)):  # multi-turn: an environment observation (loss_mask 0) inside each response
        s, e = int(cols.offsets[i]) + int(cols.prompt_len[i]), int(cols.offsets[i + 1])
        if e - s >= 6:
            cols.loss_mask[s + 2:s + 4] = 0
    mbs, _ = trainer.prepare(cols)
    trainer._set_old_and_ref(mbs)
    late = trainer._late_advantages(cols, mbs)
    mask = cols.loss_mask.astype(bool)
    want_v = _critic_values(trainer.critic, cols)
    np.testing.assert_allclose(_gathered(cols, mbs, "old_values")[mask], want_v[mask], atol=1e-5)
    assert np.abs(want_v[mask]).max() > 1e-3  # the head is not zero: a misalignment would show
    out = advantage_output(cols, AdvantageConfig(name="gae", gamma=1.0, lam=0.95), values=torch.from_numpy(want_v))
    np.testing.assert_allclose(_gathered(cols, mbs, "advantages")[mask], out.advantages.numpy()[mask], atol=1e-4)
    np.testing.assert_allclose(_gathered(cols, mbs, "returns")[mask], out.returns.numpy()[mask], atol=1e-4)
    assert not _gathered(cols, mbs, "returns")[~mask].any()  # observation and prompt tokens are no MDP steps
    assert math.isfinite(late["explained_variance"]) and "value_mean" in late


@pytest.mark.slow
def test_ppo_gae_value_loss_falls_and_the_policy_trains():
    """Six PPO+GAE steps on fresh batches (rewards 0/1): the critic learns the return level, so its value loss
    (measured before each update) falls well below the first step's; the policy is updated every step."""
    from tests.mp.trainer_parity import batch

    trainer = _trainer()
    rows = [trainer.step(batch(s)) for s in range(6)]
    assert all(not r["update_skipped"] and r["update_ok"] for r in rows), rows
    losses = [r["value_loss"] for r in rows]
    assert losses[0] > 0.1 and min(losses[-2:]) < 0.6 * losses[0], losses
    assert rows[-1]["explained_variance"] > rows[0]["explained_variance"], [r["explained_variance"] for r in rows]
    assert all(math.isfinite(r["loss"]) and r["value_grad_norm"] > 0 for r in rows)
    assert trainer.critic.model.step_count == 6 and trainer.policy.step_count == 6
