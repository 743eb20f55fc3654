"""Let the last pipeline stage hand the loss the final hidden states and the output weight instead of logits.

    install_hidden_head(model)                # once, after build_gpt (no-op without an output layer)
    with emit_hidden(model) as head:          # for one forward call
        out = model(tokens, position_ids, mask)   # [b, s, h]: hidden states after the final norm
    HeadOutput(out.transpose(0, 1), head.weight)  # hidden [s, b, h], weight [V/tp, h]

GPTModel calls `self.output_layer(hidden [s(/tp), b, h], weight=...)` on the last stage, passing the shared
embedding weight when embeddings are tied (`shared_embedding_or_output_weight()`), and returns
`logits.transpose(0, 1)`. `install_hidden_head` turns the model's `ColumnParallelLinear` output layer into
a subclass of it (same object, same parameters, names and state dict: checkpoints, conversion and the rollout
engine see no difference) whose forward, while the `emit_hidden` flag is set, returns its input instead of
the logits and records the weight it was given. The logits are never formed.

Tensor parallelism: without sequence parallelism the hidden states are replicated over TP; the fused kernel
all-reduces their gradient over TP itself (the job `copy_to_tensor_model_parallel_region` does inside the
output layer), so nothing is added here. With sequence parallelism the output layer receives [s/tp, b, h];
it is all-gathered along the sequence with a backward that only keeps this rank's part of the (already
TP-summed) gradient, i.e. all-reduce + split = the reduce-scatter of the logits path.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch


class HeadOutput(NamedTuple):
    """What the loss gets from the last stage in 'hidden' mode instead of logits."""

    hidden: torch.Tensor
    """Final hidden states after the final norm, [s, b, h] (the whole sequence, also under SP)."""
    weight: torch.Tensor
    """The output layer's weight as Megatron used it, [V/tp, h] (the embedding weight when tied)."""


def _hidden_head_class():
    from megatron.core.tensor_parallel import ColumnParallelLinear, gather_from_sequence_parallel_region

    class HiddenStatesHead(ColumnParallelLinear):
        """A ColumnParallelLinear output layer that can return its (SP-gathered) input instead of logits."""

        emit_hidden = False
        weight_used = None

        def forward(self, input_, weight=None, runtime_gather_output=None):
            if not self.emit_hidden:
                return super().forward(input_, weight, runtime_gather_output)
            weight = self.weight if weight is None else weight
            if weight is None:
                raise RuntimeError("output layer has no weight and none was passed (tied embeddings?)")
            if self.sequence_parallel:
                # [s/tp, b, h] -> [s, b, h]; backward: keep this rank's part of the TP-reduced gradient
                input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False,
                                                              group=self.tp_group)
            object.__setattr__(self, "weight_used", weight)  # a plain reference, not a new registered parameter
            return input_, None

    return HiddenStatesHead


_HEAD_CLASS = None


def install_hidden_head(model: torch.nn.Module) -> None:
    """Give `model`'s (a GPTModel, possibly DDP-wrapped) output layer the hidden-state mode; idempotent."""
    global _HEAD_CLASS
    from megatron.core.tensor_parallel import ColumnParallelLinear

    layer = getattr(getattr(model, "module", model), "output_layer", None)
    if layer is None:
        return
    if _HEAD_CLASS is None:
        _HEAD_CLASS = _hidden_head_class()
    if isinstance(layer, _HEAD_CLASS):
        return
    if type(layer) is not ColumnParallelLinear:
        raise TypeError(f"output layer is a {type(layer).__name__}, not Megatron's ColumnParallelLinear; "
                        "use rl.logprob_impl='logits'")
    layer.__class__ = _HEAD_CLASS


@contextmanager
def emit_hidden(model: torch.nn.Module, enabled: bool = True):
    """While active, `model`'s output layer returns hidden states; yields the layer (its `weight_used` is set
    by the forward), or None when the model has no output layer or `enabled` is False."""
    layer = getattr(getattr(model, "module", model), "output_layer", None)
    if not enabled or layer is None:
        yield None
        return
    if getattr(layer, "emit_hidden", None) is not False:
        raise RuntimeError("emit_hidden: the output layer has no hidden-state mode; call install_hidden_head")
    layer.emit_hidden = True
    object.__setattr__(layer, "weight_used", None)
    try:
        yield layer
    finally:
        layer.emit_hidden = False
