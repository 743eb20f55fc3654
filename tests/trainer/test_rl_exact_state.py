"""One-process RL steps of the Megatron-Core trainer (a gloo world of one, shared with other tests): the LR
schedule counts RL steps, not PPO epochs; the mismatch metric compares the rollout engine's behaviour log-probs
with the trainer's, whatever the old-log-prob and IS settings, and its alert (rl.mismatch_alert_kl) fires."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError

SEED, VOCAB = 1234, 64


def _policy(total_steps: int = 6, layers: int = 1, warmup_steps: int = 2):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.convert.runtime import start
    from megatron_rl.trainer.policy import OptimConfig, Policy
    from tests.mp.trainer_parity import model_config

    ctx = start()  # one process (reused when another test started it)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=warmup_steps, decay_style="cosine",
                         distributed_optimizer=False)
    return Policy(model_config(layers, False), optim, ctx, total_steps=total_steps,
                  init=lambda m: init_weights_by_name(m, SEED))


def _trainer(policy, epochs: int = 1, old: str = "behaviour", is_correction: str = "none"):
    from megatron_rl.kernels.logprob import LogprobKernelConfig
    from megatron_rl.rl.config import LossConfig
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer

    cfg = RLConfig(loss=LossConfig(name="grpo", is_correction=is_correction), packing=PackingConfig(max_tokens=64),
                   epochs=epochs, old_logprobs=old, logprob_kernel=LogprobKernelConfig(impl="torch"))
    return RLTrainer(policy, cfg)


# ------------------------------------------------------------------------------------------ LR schedule
def test_lr_schedule_advances_once_per_rl_step_with_two_epochs():
    """With epochs=2, after N RL steps the LR is the schedule's value at N (it used to be at 2N)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from tests.mp.trainer_parity import batch

    trainer = _trainer(_policy(total_steps=6), epochs=2, old="recompute")
    o = trainer.policy.optim_cfg
    used = []
    for s in range(4):
        m = trainer.step(batch(s))
        assert not m["update_skipped"] and len(m["epoch_losses"]) == 2
        used.append(m["lr"])
    # the schedule's own values at steps 0..4 (warm-up 2, cosine to step 6), from a scheduler of the same config
    ref = OptimizerParamScheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=o.lr), init_lr=0.0,
                                  max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=2, lr_decay_steps=6,
                                  lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=6,
                                  wd_incr_style="constant")
    want = [ref.get_lr(ref.optimizer.param_groups[0]) for _ in range(1)]
    for _ in range(4):
        ref.step(increment=1)
        want.append(ref.get_lr(ref.optimizer.param_groups[0]))
    assert trainer.policy.scheduler.num_steps == 4
    assert used == pytest.approx(want[:4], rel=1e-12)  # every epoch of RL step n ran at the value at n
    assert trainer.policy.optimizer.param_groups[0]["lr"] == pytest.approx(want[4], rel=1e-12)
    assert len(set(want[:5])) == 5  # warm-up then decay: every step's value differs, so 2N would be caught


# ------------------------------------------------------------------------------------------ mismatch
def _engine_rollouts(policy, prompts: int = 4, n: int = 4, max_new: int = 10):
    """Samples of the rollout engine holding the policy's weights, as trajectory columns (behaviour log-probs
    from the engine, rewards with variance inside every group)."""
    from megatron_rl.data.shards import Trajectory, TrajectoryColumns
    from megatron_rl.rollout import RolloutEngine, SamplingParams
    from megatron_rl.rollout.engine import EngineConfig

    ctx = policy.ctx
    engine = RolloutEngine.build(policy.cfg, EngineConfig(num_blocks=64, block_size=4), ctx.parallel, ctx.pgs)
    engine.update_weights(0, policy.named_parameters())
    gen = np.random.default_rng(SEED)
    ps = [gen.integers(1, VOCAB, int(gen.integers(3, 7))).tolist() for _ in range(prompts)]
    outs = engine.generate(ps, [SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=100 * i, n=n)
                                for i in range(prompts)])
    trajs = []
    for g, (p, out) in enumerate(zip(ps, outs)):
        for s in out.samples:
            toks = np.asarray(p + s.token_ids, dtype=np.int32)
            mask = (np.arange(len(toks)) >= len(p)).astype(np.uint8)
            lps = np.concatenate([np.zeros(len(p)), s.logprobs]).astype(np.float32)
            trajs.append(Trajectory(tokens=toks, logprobs=lps, loss_mask=mask, prompt_len=len(p),
                                    reward=float(s.index % 2), group_id=g, policy_version_first=0,
                                    policy_version_last=0, env="synthetic", task_id=str(g),
                                    episode_id=f"e{g}-{s.index}"))
    return TrajectoryColumns.from_trajectories(trajs)


@pytest.mark.parametrize("old,is_correction", [("behaviour", "none"), ("recompute", "none"), ("recompute", "tis")])
def test_mismatch_is_engine_vs_trainer_and_sees_perturbed_logprobs(old, is_correction):
    """Unperturbed engine log-probs: mismatch ~0. Noise on the shard's log-probs: the mismatch is the KL that
    noise implies, whatever old_logprobs / IS (with recompute and no IS it used to be 0 by construction)."""
    cols = _engine_rollouts(_policy())
    clean = _trainer(_policy(), old=old, is_correction=is_correction).step(cols)
    assert not clean["update_skipped"] and 0.0 <= clean["mismatch_kl"] < 1e-6, clean
    mask = cols.loss_mask.astype(bool)
    noise = np.where(mask, np.random.default_rng(7).normal(0.0, 0.3, len(cols.tokens)), 0.0)
    cols.logprobs = (cols.logprobs + noise).astype(np.float32)
    noisy = _trainer(_policy(), old=old, is_correction=is_correction).step(cols)
    # the trainer's log-probs equal the engine's (to ~1e-6): KL(behaviour || trainer) per token is k3(noise)
    want = float(np.mean([math.exp(-x) - 1 + x for x in noise[mask]]))
    assert noisy["mismatch_kl"] == pytest.approx(want, rel=1e-3) and want > 0.03


