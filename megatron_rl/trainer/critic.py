"""The PPO critic: a value model on Megatron-Core, the policy's architecture with a scalar head.

    critic = ValueModel(policy, CriticConfig(optim=OptimConfig(lr=1e-5)), total_steps)
    critic.store_values(mbs, seq_len)             # forward only: mb['old_values'] [1, S] (last stage)
    metrics = critic.update(mbs, tokens, seq_len)  # one optimizer step on the clipped value loss

The value model is a `Policy` of its own (Megatron GPT chunks built by `models.gpt.build_gpt` with the
policy's ModelConfig and layout, DDP, a Megatron optimizer and LR schedule of its own: `CriticConfig.optim`),
initialised from the policy's weights at construction (the RL phase's starting point), plus `value_head`, a
Linear(h, 1) on the last pipeline stage's final hidden states (`output_head`'s hidden mode: the vocabulary
projection is never computed; an untied output layer is frozen, it is not used). V(s_t) sits at the slot of
the label it predicts: the hidden state at position j (which has seen tokens <= j) values the state in which
label j = token j + 1 is generated, aligned with the policy's log-probs, advantages and returns.

Tensor parallelism: the hidden states are replicated over TP (SP-gathered), so every TP rank computes the same
values and the same (replicated) head gradient; the head weight is a TP-duplicate parameter, counted once in
the gradient norm, as Megatron does for norms. Checkpoints: `trainer/checkpoint.py` saves the value model and
its optimizer under `critic.` beside the policy's and restores them exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rl.config import ConfigError
from megatron_rl.rl.value import value_loss
from megatron_rl.trainer.policy import OptimConfig, Policy


@dataclass
class CriticConfig:
    """The value model of PPO with GAE (its own optimizer; the architecture is the policy's)."""

    enabled: bool | None = None
    """Build a critic; None = exactly when the advantage estimator needs values (advantage.name 'gae')."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5, clip_grad=1.0))
    """Optimizer and LR schedule of the value model (separate from the policy's)."""
    value_clip: float | None = 0.2
    """PPO value clipping: the new value may move at most this far from the old one per update; null/0 = off."""

    def active(self, advantage_name: str) -> bool:
        """Whether a critic is built for this advantage estimator."""
        return advantage_name == "gae" if self.enabled is None else bool(self.enabled)

    def validate(self) -> None:
        self.optim.validate()
        if self.value_clip is not None and not self.value_clip >= 0:
            raise ConfigError(f"critic.value_clip must be >= 0 (or null to turn clipping off), got {self.value_clip}")


class ValueModel:
    """The critic of one rank: a `Policy` (chunks, DDP, optimizer, schedule) whose last chunk has a value head."""

    def __init__(self, policy: Policy, cfg: CriticConfig, total_steps: int):
        self.cfg, self.ctx = cfg, policy.ctx
        sources = iter([c.module.state_dict() for c in policy.chunks])

        def init(model: torch.nn.Module) -> None:
            model.load_state_dict(next(sources))
            if model.post_process:
                _attach_value_head(model, policy.tcfg.init_method_std, policy.cfg.tie_embeddings)

        self.model = Policy(policy.cfg, cfg.optim, policy.ctx, total_steps, init=init)

    @property
    def head(self) -> torch.nn.Linear | None:
        """The value head (last pipeline stage only)."""
        return getattr(self.model.chunks[-1].module, "value_head", None)

    def _values(self, output, batch: dict) -> torch.Tensor:
        """V [1, S] (float32) of a micro-batch from the last stage's HeadOutput (hidden [S, 1, h])."""
        v = self.head(output.hidden).float().squeeze(-1)  # [S, 1]
        return v.transpose(0, 1).reshape(batch["labels"].shape)  # [1, S]

    def store_values(self, mbs: list[dict], seq_length: int) -> None:
        """Forward only; the last stage stores mb['old_values'] [1, S] (the predictions GAE uses)."""
        def store(output, batch: dict):
            batch["old_values"] = self._values(output, batch).detach()
            return output.hidden.new_zeros(()), {}
        self.model.evaluate(mbs, store, seq_length, output="hidden")

    def update(self, mbs: list[dict], tokens: float, seq_length: int) -> dict:
        """One optimizer step on the clipped value loss of mbs (each with old_values and returns [1, S]);
        `tokens`: the loss tokens of the whole global batch. Sums of the metrics over the last stage's
        micro-batches of this rank (reduce them over pp and dp x cp)."""
        scale = len(mbs) * self.model.grad_scale

        def loss_fn(output, batch: dict):
            v = self._values(output, batch).reshape(-1)  # [S]
            out = value_loss(v, batch["old_values"].reshape(-1), batch["returns"].reshape(-1),
                             batch["loss_mask"].reshape(-1), self.cfg.value_clip, tokens)
            return out.loss * scale, out.metrics

        raw = self.model.train_step(mbs, loss_fn, seq_length, output="hidden")
        return {k: raw.get(k, 0.0) for k in ("value_loss_sum", "value_clip_sum", "tokens")} | {
            "value_grad_norm": raw.get("grad_norm"), "value_update_ok": raw.get("update_ok")}


def _attach_value_head(model: torch.nn.Module, std: float, tied: bool) -> None:
    """Give the last-stage GPTModel `value_head` (Linear(h, 1), N(0, std) weight, zero bias) before DDP wraps it;
    freeze an untied output layer (the critic never forms logits)."""
    ref = next(model.parameters())
    head = torch.nn.Linear(model.config.hidden_size, 1, bias=True, device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(0x5EED)
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
        head.bias.zero_()
    model.value_head = head
    if not tied and getattr(model, "output_layer", None) is not None:
        model.output_layer.weight.requires_grad_(False)
