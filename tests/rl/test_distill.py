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
    from tests.trainer.test_rl_exact_state import _policy

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
    from tests.trainer.test_rl_exact_state import _policy

    with pytest.raises(ConfigError, match="distill.*needs a teacher"):
        RLTrainer(_policy(), RLConfig(advantage=AdvantageConfig(name="distill")))


# ------------------------------------------------------------------------------------------ the run config
def _run_config(student, teacher, *more):
    from megatron_rl import load_config

    return load_config(str(REPO / "configs/post_train_cpu.yaml"),
                       [f"model.init=hf:{student}", f"distill.teacher=hf:{teacher}", *DISTILL, *more])


REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
DISTILL = ("rl.trainer.advantage.name=distill", "rl.dynamic_sampling=false")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Student and teacher: tiny random Llamas of one tokenizer (seeds 0 and 1)."""
    from tests.hf_tiny import tiny_llama, tiny_tokenizer

    root = tmp_path_factory.mktemp("distill")
    tok = tiny_tokenizer(root / "student")
    tiny_llama(root / "student", tok, seed=0)
    tiny_llama(root / "teacher", tok, seed=1)
    return root / "student", root / "teacher"


def test_teacher_of_another_tokenizer_is_refused_naming_both(tiny_pair, tmp_path):
    from tests.hf_tiny import tiny_llama, tiny_tokenizer

    student, teacher = tiny_pair
    assert _run_config(student, teacher).distill.teacher == f"hf:{teacher}"  # same tokenizer: accepted
    other = tmp_path / "other"
    tiny_llama(other, tiny_tokenizer(other, vocab_size=300), seed=1)
    with pytest.raises(ConfigError, match=rf"teacher's tokenizer {other} \(300 tokens\) differs from the "
                                          rf"student's {student} \(259 tokens\)"):
        _run_config(student, other)
    with pytest.raises(ConfigError, match="rl.dynamic_sampling=false"):
        _run_config(student, teacher, "rl.dynamic_sampling=true")
    with pytest.raises(ConfigError, match="set both .* or neither"):
        _run_config(student, teacher, "rl.trainer.advantage.name=grpo")


# ------------------------------------------------------------------------------------------ the product path
@pytest.mark.slow
@pytest.mark.multiproc
def test_student_kl_to_a_tiny_teacher_goes_down_in_the_loop(tiny_pair, tmp_path):
    """`megatron-rl train` (the main job's config, in-process loop) distilling a tiny teacher (seed 1) into a tiny
    student (seed 0) of one tokenizer: the logged reverse KL to the teacher falls over a few steps."""
    import json
    import subprocess
    import sys

    student, teacher = tiny_pair
    exe = str(__import__("pathlib").Path(sys.executable).parent / "megatron-rl")
    short = ("rl.steps=6", "rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=16", "eval.tasks=2",
             "eval.k=2", "model.max_seq_length=128", "rl.optim.lr=1e-2", "export.enabled=false",
             "engine.num_blocks=128", "monitor.tensorboard=false")
    proc = subprocess.run([exe, "train", "configs/post_train_cpu.yaml", f"output_dir={tmp_path}",
                           f"model.init=hf:{student}", f"distill.teacher=hf:{teacher}", *DISTILL, *short],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rl = [json.loads(x) for x in (tmp_path / "post_train" / "metrics.jsonl").read_text().splitlines() if '"rl"' in x]
    kl = [r["teacher_kl"] for r in rl]
    print("teacher_kl per step:", kl)
    assert len(kl) == 6 and kl[0] > 0.1 and all(r["cpu_step_s"] > 0 for r in rl)
    assert sum(kl[-3:]) / 3 < 0.7 * kl[0], kl  # the last steps' policies against the starting one (0.46 -> 0.18)