def test_mismatch_alert_fires_above_rl_mismatch_alert_kl(tmp_path):
    """rl.mismatch_alert_kl reaches the monitor's mismatch rule (the run config no longer has two knobs)."""
    from megatron_rl import config as C
    from megatron_rl.loop.job import monitor_config
    from megatron_rl.monitoring import Monitor
    from megatron_rl.run_config import RunConfig

    cfg = C.load(RunConfig, None, ["rl.mismatch_alert_kl=0.02", "monitor.tensorboard=false"])
    monitor = Monitor(monitor_config(cfg), tmp_path)
    assert monitor.check(0, {"mismatch_kl": 0.019}) == []
    fired = monitor.check(1, {"mismatch_kl": 0.021})
    assert len(fired) == 1 and "mismatch KL 0.0210 > 0.02" in fired[0] and monitor.should_stop is None
    assert '"rule": "mismatch"' in (tmp_path / "alerts.jsonl").read_text()
    with pytest.raises(ConfigError, match="set rl.mismatch_alert_kl instead"):
        C.load(RunConfig, None, ["monitor.alerts.mismatch_kl=0.1"])
    with pytest.raises(ConfigError, match="rl.mismatch_alert_kl must be >= 0"):
        C.load(RunConfig, None, ["rl.mismatch_alert_kl=-1"])


# ------------------------------------------------------------------------------------------ REINFORCE++ with KL
def _sample_logprobs(model, cols, ctx) -> np.ndarray:
    """float64 [T] log-probs of every token given its prefix under `model`, by an unpacked forward per sample
    (label side: token t's at t, 0 at each sample's first token); independent of the trainer's packing."""
    from megatron_rl.convert.runtime import megatron_logits

    out = np.zeros(len(cols.tokens))
    for i in range(len(cols)):
        s, e = int(cols.offsets[i]), int(cols.offsets[i + 1])
        toks = torch.as_tensor(cols.tokens[s:e], dtype=torch.long)[None]  # [1, L]
        with torch.no_grad():
            logits = megatron_logits(model, toks[:, :-1], ctx)  # [1, L-1, V]
        lp = torch.log_softmax(logits.double(), -1).gather(-1, toks[:, 1:, None])[0, :, 0]  # [L-1]
        out[s + 1:e] = lp.numpy()
    model.train()
    return out


def test_reinforce_pp_with_kl_in_reward_trains_and_uses_the_reference_kl():
    """REINFORCE++ with advantage.kl_coef > 0 (it failed at the first step: no per-token KL reached the
    estimator). After one update the policy differs from the reference; the advantages of the next step equal
    the estimator's on the KL log pi_old - log pi_ref computed here by unpacked forwards of both models."""
    from megatron_rl.kernels.logprob import LogprobKernelConfig
    from megatron_rl.rl.config import AdvantageConfig, LossConfig
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer, token_advantages
    from tests.mp.trainer_parity import batch

    adv_cfg = AdvantageConfig(name="reinforce++", kl_coef=0.5)
    cfg = RLConfig(loss=LossConfig(name="reinforce"), advantage=adv_cfg, packing=PackingConfig(max_tokens=40),
                   old_logprobs="recompute", reference=True, logprob_kernel=LogprobKernelConfig(impl="torch"))
    with pytest.raises(ConfigError, match="advantage.kl_coef > 0 .* needs rl.reference=true"):
        RLTrainer(_policy(), RLConfig(advantage=adv_cfg))
    trainer = RLTrainer(_policy(warmup_steps=0), cfg)
    first = trainer.step(batch(0))
    assert not first["update_skipped"] and math.isfinite(first["loss"]) and first["update_ok"]
    cols = batch(1)
    mbs, _ = trainer.prepare(cols)
    trainer._set_old_and_ref(mbs)
    trainer._late_advantages(cols, mbs)
    ctx, mask = trainer.policy.ctx, cols.loss_mask.astype(bool)
    kl = np.where(mask, _sample_logprobs(trainer.policy.chunks[0].module, cols, ctx)
                  - _sample_logprobs(trainer.reference.chunks[0], cols, ctx), 0.0)  # [T] k1
    assert np.abs(kl[mask]).mean() > 1e-3  # the update moved the policy away from the reference
    want = token_advantages(cols, adv_cfg, kl)
    without_kl = token_advantages(cols, AdvantageConfig(name="reinforce++"))
    offsets = np.asarray(cols.offsets)
    got = np.zeros(len(cols.tokens), dtype=np.float32)
    for mb in mbs:
        si, pos = mb["sample_index"].reshape(-1).numpy(), mb["position_ids"].reshape(-1).numpy()
        real = si >= 0
        got[offsets[si[real]] + 1 + pos[real]] = mb["advantages"].reshape(-1).numpy()[real]
    np.testing.assert_allclose(got[mask], want[mask], atol=1e-4)
    assert np.abs(want[mask] - without_kl[mask]).max() > 1e-2  # the KL term changes the advantages
    second = trainer.step(cols)
    assert not second["update_skipped"] and math.isfinite(second["loss"]) and second["ref_kl"] > 0
