"""The policy under training: Megatron-Core GPT chunks, DistributedDataParallel, Megatron optimizer, and one
training step through `get_forward_backward_func` (no pipelining, 1F1B, or interleaved with VPP).

Everything parallel is Megatron-Core's; what is ours is the wiring and the loss callback. Process groups
come in through the `DistContext`; nothing reads Megatron's globals here except through that collection.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch

from megatron_rl.config import ConfigError
from megatron_rl.distributed import DistContext
from megatron_rl.models.gpt import ModelConfig, build_gpt, transformer_config
from megatron_rl.models.mtp import emit_mtp
from megatron_rl.models.output_head import HeadOutput, emit_hidden, install_hidden_head


@dataclass
class OptimConfig:
    """Optimiser and schedule of the policy."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    decay_style: str = "constant"
    """LR decay after warm-up: constant, linear or cosine."""
    decay_steps: int = 0
    """Steps from the start to the end of the decay; 0 means the run's total number of steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold (0 disables)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (Megatron DistributedOptimizer)."""

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim: need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ConfigError(f"optim.decay_style {self.decay_style!r} is not one of constant, linear, cosine")


# loss_fn(output, batch) -> (sum loss to back-propagate, {name: tensor}); output is the last stage's logits
# [b, s, V/tp] (output="logits") or HeadOutput(hidden [s, b, h], weight [V/tp, h]) (output="hidden")
LossFn = Callable[[torch.Tensor | HeadOutput, dict], tuple[torch.Tensor, dict]]


FORWARD_BUFFERS = (".router.expert_bias",)
"""Buffer names (suffixes) that are weights: loaded from checkpoints, read by the forward, synced to engines."""


