"""Multi-token prediction (DeepSeek-V3's MTP layers) through Megatron-Core's `MultiTokenPredictionBlock`.

`model.mtp_num_layers` = D > 0 builds Megatron's MTP block (`get_gpt_mtp_block_spec`: enorm, hnorm, eh_proj, one
transformer layer like the model's last, final norm; the embedding and the output layer shared with the model)
on the last pipeline stage. MTP depth k at position t predicts token t + 1 + k from the main model's hidden
state at t and the embedding of token t + k.

The forward returns the main head's output only (logits, or the hidden states of models/output_head), exactly
as without MTP (the converter's verify, the rollout engine and the log-prob passes never run the MTP layers),
unless `emit_mtp(model)` is active: then it returns the main head's output followed by each depth's, stacked
along the sequence ([b, (1 + D) s, V/tp or h]); `split(output, s, D)` takes them apart. In that pass the MTP
layers read the trunk's hidden states and the shared embedding and output weight *detached*: the MTP loss
trains the MTP layers only, and the policy's gradient is the RL loss's alone (trainer/mtp_loss.py).

Megatron's own MTP loss (`GPTModel._postprocess` with labels) returns a language-model loss instead of logits
and adds the MTP loss through a global auto-scaler; the RL trainer needs the log-probs of its own loss and a
metric, so `_postprocess` is replaced: the MTP block runs, its outputs go through the same output layer, and
Megatron's postprocess makes the main head's output with its MTP branch switched off for that call.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import cache

import torch


def mtp_block_spec(tcfg, layer_spec, use_te: bool, vp_stage: int | None = None):
    """Megatron's MTP block spec for `layer_spec` (a layer spec, or a block spec: its last layer's) or None; the
    caller builds the model's last stage (post_process). Megatron's `get_gpt_mtp_block_spec` asks the global
    parallel state whether this rank is the last pipeline stage, which is wrong for a model in a layout of its own
    (the rollout engine, one stage, on a rank of the trainer's first stage); the block is made here instead, with
    every MTP layer (all on the last stage, as Megatron places them without a custom pipeline layout)."""
    if not tcfg.mtp_num_layers:
        return None
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mtp_layer_spec_for_backend
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlockSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if use_te:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider as Provider
    else:
        Provider = LocalSpecProvider
    last = layer_spec if isinstance(layer_spec, ModuleSpec) and layer_spec.module == TransformerLayer \
        else layer_spec.layer_specs[-1]
    layer = get_mtp_layer_spec_for_backend(transformer_layer_spec=last, backend=Provider())
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * tcfg.mtp_num_layers)


@cache
def mtp_model_class():
    """GPTModel whose forward returns the main head's output, and the MTP depths' too under `emit_mtp`."""
    from megatron.core.models.gpt import GPTModel

    class MTPGPTModel(GPTModel):
        emit_mtp = False

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            if self.share_embeddings_and_output_weights and self.mtp_process and not self.pre_process:
                # pp > 1: the last stage's embedding copy (for the MTP layers) is the tied weight Megatron syncs
                # with the first stage's and the head uses (`shared_embedding_or_output_weight`); the output
                # layer's own weight would be an unused, never-synced copy (exported, sent to the engine)
                self.output_layer.register_parameter("weight", None)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            # Megatron ties the last stage's embedding copy with metadata['dp_cp_group'], which it never fills in
            # when called without metadata (a TypeError at pp > 1): the model's own group
            metadata = dict(metadata or {})
            if "dp_cp_group" not in metadata:
                from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

                dp_cp = getattr(getattr(self, "pg_collection", None), "dp_cp", None)
                metadata = {**metadata, "dp_cp_group": dp_cp} if dp_cp is not None else \
                    ensure_metadata_has_dp_cp_group(metadata)
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)

        def _postprocess(self, hidden_states, mtp_in_postprocess=None, **kw):  # GPTModel passes keywords
            if not (mtp_in_postprocess and self.emit_mtp and self.post_process):
                return self._main_head(hidden_states, kw)
            emb = self.embedding

            def embedding(**e):  # the MTP layers' token embeddings, detached from the shared table
                return emb(**e).detach()

            names = ("input_ids", "position_ids", "attention_mask", "inference_params", "rotary_pos_emb",
                     "rotary_pos_cos", "rotary_pos_sin", "packed_seq_params", "sequence_len_offset")
            stacked = self.mtp(hidden_states=hidden_states.detach(), embedding=embedding,
                               **{n: kw.get(n) for n in names}, **(kw.get("extra_block_kwargs") or {}))
            depths = torch.chunk(stacked, 1 + self.config.mtp_num_layers, dim=0)[1:]  # D x [s, b, h] ([s/tp] SP)
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
                else self.output_layer.weight
            gather = kw.get("runtime_gather_output")
            outs = [self.output_layer(d, weight=weight.detach(), runtime_gather_output=gather)[0].transpose(0, 1)
                    for d in depths]  # D x [b, s, V/tp or h]
            main = self._main_head(hidden_states, kw)  # last: the hidden-state head records its weight
            return torch.cat([main, *outs], dim=1)  # [b, (1 + D) s, V/tp or h]

        def _main_head(self, hidden_states, kw):
            """Megatron's postprocess of the main head, its MTP branch off (it needs labels and returns a loss)."""
            depth, self.config.mtp_num_layers = self.config.mtp_num_layers, None
            try:
                return GPTModel._postprocess(self, hidden_states, mtp_in_postprocess=False, **kw)
            finally:
                self.config.mtp_num_layers = depth

    return MTPGPTModel


@contextmanager
def emit_mtp(model, enabled: bool = True):
    """While active, `model` (a GPTModel chunk with MTP layers, possibly DDP-wrapped) also returns the MTP depths'
    outputs; a no-op for a model without MTP layers or when `enabled` is False."""
    module = getattr(model, "module", model)
    if not enabled or getattr(module, "mtp_process", False) is False or not hasattr(module, "emit_mtp"):
        yield False
        return
    module.emit_mtp = True
    try:
        yield True
    finally:
        module.emit_mtp = False


def split(output, seq_len: int, depths: int) -> tuple:
    """(main output, [depth k's output]) of an `emit_mtp` forward: logits [1, (1 + D) S, V/tp] or a HeadOutput
    (hidden [(1 + D) S, 1, h], weight): the pieces have the main head's layout, S each."""
    from megatron_rl.models.output_head import HeadOutput

    if isinstance(output, HeadOutput):
        parts = torch.split(output.hidden, seq_len, dim=0)  # each [S, 1, h]
        return HeadOutput(parts[0], output.weight), [HeadOutput(p, output.weight.detach()) for p in parts[1:]]
    parts = torch.split(output, seq_len, dim=1)  # each [1, S, V/tp]
    assert len(parts) == 1 + depths, f"expected {1 + depths} outputs of length {seq_len}, got {len(parts)}"
    return parts[0], list(parts[1:])


def targets(labels: torch.Tensor, loss_mask: torch.Tensor, sample_index: torch.Tensor, k: int):
    """(target ids, mask) [1, S] of MTP depth k (1-based) in a packed micro-batch: position t predicts labels[t + k],
    counted where that is a model token (loss_mask) of the same sample (packed neighbours and padding excluded)."""
    s = labels.shape[-1]
    tgt = torch.zeros_like(labels)  # [1, S]
    mask = torch.zeros_like(loss_mask, dtype=torch.float32)  # [1, S]
    if k < s:
        same = (sample_index[..., :s - k] == sample_index[..., k:]) & (sample_index[..., :s - k] >= 0)  # [1, S-k]
        tgt[..., :s - k] = labels[..., k:]
        mask[..., :s - k] = loss_mask[..., k:].float() * same
    return tgt, mask
