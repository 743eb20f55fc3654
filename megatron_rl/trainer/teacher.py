"""The on-policy distillation teacher: a frozen model loaded from any checkpoint the run can load (`distill:`).

    distill:
      teacher: hf:runs/post_train/export/hf-step-12     # an HF folder (or mcore:DIR), converted like model.init
    rl:
      dynamic_sampling: false
      trainer:
        advantage: {name: distill, distill_coef: 1.0, task_weight: 0.0}

Where it runs: on the trainer ranks, as a forward-only log-prob pass over the packed micro-batches, like the KL
reference model (trainer/rl_step.py). That reuses what the reference pass already has: the policy's parallel
layout (TP/PP/VPP/CP shards of the teacher, loaded in place by the converter's rules), the packing, the fused
log-prob kernel at the run's temperature with the tokenizer's vocabulary (`valid_vocab`), and the in-process
batch (the log-probs stay in the micro-batches: no shard field, no engine API). A second rollout engine would
hold the whole teacher on every rank (the engine is TP-only) and need a prefill-only scoring path and a shard
field; the cost of the trainer-side pass is that the teacher must fit the trainer's layout (its layer count
divisible by pp x vpp), checked before any rank starts.

The teacher must tokenize as the student does: the same token -> id map (HF tokenizer files) and a vocabulary
holding every tokenizer id; a different one is refused before any work, naming both folders.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_rl.config import ConfigError


@dataclass
class DistillConfig:
    """On-policy distillation: the teacher that scores every sampled token (off unless `teacher` is set)."""

    teacher: str = ""
    """The teacher checkpoint, as model.init names one: hf:DIR (an HF folder) or mcore:DIR; '' = no distillation.
    Needs rl.trainer.advantage.name=distill (whose distill_coef / task_weight mix it with the task rewards)."""

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)

    def validate(self) -> None:
        if self.teacher:
            from megatron_rl.model_init import parse

            try:
                parse(self.teacher)
            except ConfigError as e:
                hint = " (the main job's export: `megatron-rl train configs/post_train_cpu.yaml` writes " \
                       "runs/post_train/export/hf-step-N)" if "export" in self.teacher else ""
                raise ConfigError(str(e).replace("model.init", "distill.teacher") + hint) from None


def teacher_model_config(student, teacher: str):
    """The teacher's ModelConfig: its architecture from its checkpoint, the run's choices (max_seq_length, dtype,
    transformer_impl) from the student's `student` ModelConfig."""
    from megatron_rl.convert.source import resolve
    from megatron_rl.models.gpt import ModelConfig

    cfg = dataclasses.replace(ModelConfig(), init=teacher, max_seq_length=student.max_seq_length,
                              params_dtype=student.params_dtype, transformer_impl=student.transformer_impl)
    try:
        resolve(cfg)
    except ConfigError as e:
        raise ConfigError(f"distill.teacher={teacher!r}: {str(e).replace('model.init', 'the teacher')}") from None
    return cfg


def check_teacher(run) -> None:
    """Refuse (ConfigError) a teacher the run cannot use: a tokenizer or vocabulary other than the student's, a
    layer count the trainer's layout cannot split, or distill without the distill advantage (and vice versa)."""
    cfg, adv = run.distill, run.rl.trainer.advantage
    if cfg.enabled != (adv.name == "distill"):
        raise ConfigError(f"distill.teacher={cfg.teacher!r} and rl.trainer.advantage.name={adv.name!r}: the "
                          "teacher is used by the distill advantage only; set both (advantage.name: distill) or "
                          "neither")
    if not cfg.enabled:
        return
    if run.rl.dynamic_sampling:
        raise ConfigError("distill: rl.dynamic_sampling drops groups whose rewards are all equal, but every sampled "
                          "token carries the teacher's signal; set rl.dynamic_sampling=false")
    teacher = teacher_model_config(run.model, cfg.teacher)
    _check_tokenizer(run, teacher)
    try:
        teacher.check_training(run.parallel)
    except ConfigError as e:
        raise ConfigError(f"distill.teacher={cfg.teacher!r} runs in the trainer's layout: {e}") from None


def _vocab(folder: str) -> dict[str, int] | None:
    """The token -> id map of an HF tokenizer folder (None: none there, the byte tokenizer)."""
    if not folder:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{folder}/tokenizer.json").get_vocab(with_added_tokens=True)


def _check_tokenizer(run, teacher) -> None:
    from megatron_rl.model_init import tokenizer_folder

    mine, theirs = run.tokenizer.resolved_path(run.model), tokenizer_folder(run.distill.teacher)
    a, b = _vocab(mine), _vocab(theirs)
    size = len(a) if a is not None else run.model.vocab_size
    if a != b or (a is None and teacher.vocab_size != run.model.vocab_size):
        what = lambda folder, v, n: f"{folder or 'the byte tokenizer'} ({len(v) if v else n} tokens)"  # noqa: E731
        raise ConfigError(f"distill.teacher={run.distill.teacher!r}: the teacher's tokenizer "
                          f"{what(theirs, b, teacher.vocab_size)} differs from the student's "
                          f"{what(mine, a, run.model.vocab_size)}; the teacher scores the student's token ids, so "
                          f"both must share one tokenizer (distil from a model of the same family)")
    if teacher.vocab_size < size:
        raise ConfigError(f"distill.teacher={run.distill.teacher!r}: its vocabulary ({teacher.vocab_size}) is "
                          f"smaller than the tokenizer's {size} tokens")


def load_teacher(run, policy):
    """This rank's frozen teacher (`FrozenModel` in the policy's layout, its shards loaded from the checkpoint),
    or None when distillation is off."""
    if not run.distill.enabled:
        return None
    from megatron_rl.convert.source import initializer
    from megatron_rl.trainer.policy import FrozenModel

    cfg = teacher_model_config(run.model, run.distill.teacher)
    return FrozenModel(policy, cfg, initializer(cfg))