class Policy:
    """Model chunks + DDP + optimizer of one rank."""

    def __init__(self, model_cfg: ModelConfig, optim_cfg: OptimConfig, ctx: DistContext, total_steps: int,
                 init: Callable[[torch.nn.Module], None] | None = None, lora=None):
        """lora: a `trainer.lora.LoRAConfig`; enabled, every chunk gets adapters after `init` (the base frozen,
        only adapters in the optimizer and checkpoints; engines get merged weights)."""
        self.cfg, self.optim_cfg, self.ctx = model_cfg, optim_cfg, ctx
        self.lora = lora if lora is not None and lora.enabled else None
        model_cfg.check_training(ctx.parallel)
        if self.lora is not None:
            self.lora.validate()
            self.lora.check_model(model_cfg, ctx.parallel)
        self.tcfg = transformer_config(model_cfg, ctx.parallel)
        self.chunks = self._build_chunks(init)
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler(total_steps)
        self.step_count = 0

    @property
    def grad_scale(self) -> float:
        """Factor a loss_fn multiplies a SUM-normalised loss by: Megatron's schedule divides each micro-batch
        loss by num_microbatches and DDP averages gradients over dp; pass it num_microbatches * this."""
        return float(self.ctx.parallel.dp)

    @property
    def is_last_stage(self) -> bool:
        """This rank computes the loss (last pipeline stage)."""
        return torch.distributed.get_rank(self.ctx.pgs.pp) == self.ctx.parallel.pp - 1

    def frozen_copy(self) -> FrozenModel:
        """A frozen model of the same layout holding the current weights (the KL reference)."""
        return FrozenModel(self)

    def _build_chunks(self, init) -> list[torch.nn.Module]:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        par, pgs = self.ctx.parallel, self.ctx.pgs
        vpp = par.vpp if par.pp > 1 and par.vpp else 1
        pp_rank, pp_size = torch.distributed.get_rank(pgs.pp), par.pp
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.optim_cfg.distributed_optimizer)
        chunks = []
        for v in range(vpp):
            first = pp_rank == 0 and v == 0
            last = pp_rank == pp_size - 1 and v == vpp - 1
            model = build_gpt(self.cfg, par, pgs, pre_process=first, post_process=last,
                              vp_stage=v if vpp > 1 else None)
            if init is not None:
                init(model)
            if self.lora is not None:
                from megatron_rl.trainer.lora import apply_lora

                apply_lora(model, self.lora)
            install_hidden_head(model)
            install_routing_replay(model, self.cfg)
            chunks.append(DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model,
                                                  pg_collection=pgs))
        for chunk in chunks:
            # without it the schedule never reduces gradients over dp, nor ties embeddings across stages
            chunk.module.config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pgs)
        return chunks

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.optim_cfg
        ocfg = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            use_distributed_optimizer=o.distributed_optimizer, params_dtype=self.tcfg.params_dtype,
            bf16=self.tcfg.bf16, fp16=self.tcfg.fp16)
        # the groups we pass are gloo groups already on CPU; Megatron refuses extra gloo groups with pg_collection
        return get_megatron_optimizer(ocfg, self.chunks, use_gloo_process_groups=False, pg_collection=self.ctx.pgs)

    def _build_scheduler(self, total_steps: int):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.optim_cfg
        decay = max(o.decay_steps or total_steps, o.warmup_steps + 1)
        return OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay, lr_decay_style=o.decay_style,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay, wd_incr_style="constant")

    def train_step(self, microbatches: list[dict], loss_fn: LossFn, seq_length: int, output: str = "logits",
                   advance_schedule: bool = True) -> dict:
        """Forward+backward over `microbatches` (each {'tokens' [b, s], 'position_ids' [b, s], ...}) and one
        optimizer step; returns summed metrics from the last pipeline stage (empty on other stages).
        output: what loss_fn gets, 'logits' or 'hidden' (HeadOutput; the logits are never formed).
        advance_schedule: step the LR schedule after a successful update; False when the caller counts
        schedule steps itself (the RL trainer: once per RL step, whatever its number of PPO epochs)."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        results = self._forward_backward(microbatches, loss_fn, seq_length, False, output)
        ok, grad_norm, _ = self.optimizer.step()
        if ok and advance_schedule:
            self.advance_schedule()
        self.step_count += 1
        return _reduce_metrics(results, ok, grad_norm)

    def advance_schedule(self) -> None:
        """One step of the LR (and weight-decay) schedule."""
        self.scheduler.step(increment=1)

    def forward_backward(self, microbatches: list[dict], loss_fn: LossFn, seq_length: int,
                         output: str = "logits") -> dict:
        """Forward+backward only (gradients reduced into each parameter's main_grad, no optimizer step);
        summed metrics from the last pipeline stage. Zero the grad buffers first."""
        return _reduce_metrics(self._forward_backward(microbatches, loss_fn, seq_length, False, output), None, None)

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict], loss_fn: LossFn, seq_length: int, output: str = "logits") -> dict:
        """Forward only; summed metrics from the last pipeline stage."""
        for chunk in self.chunks:
            chunk.eval()
        try:
            results = self._forward_backward(microbatches, loss_fn, seq_length, True, output)
        finally:
            for chunk in self.chunks:
                chunk.train()
        return _reduce_metrics(results, None, None)

    def _forward_backward(self, microbatches: list[dict], loss_fn: LossFn, seq_length: int, forward_only: bool,
                          output: str = "logits"):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if output not in ("logits", "hidden"):
            raise ValueError(f"output={output!r}; use 'logits' or 'hidden'")

        vpp = len(self.chunks)
        iters = [iter(microbatches) for _ in range(vpp)] if vpp > 1 else iter(microbatches)
        fb = get_forward_backward_func(pp_size=self.ctx.parallel.pp, vp_size=vpp if vpp > 1 else None)
        step = partial(_forward_step, loss_fn, self.cfg.transformer_impl, output == "hidden", self.ctx.pgs.tp)
        return fb(forward_step_func=step, data_iterator=iters, model=self.chunks,
                  num_microbatches=len(microbatches), seq_length=seq_length,
                  micro_batch_size=microbatches[0]["tokens"].shape[0], forward_only=forward_only)

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The model's weights by name, as the rollout engine and weight pushes take them: every parameter, then
        the buffers the forward reads that are not derived from the config (FORWARD_BUFFERS: DeepSeek-V3's
        expert bias, which Megatron keeps as a buffer; without it an engine would route differently)."""
        for i, chunk in enumerate(self.chunks):
            prefix = f"chunk{i}." if len(self.chunks) > 1 else ""
            for name, t in engine_weights(chunk.module):
                yield prefix + name, t

    def global_named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """`named_parameters`' tensors under their names in the unsharded model (layers of every pipeline stage
        and virtual chunk, experts of every expert-parallel rank numbered globally; trainer/global_names.py),
        each still this rank's tensor-parallel slice: what the engine's weight sync gathers."""
        from megatron_rl.trainer.global_names import global_names

        for chunk in self.chunks:
            local = list(engine_weights(chunk.module))
            names = global_names(chunk.module, [n for n, _ in local])
            for name, t in local:
                yield names[name], t


def engine_weights(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """A chunk's weights as engines take them: with LoRA adapters, each adapted weight merged (W + scale B A,
    this rank's slice) and no adapter tensors (trainer/lora.py); else `_weights`."""
    from megatron_rl.trainer.lora import engine_weights as merged

    return merged(module, _weights(module))


def merged_state_dict(module: torch.nn.Module) -> dict:
    """`module.state_dict()` of a model without adapters: with LoRA, each adapted weight merged, no adapters."""
    from megatron_rl.trainer.lora import engine_weights as merged

    return dict(merged(module, module.state_dict().items()))


def _weights(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """A chunk's parameters, then its FORWARD_BUFFERS, by local name."""
    yield from module.named_parameters()
    for name, b in module.named_buffers():
        if name.endswith(FORWARD_BUFFERS):
            yield name, b


def install_routing_replay(model, cfg: ModelConfig) -> None:
    """Routing replay hooks on a chunk's MoE routers (models/routing_replay.py), kept as `routing_replays`."""
    from megatron_rl.models.routing_replay import attach, moe_layer_ids

    model.routing_replays = attach(model, moe_layer_ids(cfg)) if cfg.moe.num_experts else []


def _replaying(model, batch: dict, tp_group) -> list:
    """Set the chunk's routers to replay (or compare with) the micro-batch's `routed_experts` when its
    `replay_routing` says so ('replay' | 'compare'); the hooks to clear after the forward."""
    from megatron_rl.models.routing_replay import set_targets

    module = getattr(model, "module", model)
    replays, how = getattr(module, "routing_replays", []), batch.get("replay_routing")
    if not replays or not how or batch.get("routed_experts") is None:
        return []
    tp = (tp_group.rank(), tp_group.size()) if tp_group is not None else (0, 1)
    set_targets(replays, batch["routed_experts"], *tp, module.config.sequence_parallel, compare_only=how == "compare")
    return replays


def _forward_step(loss_fn: LossFn, transformer_impl: str, hidden: bool, tp_group, data_iterator, model):
    from megatron_rl.models.routing_replay import clear
    from megatron_rl.trainer.packing import attention_inputs

    batch = next(data_iterator)
    # packed micro-batches: a block-causal mask (local spec) or THD PackedSeqParams (TE); else plain causal
    mask, packed = attention_inputs(batch, transformer_impl)
    replays = _replaying(model, batch, tp_group)  # MoE routing replay of the engine's experts (or a comparison)
    # output: [b, s, V/tp] logits on the last stage ([b, s, h] final hidden states with `hidden`), hidden
    # states [s, b, h] on the other stages
    with emit_hidden(model, hidden) as head, emit_mtp(model, bool(batch.get("emit_mtp"))):
        output = model(batch["tokens"], batch["position_ids"], mask, packed_seq_params=packed)
    clear(replays)  # the backward does not route again (no activation recompute here)
    weight = head.weight_used if head is not None else None
    return output, partial(_loss_wrapper, loss_fn, batch, weight)


def _loss_wrapper(loss_fn: LossFn, batch: dict, weight: torch.Tensor | None, output: torch.Tensor):
    if weight is not None:
        output = HeadOutput(output.transpose(0, 1), weight)  # [b, s, h] -> [s, b, h] (a view)
    loss, metrics = loss_fn(output, batch)
    return loss, {k: v.detach().clone() for k, v in metrics.items()}


def _reduce_metrics(results: list[dict], ok: bool | None, grad_norm) -> dict:
    out: dict = {} if ok is None else {"update_ok": bool(ok),
                                       "grad_norm": float(grad_norm) if grad_norm is not None else None}
    for rec in results or []:
        for k, v in rec.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


class FrozenModel:
    """Forward-only copy of a policy's chunks (same layout, no DDP, no optimizer): the KL reference model."""

    def __init__(self, policy: Policy, model_cfg: ModelConfig | None = None,
                 init: Callable[[torch.nn.Module], None] | None = None):
        """The policy's current weights; or, given `model_cfg` and `init`, another checkpoint's model (the
        distillation teacher: its own architecture, the policy's parallel layout and pipeline stages)."""
        par, pgs = policy.ctx.parallel, policy.ctx.pgs
        self.cfg, self.ctx = model_cfg or policy.cfg, policy.ctx
        self.chunks = []
        for v, src in enumerate(policy.chunks):
            m = build_gpt(self.cfg, par, pgs, pre_process=src.module.pre_process,
                          post_process=src.module.post_process, vp_stage=v if len(policy.chunks) > 1 else None)
            if init is None:
                m.load_state_dict(merged_state_dict(src.module))  # with LoRA: the adapted weights merged
            else:
                init(m)
            install_hidden_head(m)
            install_routing_replay(m, self.cfg)
            m.requires_grad_(False)
            m.eval()
            self.chunks.append(m)

    def forward_backward(self, microbatches: list[dict], loss_fn: LossFn, seq_length: int,
                         output: str = "logits") -> dict:
        """Forward+backward only (gradients reduced into each parameter's main_grad, no optimizer step);
        summed metrics from the last pipeline stage. Zero the grad buffers first."""
        return _reduce_metrics(Policy._forward_backward(self, microbatches, loss_fn, seq_length, False, output),
                               None, None)

    @torch.no_grad()
    def evaluate(self, microbatches: list[dict], loss_fn: LossFn, seq_length: int, output: str = "logits") -> dict:
        """Forward only through the pipeline; summed metrics from the last pipeline stage."""
        return _reduce_metrics(Policy._forward_backward(self, microbatches, loss_fn, seq_length, True, output),
                               None, None)
