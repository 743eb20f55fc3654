"""One RL training step on Megatron-Core: trajectories -> advantages -> packed micro-batches -> policy update.

    trainer = RLTrainer(policy, RLConfig(loss=LossConfig(name="grpo")))
    metrics = trainer.step(read_arrays(shard))    # the same global batch on every rank

Every rank receives the whole global batch (columns of a shard, `TrajectoryColumns`), computes the
advantages over it (group statistics are global), validates and packs it, and keeps its data-parallel share
of the micro-batches (`packing.pack`). The loss follows the normalisation contract of
`megatron_rl.rl.losses`: the normaliser Z is summed over this rank's micro-batches and all-reduced (SUM) over
the data-parallel group, each micro-batch back-propagates sum_t a_t l_t / Z, and the loss is multiplied by
num_microbatches * dp against Megatron's per-micro-batch division and DDP's averaging, so gradients are the
SUM over ranks, i.e. those of the whole global batch in one piece.

Context parallelism (cp > 1): `pack` pads every sample to a multiple of 2*cp and gives each CP rank its
load-balanced share of every micro-batch (chunks r and 2cp-1-r of each sample, [1, max_tokens/cp]). Each CP
rank computes the log-probs and the loss of its own tokens only; Z is summed over the dp x cp ranks
(`pgs.dp_cp`), and so are the reported loss and token counts. The gradient factor is unchanged (dp):
Megatron's `schedules.forward_step` multiplies a 2-output loss by cp_group_size and divides it by
num_microbatches, and DDP averages over dp_cp (divides by dp*cp), so loss * num_microbatches * dp yields
cp * (nmb * dp) / (nmb * dp * cp) = 1, the SUM over all dp x cp ranks (the K/V all-gather's backward
reduce-scatter carries the cross-rank attention gradients). Seq-mean aggregation stays exact through each
token's `sample_num_tokens` (counted on the whole sample before the split). Quantities that need a
differentiable per-sample reduction across CP ranks (GSPO's sequence ratio, sequence-level IS weights) are
refused with cp > 1.

Log-probs (`logprob_impl`): 'fused' (default) has the last pipeline stage hand the loss the final hidden
states and the output weight (`output_head.HeadOutput`) and computes log-probs and entropy with
`kernels.logprob.fused_logprob_entropy`, chunked over tokens and vocabulary, never forming the [T, V/tp]
logits (Triton on CUDA, PyTorch elsewhere); 'logits' takes Megatron's vocab-parallel logits
(`logprobs.token_logprobs_and_entropy`). Both give softmax(logits / temperature) over the full vocabulary,
as the rollout engine samples it, and the same values and gradients (tests/trainer/test_trainer_fused_logprob.py).

Old log-probs (the PPO ratio's denominator): the rollout engine's behaviour log-probs, or recomputed with a
forward-only pass of the policy before the update (`old_logprobs='recompute'`, needed for epochs > 1).
Reference log-probs for the KL term come from a frozen copy of the initial policy (`reference=True`). KL-in-reward
(`advantage.kl_coef` > 0: REINFORCE++, GAE) needs them before the advantages: the micro-batches are packed with
zero advantages, the old and reference log-probs computed, the per-token KL gathered into the global batch's
layout on every rank, and the advantages of the whole batch written back (`_late_advantages`).

On-policy distillation (`advantage.name='distill'`, a `teacher` given: trainer/teacher.py): a frozen teacher
model in the policy's layout makes a forward-only log-prob pass over the same micro-batches (`teacher_logprobs`
[1, S], at the run's temperature, no routing replay: its experts are its own); the per-token reverse KL
log pi_old(x_t) - log pi_teacher(x_t) is gathered into the global batch's layout like the KL below and the
distill advantages computed from it (rl/advantages.py). `teacher_kl` in the metrics: its mean over the batch's
loss tokens, the estimate of KL(policy || teacher) per token (0 when the teacher is the policy).

Mismatch (`mismatch_kl` in the metrics): KL(behaviour || trainer), the k3 estimate per loss token of the rollout
engine's behaviour log-probs against the trainer's log-probs of the same tokens from the first epoch's forward
pass (the weights before the update), whatever `old_logprobs` and the IS correction are. It measures numerical
train/rollout disagreement (plus the policy lag of stale samples); 0 only when both compute the same values.

MoE routing replay (`routing_replay`, models/routing_replay.py): micro-batches carry the rollout engine's experts
of each input token (`routed_experts`, from the shard); forward-only log-prob passes replay them unless 'off',
the training forward with 'everywhere' (else it routes by itself and only compares). `routing_mismatch_frac`:
the share of (token, MoE layer) pairs of the first epoch's training forward whose own top-k set differs from
the engine's (None when the batch has no routes).

Multi-token prediction (a model with `mtp_num_layers` > 0, models/mtp.py): the log-probs and the RL loss use the
main head only. With `mtp_loss_coeff` > 0 the training forward also returns each MTP depth's output; depth k's
NLL of labels[t + k] (a model token of the same sample: the policy's own later sampled tokens) is summed, divided
by the global count of such targets and added, times the coefficient, to the loss. The MTP layers read detached
trunk states, embedding and output weight, so this trains the MTP layers only (a draft head that keeps up with the
policy) and leaves the policy gradient exactly the RL loss's. `mtp_loss` in the metrics is its mean NLL.

Critic (PPO with GAE: `critic` config, built by default exactly when advantage.name is 'gae'): a value model
(`trainer.critic.ValueModel`: the policy's architecture and layout with a scalar head, its own optimizer and
schedule). Its forward-only values V(s_t) [1, S] are gathered like the KL above into the global batch's
layout, GAE's advantages and returns computed over the whole batch and written back; after the policy's
epochs the critic runs as many epochs of the clipped value loss (`rl.value`) on the same micro-batches.
Metrics: value_loss and value_clip_fraction (first epoch: the critic before this step's update),
explained_variance of the returns by the values GAE used, value_mean, value_grad_norm.

Learning-rate schedule: one schedule step per RL step (after its last PPO epoch, when an update was made), so
with `epochs` > 1 every epoch of RL step n uses the schedule's value at n; `lr` in the metrics is that value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from kernels.logprob import LogprobKernelConfig
from megatron_rl.config import ConfigError
from megatron_rl.models import mtp
from megatron_rl.models.output_head import HeadOutput
from megatron_rl.rl.advantages import AdvantageInputs, AdvantageOutput, reverse_kl
from megatron_rl.rl.config import AdvantageConfig, LossConfig
from megatron_rl.rl.losses import LossInputs, kl_penalty, mismatch_kl, normaliser
from megatron_rl.rl.value import explained_variance
from megatron_rl.trainer.critic import CriticConfig, ValueModel
from megatron_rl.trainer.logprobs import token_logprobs_and_entropy
from megatron_rl.trainer.packing import PackingConfig, check_samples, pack

MEAN_METRICS = ("clip_fraction", "approx_kl", "ref_kl", "entropy_mean", "is_weight_mean", "behaviour_kl",
                "mismatch_kl")
"""Per-micro-batch token means of the loss that are combined into global means (weighted by tokens)."""


@dataclass
class RLConfig:
    """The RL update of the policy trainer."""

    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss (LOSSES registry) and its normalisation."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage estimator (ADVANTAGES registry), run on the whole global batch."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """Micro-batch token budget and overlong-sample policy."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts: log-probs are those of softmax(logits / temperature)."""
    logprob_impl: Literal["fused", "logits"] = "fused"
    """Log-probs from hidden states + output weight by the fused kernel ('fused', no [T, V] logits) or from logits."""
    logprob_kernel: LogprobKernelConfig = field(default_factory=lambda: LogprobKernelConfig(check_targets=False))
    """Backend and chunk sizes of the fused kernel (target ids are already checked against the vocab here)."""
    logprob_chunk_size: int = 0
    """Tokens per chunk of the 'logits' log-prob/entropy computation (bounds fp32 memory); 0 = whole micro-batch."""
    old_logprobs: Literal["behaviour", "recompute"] = "behaviour"
    """PPO ratio denominator: the rollout's behaviour log-probs, or recomputed by a forward pass before the update."""
    epochs: int = 1
    """Optimizer steps over the same global batch (PPO epochs); > 1 needs old_logprobs='recompute'."""
    reference: bool = False
    """Keep a frozen copy of the initial policy for the KL term (required when loss.kl_coef > 0)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (PPO with GAE): built by default exactly when advantage.name is 'gae'."""
    valid_vocab: int | None = None
    """Ids below this are the tokenizer's; the rest pad the model's vocab and never enter a softmax (the loop
    sets it from the run's tokenizer; None = every id)."""
    routing_replay: Literal["off", "logprobs", "everywhere"] = "off"
    """MoE routing replay (R3) of the experts the rollout engine chose (recorded when this is not off, stored
    in the shards): off; logprobs: the forward-only log-prob passes (recomputed old log-probs, the reference)
    replay them; everywhere: the training forward (loss and gradients) too. Needs an MoE model."""
    mtp_loss_coeff: float = 0.1
    """Weight of the multi-token-prediction loss (a model with model.mtp_num_layers > 0): the MTP layers' NLL of
    the policy's own sampled tokens, trained on detached trunk states (the policy gradient is unchanged); 0: the
    MTP layers are not run in training and keep their weights."""

    def _validate_critic(self) -> None:
        if self.advantage.name == "gae" and not self.critic.active("gae"):
            raise ConfigError("advantage.name='gae' needs a critic (the values V(s_t) of its TD errors), but "
                              "critic.enabled=false; remove that key (gae builds one by default) or use another "
                              "estimator (grpo, rloo, reinforce++)")
        if self.critic.active(self.advantage.name) and self.advantage.name != "gae":
            raise ConfigError(f"critic.enabled=true, but advantage.name={self.advantage.name!r} does not use "
                              "values; use advantage.name='gae' or remove critic.enabled")

    def validate(self) -> None:
        self.loss.validate()
        if self.routing_replay not in ("off", "logprobs", "everywhere"):
            raise ConfigError(f"rl.trainer.routing_replay={self.routing_replay!r} is not one of off, logprobs, "
                              f"everywhere")
        self.advantage.validate()
        self.packing.validate()
        self.critic.validate()
        self._validate_critic()
        if not self.temperature > 0:
            raise ConfigError(f"rl.temperature must be > 0, got {self.temperature}")
        if self.logprob_impl not in ("fused", "logits"):
            raise ConfigError(f"rl.logprob_impl={self.logprob_impl!r}; use 'fused' or 'logits'")
        self.logprob_kernel.validate()
        if self.logprob_chunk_size < 0:
            raise ConfigError(f"rl.logprob_chunk_size must be >= 0, got {self.logprob_chunk_size}")
        if self.epochs < 1:
            raise ConfigError(f"rl.epochs must be >= 1, got {self.epochs}")
        if not self.mtp_loss_coeff >= 0:
            raise ConfigError(f"rl.trainer.mtp_loss_coeff must be >= 0, got {self.mtp_loss_coeff}")
        if self.epochs > 1 and self.old_logprobs != "recompute":
            raise ConfigError("rl.epochs > 1 needs rl.old_logprobs='recompute' (the ratio must be taken against "
                              "the policy before the first update, not the rollout engine)")
        if self.loss.kl_coef > 0 and not self.reference:
            raise ConfigError("loss.kl_coef > 0 needs rl.reference=true (a frozen reference model)")
        if self.advantage.kl_coef > 0 and not self.reference:
            raise ConfigError("advantage.kl_coef > 0 (KL-in-reward) needs rl.reference=true (a frozen reference "
                              "model)")


