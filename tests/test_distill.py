"""On-policy distillation: the reverse-KL advantage by hand (mask included), mixing with task rewards, the
teacher == student zero, the trainer's teacher pass and `teacher_kl` metric (one process), the config, and a
teacher of another tokenizer refused by name before any work."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError, from_dict, undocumented_fields
from megatron_rl.rl import ADVANTAGES, AdvantageConfig, AdvantageInputs
from megatron_rl.rl.advantages import reverse_kl
from megatron_rl.trainer.teacher import DistillConfig

# two samples: tokens 0-2 of sample 0 (token 0 is its prompt), tokens 3-4 of sample 1 (token 4 an observation)
SAMPLE_INDEX, LOSS_MASK = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 1, 1, 0])


def _distill(teacher_kl, rewards=(1.0, 0.0), **cfg) -> torch.Tensor:
    inputs = AdvantageInputs(torch.tensor(rewards), torch.tensor([0, 0]), sample_index=SAMPLE_INDEX,
                             loss_mask=LOSS_MASK, teacher_kl=torch.tensor(teacher_kl))
    return ADVANTAGES.get("distill")(inputs, AdvantageConfig(name="distill", **cfg)).advantages


def test_reverse_kl_and_distill_advantage_by_hand():
    student = torch.tensor([float("nan"), -1.0, -2.0, -0.5, -float("inf")])  # [T]; junk off the loss mask
    teacher = torch.tensor([0.0, -1.5, -1.8, -1.5, 0.0])  # [T]
    kl = reverse_kl(student, teacher, LOSS_MASK)
    assert kl.tolist() == pytest.approx([0.0, 0.5, -0.2, 1.0, 0.0])  # 0 (not NaN) off the mask
    # A_t = -distill_coef * kl_t on loss tokens, 0 on the prompt and observation tokens
    assert _distill(kl.tolist(), distill_coef=2.0).tolist() == pytest.approx([0.0, -1.0, 0.4, -2.0, 0.0])
    # mixed with the task: + task_weight * Dr.GRPO advantage (rewards 1, 0 -> +0.5, -0.5 on each sample's tokens)
    mixed = _distill([9.0, 0.5, -0.2, 1.0, 7.0], task_weight=0.5, scale_by_std=False)
    assert mixed.tolist() == pytest.approx([0.0, -0.25, 0.45, -1.25, 0.0])


def test_teacher_equal_to_student_gives_zero_advantage_and_kl():
    lp = torch.tensor([-0.3, -1.0, -2.0, -0.5, -4.0])
    kl = reverse_kl(lp, lp.clone(), LOSS_MASK)
    assert kl.abs().max().item() == 0.0
    assert _distill(kl.tolist()).abs().max().item() == 0.0


def test_distill_needs_the_teacher_kl_and_a_usable_config():
    inputs = AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), sample_index=SAMPLE_INDEX,
                             loss_mask=LOSS_MASK)
    with pytest.raises(ValueError, match="distill.*teacher_kl"):
        ADVANTAGES.get("distill")(inputs, AdvantageConfig(name="distill"))
    with pytest.raises(ConfigError, match="task_estimator='gae'"):
        AdvantageConfig(name="distill", task_estimator="gae").validate()
    with pytest.raises(ConfigError, match="trains on nothing"):
        AdvantageConfig(name="distill", distill_coef=0.0).validate()
    assert undocumented_fields(DistillConfig) == [] and DistillConfig().enabled is False
    with pytest.raises(ConfigError, match="teachr"):
        from_dict(DistillConfig, {"teachr": "hf:x"})
    with pytest.raises(ConfigError, match="distill.teacher.*does not exist"):
        DistillConfig(teacher="hf:/nonexistent/teacher").validate()


# ------------------------------------------------------------------------------------- the trainer's pass
def _distill_trainer(teacher_seed: int | None):
    """A one-process trainer distilling into test_rl_exact_state's policy from a teacher of the same shape: its
    frozen copy (None) or random weights of another seed."""
    from kernels.logprob import LogprobKernelConfig
    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.rl.config import LossConfig
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.policy import FrozenModel
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer
    from tests.test_rl_exact_state import _policy

    policy = _policy(warmup_steps=0)
    teacher = policy.frozen_copy() if teacher_seed is None else \
        FrozenModel(policy, policy.cfg, lambda m: init_weights_by_name(m, teacher_seed))
    cfg = RLConfig(loss=LossConfig(name="grpo"), advantage=AdvantageConfig(name="distill"),
                   packing=PackingConfig(max_tokens=64), old_logprobs="recompute",
                   logprob_kernel=LogprobKernelConfig(impl="torch"))
    return RLTrainer(policy, cfg, teacher=teacher)


def test_trainer_teacher_kl_zero_for_the_student_itself_and_positive_for_another_model():
    from tests.mp.trainer_parity import batch

    same = _distill_trainer(None).step(batch(0))
    assert not same["update_skipped"] and abs(same["teacher_kl"]) < 1e-6 and abs(same["loss"]) < 1e-6
    other = _distill_trainer(99).step(batch(0))
    assert other["teacher_kl"] > 1e-3 and abs(other["loss"]) > 1e-5, other


def test_trainer_refuses_distill_without_a_teacher():
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer
    from tests.test_rl_exact_state import _policy

    with pytest.raises(ConfigError, match="distill.*needs a teacher"):
        RLTrainer(_policy(), RLConfig(advantage=AdvantageConfig(name="distill")))