def mask_padding(logits: torch.Tensor, valid_vocab: int | None, tp_group) -> torch.Tensor:
    """Vocab-parallel logits [..., V/tp] with the padding ids (>= valid_vocab) pushed to -1e30 (out of every
    softmax, zero gradient); the logits themselves when nothing is padded."""
    vp = logits.shape[-1]
    rank = torch.distributed.get_rank(tp_group) if tp_group is not None and torch.distributed.is_initialized() else 0
    local = None if valid_vocab is None else valid_vocab - rank * vp  # valid ids in this rank's slice
    if local is None or local >= vp:
        return logits
    pad = torch.arange(vp, device=logits.device) >= max(local, 0)  # [V/tp]
    return logits.masked_fill(pad, -1e30)


def token_advantages(cols, cfg: AdvantageConfig, kl: np.ndarray | None = None) -> np.ndarray:
    """float32 [T] advantages aligned with cols.tokens (label side: token t's advantage sits at t); `kl` [T]:
    the per-token KL to the reference for KL-in-reward (cfg.kl_coef > 0)."""
    return advantage_output(cols, cfg, kl).advantages.float().numpy()


def advantage_output(cols, cfg: AdvantageConfig, kl=None, values=None, teacher_kl=None) -> AdvantageOutput:
    """The estimator's output over the global batch, per token [T] aligned with cols.tokens (label side);
    `kl` [T] for KL-in-reward, `values` [T] the critic's V(s_t) for gae, `teacher_kl` [T] the reverse KL to the
    teacher for distill (each an array or tensor, or None)."""
    lengths = np.diff(np.asarray(cols.offsets))  # [N]
    episode = cols.episode_index() if hasattr(cols, "episode_index") else np.arange(len(lengths))  # [N] -> [0, E)
    # (the rows of a split agent episode are one sample: one reward, one group entry, one advantage)
    first = np.unique(episode, return_index=True)[1]  # [E] each episode's first row
    sample_index = torch.from_numpy(np.repeat(episode, lengths))  # [T] values in [0, E)
    inputs = AdvantageInputs(rewards=torch.as_tensor(np.asarray(cols.reward, dtype=np.float64)[first]),
                             group_ids=torch.as_tensor(np.asarray(cols.group_id, dtype=np.int64)[first]),
                             sample_index=sample_index, loss_mask=torch.from_numpy(cols.loss_mask.astype(bool)),
                             kl=None if kl is None else torch.as_tensor(kl).cpu(),
                             values=None if values is None else torch.as_tensor(values).cpu(),
                             teacher_kl=None if teacher_kl is None else torch.as_tensor(teacher_kl).cpu())
    return cfg.build()(inputs)


class RLTrainer:
    """Runs RL steps of one rank's `Policy` (and optional frozen reference and distillation teacher) on global
    batches."""

    def __init__(self, policy, cfg: RLConfig, reference=None, teacher=None):
        cfg.validate()
        if (cfg.advantage.name == "distill") != (teacher is not None):
            raise ConfigError("advantage.name='distill' needs a teacher (distill.teacher: an HF folder), and a "
                              "teacher needs advantage.name='distill'; set both or neither")
        self.teacher = teacher
        """Frozen teacher (trainer/teacher.py) scoring the sampled tokens for distill; None without."""
        check_cp_support(cfg, policy.ctx.parallel.cp)
        self.policy, self.cfg, self.loss = policy, cfg, cfg.loss.build()
        self.fused = cfg.logprob_kernel.build() if cfg.logprob_impl == "fused" else None
        self.output = "hidden" if self.fused is not None else "logits"
        self.reference = reference if reference is not None or not cfg.reference else policy.frozen_copy()
        self.critic = ValueModel(policy, cfg.critic, policy.scheduler.lr_decay_steps) \
            if cfg.critic.active(cfg.advantage.name) else None
        self.mtp = policy.cfg.mtp_num_layers if cfg.mtp_loss_coeff > 0 else 0
        """MTP depths trained by the auxiliary loss (0: none)."""
        if policy.cfg.mtp_num_layers and not self.mtp and policy.optim_cfg.weight_decay > 0:
            raise ConfigError(f"rl.trainer.mtp_loss_coeff=0 leaves the model's {policy.cfg.mtp_num_layers} MTP "
                              f"layer(s) untrained, but rl.optim.weight_decay={policy.optim_cfg.weight_decay} would "
                              f"still shrink them; set rl.trainer.mtp_loss_coeff > 0 or weight_decay=0")

    # ------------------------------------------------------------------------------------ the step
    def step(self, cols) -> dict:
        """One RL step on the global batch `cols` (identical on every rank); metrics known on every rank."""
        mbs, stats = self.prepare(cols)
        out = {"samples": stats.samples, "skipped_overlong": stats.skipped_overlong,
               "skipped_empty": stats.skipped_empty, "microbatches": len(mbs), "pack_fill": stats.fill}
        if stats.samples == 0:
            return {**out, "update_skipped": True}
        z = self._global_normaliser(mbs)
        self._set_old_and_ref(mbs)
        late = self._late_advantages(cols, mbs)
        epochs = [self._update(mbs, z) for _ in range(self.cfg.epochs)]
        if any(e["update_ok"] for e in epochs):
            self.policy.advance_schedule()  # the LR schedule counts RL steps, not PPO epochs
        first = epochs[0]  # the first epoch's forward: the weights before the update
        critic = self._update_critic(mbs) if self.critic is not None else {}
        return {**out, **epochs[-1], "update_skipped": False, "epoch_losses": [e["loss"] for e in epochs],
                "mismatch_kl": first["mismatch_kl"], "routing_mismatch_frac": first["routing_mismatch_frac"],
                **late, **critic}

    def prepare(self, cols):
        """Validate, compute advantages and pack: this rank's micro-batches and the packing stats. With
        KL-in-reward (advantage.kl_coef > 0) or a critic the advantages are zeros here and `_late_advantages`
        fills them once the old and reference log-probs and the values are known."""
        keep, stats = check_samples(cols, self.policy.cfg.vocab_size, self.cfg.packing)
        if self._late:
            adv = np.zeros(len(cols.tokens), dtype=np.float32)  # [T]
        else:
            adv = token_advantages(cols, self.cfg.advantage)  # [T]
        pgs, par = self.policy.ctx.pgs, self.policy.ctx.parallel
        interleaved = par.pp > 1 and (par.vpp or 1) > 1
        mbs, stats = pack(cols, keep, self.cfg.packing, torch.distributed.get_rank(pgs.dp),
                          torch.distributed.get_world_size(pgs.dp), {"advantages": adv}, stats,
                          multiple_of=par.pp if interleaved else 1, cp_rank=torch.distributed.get_rank(pgs.cp),
                          cp_size=par.cp, trim_to=self._trim_to())
        dev = self._device()
        return [{k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in mb.items()} for mb in mbs], stats

    def _trim_to(self) -> int:
        """Micro-batches end after their samples (rounded up to 16 x tp slots: sequence parallelism splits
        them over TP) where every rank's schedule takes any length: no pipeline (its p2p shapes are fixed),
        no CP split, no expert parallelism (MoE token exchanges across DP ranks); else 0 (max_tokens)."""
        par = self.policy.ctx.parallel
        return 16 * par.tp if par.pp == 1 and par.cp == 1 and par.ep == 1 else 0

    def _device(self) -> torch.device:
        """Where micro-batches and the trainer's collectives live: the rank's device (DistContext.device)."""
        return self.policy.ctx.device

    def compute_gradients(self, cols) -> tuple[float, dict[str, torch.Tensor]]:
        """Forward+backward of one step WITHOUT the optimizer update (tests, diagnostics): the global loss
        and this rank's reduced gradients {parameter name: main_grad}."""
        mbs, _ = self.prepare(cols)
        z = self._global_normaliser(mbs)
        self._set_old_and_ref(mbs)
        self._late_advantages(cols, mbs)
        for chunk in self.policy.chunks:
            chunk.zero_grad_buffer()
        _mark(mbs, "replay" if self.cfg.routing_replay == "everywhere" else "compare")
        z_mtp = self._mark_mtp(mbs, True)
        raw = self.policy.forward_backward(mbs, self._loss_fn(z, len(mbs) * self.policy.grad_scale, z_mtp),
                                           self.cfg.packing.max_tokens, output=self.output)
        self._mark_mtp(mbs, False)
        grads = {n: p.main_grad.detach().clone() for n, p in self.policy.named_parameters()
                 if hasattr(p, "main_grad")}  # not the weight buffers (expert bias)
        return self._reduce(raw)["loss"], grads

    @property
    def _late(self) -> bool:
        """The advantages need the models' outputs first (KL-in-reward, or GAE's values)."""
        return self.cfg.advantage.kl_coef > 0 or self.critic is not None or self.teacher is not None

    def _set_old_and_ref(self, mbs: list[dict]) -> None:
        _mark(mbs, "replay" if self.cfg.routing_replay != "off" else None)  # forward-only log-prob passes
        if self.critic is not None:
            self.critic.store_values(mbs, self.cfg.packing.max_tokens)
        if self.reference is not None:
            self._store_logprobs(self.reference, mbs, "ref_logprobs")
        if self.cfg.old_logprobs == "recompute":
            self._store_logprobs(self.policy, mbs, "old_logprobs")
        else:
            for mb in mbs:
                mb["old_logprobs"] = mb["behaviour_logprobs"]
        if self.teacher is not None:
            _mark(mbs, None)  # the teacher routes its own experts: the engine's routes are the student's
            self._store_logprobs(self.teacher, mbs, "teacher_logprobs")

    def _late_advantages(self, cols, mbs: list[dict]) -> dict:
        """Token-level advantages that need the models first: KL-in-reward (advantage.kl_coef > 0: REINFORCE++,
        GAE) takes the per-token k1 KL of the old policy to the reference, log pi_old - log pi_ref; GAE takes the
        critic's values V(s_t); distill the reverse KL of the old policy to the teacher. Each is gathered from
        every rank's micro-batches into the global batch's token layout [T] (each token lives on one dp x cp
        rank's last pipeline stage), the advantages (and GAE's returns) of the whole batch computed, and written
        back into this rank's micro-batches. Returns the
        critic's explained variance of those returns and the mean teacher_kl ({} without critic and teacher)."""
        if not self._late:
            return {}
        places = self._token_places(cols, mbs)
        kl = self._gather(cols, mbs, places, lambda mb: kl_penalty(
            mb["old_logprobs"].reshape(-1), mb["ref_logprobs"].reshape(-1), mb["loss_mask"].reshape(-1)),
            "ref_logprobs") if self.cfg.advantage.kl_coef > 0 else None  # [T]
        values = self._gather(cols, mbs, places, lambda mb: mb["old_values"].reshape(-1), "old_values") \
            if self.critic is not None else None  # [T]
        teacher = self._gather(cols, mbs, places, lambda mb: reverse_kl(
            mb["old_logprobs"].reshape(-1), mb["teacher_logprobs"].reshape(-1), mb["loss_mask"].reshape(-1)),
            "teacher_logprobs") if self.teacher is not None else None  # [T]
        out = advantage_output(cols, self.cfg.advantage, kl, values, teacher)
        self._scatter(mbs, places, "advantages", out.advantages)
        mask = torch.from_numpy(cols.loss_mask.astype(bool))  # [T]
        distill = {} if teacher is None else {"teacher_kl": self._teacher_kl(cols, mbs, places, teacher)}
        if values is None:
            return distill
        self._scatter(mbs, places, "returns", out.returns)
        return {**distill, "explained_variance": explained_variance(values.cpu(), out.returns, mask),
                "value_mean": float(values.cpu()[mask].mean()) if mask.any() else 0.0}

    def _teacher_kl(self, cols, mbs: list[dict], places, teacher_kl: torch.Tensor) -> float:
        """Mean of teacher_kl [T] over the loss tokens that were trained (packed on some rank)."""
        packed = self._gather(cols, mbs, places, lambda mb: mb["loss_mask"].reshape(-1), "teacher_logprobs")  # [T]
        n = float(packed.sum())
        return float((teacher_kl * packed).sum()) / n if n else 0.0

    @staticmethod
    def _token_places(cols, mbs: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per micro-batch: its real slots [S] (bool) and the global label token t [S'] of each."""
        offsets = torch.as_tensor(np.asarray(cols.offsets), dtype=torch.long)  # [N+1]
        places = []
        for mb in mbs:
            si, pos = mb["sample_index"].reshape(-1), mb["position_ids"].reshape(-1)  # each [S]
            real = si >= 0
            places.append((real, offsets.to(si.device)[si[real]] + 1 + pos[real]))  # label token t of each slot
        return places

    def _gather(self, cols, mbs: list[dict], places, per_slot, present: str) -> torch.Tensor:
        """[T] float64 on the trainer's device: per_slot(mb) [S] of the micro-batches holding `present` (the
        last pipeline stage), placed at their global tokens and summed over pp and dp x cp (each token once)."""
        out = torch.zeros(len(cols.tokens), dtype=torch.float64, device=self._device())  # [T]
        for mb, (real, idx) in zip(mbs, places):
            if present in mb:
                out[idx.to(out.device)] = per_slot(mb)[real].to(out)
        pgs = self.policy.ctx.pgs
        for group in (pgs.pp, pgs.dp_cp):
            torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def _scatter(mbs: list[dict], places, key: str, values: torch.Tensor) -> None:
        """mb[key] [1, S] = values [T] (global, label side) at each micro-batch's real slots, 0 elsewhere."""
        for mb, (real, idx) in zip(mbs, places):
            flat = torch.zeros(mb["labels"].numel(), dtype=torch.float32, device=mb["labels"].device)  # [S]
            flat[real] = values[idx.cpu()].to(flat)
            mb[key] = flat.view_as(mb["labels"])

    def _update_critic(self, mbs: list[dict]) -> dict:
        """The critic's epochs (as many as the policy's) on the clipped value loss; value_loss and
        value_clip_fraction are the first epoch's (the critic before this step's update: how well it predicted)."""
        tokens = torch.tensor([float(sum(mb["loss_mask"].sum() for mb in mbs))], dtype=torch.float64,
                              device=self._device())
        torch.distributed.all_reduce(tokens, group=self.policy.ctx.pgs.dp_cp)
        n = float(tokens.item())
        epochs = [self.critic.update(mbs, n, self.cfg.packing.max_tokens) for _ in range(self.cfg.epochs)]
        first = self._reduce_sums(epochs[0], ("value_loss_sum", "value_clip_sum"))
        return {"value_loss": first["value_loss_sum"] / max(n, 1.0),
                "value_clip_fraction": first["value_clip_sum"] / max(n, 1.0),
                "value_grad_norm": epochs[-1]["value_grad_norm"]}

    def _reduce_sums(self, raw: dict, keys: tuple[str, ...]) -> dict:
        """raw[k] summed over the pipeline (non-last stages hold 0) and dp x cp ranks, on every rank."""
        t = torch.tensor([float(raw.get(k, 0.0)) for k in keys], dtype=torch.float64, device=self._device())  # [K]
        pgs = self.policy.ctx.pgs
        for group in (pgs.pp, pgs.dp_cp):
            torch.distributed.all_reduce(t, group=group)
        return dict(zip(keys, t.tolist()))

    def _update(self, mbs: list[dict], z: float) -> dict:
        scale = len(mbs) * self.policy.grad_scale
        _mark(mbs, "replay" if self.cfg.routing_replay == "everywhere" else "compare")
        self._routing_counts()  # reset: count this pass only
        z_mtp = self._mark_mtp(mbs, True)
        raw = self.policy.train_step(mbs, self._loss_fn(z, scale, z_mtp), self.cfg.packing.max_tokens,
                                     output=self.output, advance_schedule=False)
        self._mark_mtp(mbs, False)
        differ, compared = self._routing_counts().tolist()
        m = self._reduce(raw)
        tokens = max(m.pop("tokens"), 1.0)
        means = {k: m[f"{k}_sum"] / tokens for k in MEAN_METRICS if f"{k}_sum" in m}
        if "mtp_nll_sum" in m:
            means["mtp_loss"] = m["mtp_nll_sum"] / max(m["mtp_tokens"], 1.0)
        return {"loss": m["loss"], "tokens": tokens, **means, "grad_norm": raw.get("grad_norm"),
                "update_ok": raw.get("update_ok"), "lr": self.policy.optimizer.param_groups[0]["lr"],
                "routing_mismatch_frac": differ / compared if compared else None}

    def _routing_counts(self) -> torch.Tensor:
        """[2] (token, MoE layer) pairs whose trainer top-k set differs from the engine's, and pairs compared,
        in the passes since the last call, summed over every rank (each TP rank without sequence parallelism
        counts the same tokens: the ratio is unchanged); resets the counts."""
        from megatron_rl.models.routing_replay import take_counts

        counts = sum((take_counts(getattr(c.module, "routing_replays", [])) for c in self.policy.chunks),
                     torch.zeros(2, dtype=torch.float64)).to(self._device())  # [2]
        pgs = self.policy.ctx.pgs
        for group in (pgs.pp, pgs.dp_cp, pgs.tp):
            torch.distributed.all_reduce(counts, group=group)
        return counts.cpu()

    # ------------------------------------------------------------------------------- loss callbacks
    def _logprobs(self, output: torch.Tensor | HeadOutput, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Current log-probs and entropy [T] of a micro-batch from its logits [1, S, V/tp], or from its
        HeadOutput (hidden [S, 1, h], output weight [V/tp, h]) with the fused kernel."""
        if isinstance(output, HeadOutput):
            hidden = output.hidden.transpose(0, 1)  # [b, S, h], the order of labels [b, S]
            return self.fused(hidden.reshape(-1, hidden.shape[-1]), output.weight, batch["labels"].reshape(-1),
                              tp_group=self.policy.ctx.pgs.tp, temperature=self.cfg.temperature,
                              vocab_size=self.cfg.valid_vocab)  # each [T]
        output = mask_padding(output, self.cfg.valid_vocab, self.policy.ctx.pgs.tp)
        lp, ent = token_logprobs_and_entropy(output, batch["labels"], self.policy.ctx.pgs.tp, self.cfg.temperature,
                                             self.cfg.logprob_chunk_size or None)  # each [1, S]
        return lp.reshape(-1), ent.reshape(-1)

    def _loss_fn(self, z: float, scale: float, z_mtp: float = 0.0):
        def loss_fn(output: torch.Tensor, batch: dict):
            mtp_terms = {}
            if batch.get("emit_mtp"):  # the main head's output, then each MTP depth's (models/mtp.py)
                output, depths = mtp.split(output, batch["labels"].shape[-1], self.mtp)
                mtp_terms = self._mtp_nll(depths, batch)
            lp, ent = self._logprobs(output, batch)  # each [T]
            out = self.loss(_loss_inputs(batch, lp, ent if self.cfg.loss.entropy_coef > 0 else ent.detach(), z))
            n = out.metrics["num_tokens"]
            sums = {f"{k}_sum": out.metrics[k] * n for k in MEAN_METRICS if k in out.metrics}
            sums["mismatch_kl_sum"] = mismatch_kl(batch["behaviour_logprobs"].reshape(-1), lp.detach(),
                                                  batch["loss_mask"].reshape(-1)).sum()
            loss = out.loss
            if mtp_terms:
                loss = loss + self.cfg.mtp_loss_coeff * mtp_terms["mtp_nll_sum"] / max(z_mtp, 1.0)
                sums.update({k: v.detach() for k, v in mtp_terms.items()})
            return loss * scale, {"loss": out.loss.detach(), "tokens": n, **sums}
        return loss_fn

    def _mtp_nll(self, depths: list, batch: dict) -> dict:
        """Summed NLL of each MTP depth's targets (the policy's own later sampled tokens; mtp.targets) and their
        count, under the run's temperature like every log-prob of the trainer."""
        nll, count = 0.0, 0.0
        for k, part in enumerate(depths, 1):
            tgt, mask = mtp.targets(batch["labels"], batch["loss_mask"], batch["sample_index"], k)  # each [1, S]
            lp, _ = self._logprobs(part, {"labels": tgt})  # [T]
            nll, count = nll - (lp * mask.reshape(-1)).sum(), count + mask.sum()
        return {"mtp_nll_sum": nll, "mtp_tokens": count}

    def _mark_mtp(self, mbs: list[dict], on: bool) -> float:
        """Have the next passes return the MTP depths too (`on`, when the MTP loss is trained) or not; returns
        the MTP targets of the global batch (the loss's normaliser; summed over data- x context-parallel ranks)."""
        for mb in mbs:
            mb["emit_mtp"] = bool(on and self.mtp)
        if not (on and self.mtp):
            return 0.0
        n = sum(float(mtp.targets(mb["labels"], mb["loss_mask"], mb["sample_index"], k)[1].sum())
                for mb in mbs for k in range(1, self.mtp + 1))
        t = torch.tensor([n], dtype=torch.float64, device=self._device())
        torch.distributed.all_reduce(t, group=self.policy.ctx.pgs.dp_cp)
        return float(t.item())

    def _store_logprobs(self, model, mbs: list[dict], key: str) -> None:
        """Forward-only pass of `model`; the last stage stores log-probs [1, S] into each micro-batch."""
        def store(output: torch.Tensor, batch: dict):
            lp, _ = self._logprobs(_detach(output), batch)
            batch[key] = lp.view_as(batch["labels"]).detach()
            return lp.new_zeros(()), {}
        model.evaluate(mbs, store, self.cfg.packing.max_tokens, output=self.output)

    # ------------------------------------------------------------------------------ reductions
    def _global_normaliser(self, mbs: list[dict]) -> float:
        """Z of the global batch: this rank's micro-batches summed, all-reduced over data- x context-parallel ranks."""
        z = sum(normaliser(self.cfg.loss, mb["loss_mask"].view(-1), mb["sample_index"].view(-1),
                           mb["sample_num_tokens"].view(-1)) for mb in mbs)
        z = torch.as_tensor(z, dtype=torch.float64, device=self._device()).reshape(1)
        torch.distributed.all_reduce(z, group=self.policy.ctx.pgs.dp_cp)
        return float(z.item())

    def _reduce(self, raw: dict) -> dict:
        """Summed loss metrics of the last pipeline stage, summed over data- x context-parallel ranks, on every
        rank."""
        keys = ("loss", "tokens", *(f"{k}_sum" for k in MEAN_METRICS), "mtp_nll_sum", "mtp_tokens")
        t = torch.tensor([float(raw.get(k, 0.0)) for k in keys], dtype=torch.float64, device=self._device())  # [K]
        present = torch.tensor([float(k in raw) for k in keys], dtype=torch.float64, device=self._device())  # [K]
        pgs = self.policy.ctx.pgs
        for group in (pgs.pp, pgs.dp_cp):
            torch.distributed.all_reduce(t, group=group)
        torch.distributed.all_reduce(present, group=pgs.pp)
        return {k: v for k, v, p in zip(keys, t.tolist(), present.tolist()) if p or k in ("loss", "tokens")}


def check_cp_support(cfg: RLConfig, cp: int) -> None:
    """Refuse what context parallelism cannot do exactly (see the module docstring)."""
    if cp <= 1:
        return
    from megatron_rl.trainer.packing import check_cp

    check_cp(cfg.packing.max_tokens, cp)
    loss = cfg.loss.resolved()
    if cfg.loss.name == "gspo":
        raise ConfigError("loss.name='gspo' needs each sample's whole sequence ratio, but parallel.cp > 1 splits "
                          "samples over CP ranks; use parallel.cp=1 or a token-level loss (grpo, ppo, dapo, ...)")
    if loss.is_correction != "none" and loss.is_level == "sequence":
        raise ConfigError("loss.is_level='sequence' multiplies ratios over the whole sample, but parallel.cp > 1 "
                          "splits samples over CP ranks; use loss.is_level='token' or parallel.cp=1")


def _mark(mbs: list[dict], how: str | None) -> None:
    """How the next pass treats the micro-batches' routed_experts: 'replay', 'compare' (count disagreements,
    route by itself) or None (ignore); see trainer/policy._replaying."""
    for mb in mbs:
        mb["replay_routing"] = how


def _detach(output: torch.Tensor | HeadOutput) -> torch.Tensor | HeadOutput:
    if isinstance(output, HeadOutput):
        return HeadOutput(output.hidden.detach(), output.weight.detach())
    return output.detach()


def _loss_inputs(batch: dict, lp: torch.Tensor, ent: torch.Tensor, z: float) -> LossInputs:
    """LossInputs [T] of a packed micro-batch (flattened from [1, S])."""
    flat = {k: batch[k].reshape(-1) if batch.get(k) is not None else None
            for k in ("old_logprobs", "advantages", "loss_mask", "sample_index", "behaviour_logprobs",
                      "ref_logprobs", "sample_num_tokens")}
    return LossInputs(logprobs=lp, entropy=ent, normaliser=z, **flat)
