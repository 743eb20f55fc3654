"""Memory-safe, vocab-parallel per-token log-prob and entropy from hidden states and the output layer.

    logprob, entropy = fused_logprob_entropy(hidden [T, H], weight [V/TP, H], targets [T], tp_group=...)

equals `log_softmax(hidden @ W_full.T / temperature)` gathered at `targets`, and its entropy, with gradients
to `hidden` and `weight`, but never materialises the `[T, V]` logits (chunks over tokens and vocab with an
online log-sum-exp; the backward recomputes logits chunk by chunk, or, within `keep_logits_bytes`, reuses the
forward's). Under tensor parallelism each rank holds
rows [rank * V/TP, (rank + 1) * V/TP) of the output layer (Megatron's vocab-parallel layout); max, sum-exp,
target logit and entropy terms are all-reduced over `tp_group`, and so is the gradient of `hidden` (do not
also wrap `hidden` in copy_to_tensor_model_parallel_region). The weight gradient stays local.

Backends: `reference` (PyTorch, exact, any device) and `triton_kernels` (GPU). `impl="auto"` picks Triton for
CUDA tensors (not fp64) when triton imports, else PyTorch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatron_rl.kernels.logprob.common import LogprobEntropyFunction, VocabSlice
from megatron_rl.kernels.logprob.reference import TorchBackend

Impl = Literal["auto", "torch", "triton"]
__all__ = ["LogprobKernelConfig", "fused_logprob_entropy", "triton_available"]


@functools.cache
def triton_available() -> bool:
    """True when the Triton backend imports (triton installed and working)."""
    try:
        import megatron_rl.kernels.logprob.triton_kernels  # noqa: F401
    except ImportError:
        return False
    return True


def _backend(impl: str, hidden: torch.Tensor):
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"fused_logprob_entropy: impl={impl!r}; use 'auto', 'torch' or 'triton'")
    gpu_ok = hidden.is_cuda and hidden.dtype != torch.float64 and triton_available()
    if impl == "torch" or (impl == "auto" and not gpu_ok):
        return TorchBackend
    if not triton_available():
        raise RuntimeError("fused_logprob_entropy: impl='triton' but triton does not import; "
                           "pip install triton, or use impl='torch'")
    from megatron_rl.kernels.logprob.triton_kernels import TritonBackend
    return TritonBackend


def _vocab_slice(weight: torch.Tensor, tp_group, vocab_size: int | None) -> tuple[VocabSlice, int]:
    """(This rank's rows of the (padded) global vocab and how many are real entries, the real vocab size)."""
    v_local = weight.shape[0]
    rank, tp = (dist.get_rank(tp_group), dist.get_world_size(tp_group)) if tp_group is not None else (0, 1)
    v_global = v_local * tp
    vocab_size = v_global if vocab_size is None else vocab_size
    if not 0 < vocab_size <= v_global:
        raise ValueError(f"fused_logprob_entropy: vocab_size={vocab_size} must be in [1, {v_global}] "
                         f"(weight rows {v_local} x tensor-parallel size {tp})")
    start = rank * v_local
    return VocabSlice(start, max(0, min(v_local, vocab_size - start))), vocab_size


def _check_inputs(hidden, weight, targets, temperature, chunk_tokens, chunk_vocab) -> None:
    name = "fused_logprob_entropy"
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: need hidden [T, H] and weight [V_local, H]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)} (flatten [S, B, H] hidden states with .reshape(-1, H))")
    if targets.shape != hidden.shape[:1] or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: targets must be int32/int64 [T={hidden.shape[0]}]; got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"{name}: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a float dtype")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(f"{name}: hidden, weight, targets on different devices "
                         f"({hidden.device}, {weight.device}, {targets.device})")
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0; got {temperature}")
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError(f"{name}: chunk_tokens ({chunk_tokens}) and chunk_vocab ({chunk_vocab}) must be >= 1")


def _check_targets(targets: torch.Tensor, vocab_size: int) -> None:
    """Out-of-range ids would silently give logprob = -lse; costs one device sync."""
    if targets.numel() and bool(((targets < 0) | (targets >= vocab_size)).any()):
        bad = targets[(targets < 0) | (targets >= vocab_size)][:5].tolist()
        raise ValueError(f"fused_logprob_entropy: target ids {bad} outside [0, {vocab_size}); replace padding / "
                         "ignore-index entries by any valid id and zero them in the loss mask")


def fused_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp_group=None,
                          temperature: float = 1.0, chunk_tokens: int = 512, chunk_vocab: int = 4096,
                          impl: Impl = "auto", vocab_size: int | None = None, check_targets: bool = True,
                          keep_logits_bytes: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (logprob [T], entropy [T]) of `targets` under softmax(hidden @ W.T / temperature).

    Outputs are fp32 (fp64 for fp64 inputs). hidden [T, H]; weight [V_local, H], this rank's vocab-parallel
    slice (the full W when tp_group is None); targets [T] global token ids. `vocab_size`: the real vocab
    when the weight is padded (rows past it are excluded from the softmax, their gradient is 0); default:
    all rows. Differentiable w.r.t. hidden and weight; upstream grads of both outputs are used (e.g. a loss
    weighting tokens by a mask).
    `chunk_tokens` x `chunk_vocab` bounds the PyTorch backend's working set; Triton uses `chunk_vocab` as
    the vocab range per forward program. `keep_logits_bytes`: the PyTorch backend keeps the forward's logits
    chunks for the backward (one logits matmul less) when all of them take at most this many bytes; 0: it
    recomputes them (the [T, V] logits never exist).
    """
    _check_inputs(hidden, weight, targets, temperature, chunk_tokens, chunk_vocab)
    vocab, vocab_size = _vocab_slice(weight, tp_group, vocab_size)
    if check_targets:
        _check_targets(targets, vocab_size)
    backend = _backend(impl, hidden)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        keep_logits_bytes = 0  # no backward will come (log-prob passes): copying the logits would be wasted
    return LogprobEntropyFunction.apply(hidden, weight, targets, backend, tp_group, float(temperature), vocab,
                                        chunk_tokens, chunk_vocab, keep_logits_bytes)


@dataclass
class LogprobKernelConfig:
    """How the trainer computes per-token log-probs and entropy from the output layer."""

    impl: str = "auto"
    """Backend: 'auto' (Triton on CUDA when available, else PyTorch), 'torch' or 'triton'."""
    chunk_tokens: int = 512
    """Tokens per chunk in the PyTorch backend (working set ~ chunk_tokens x chunk_vocab x 4 bytes x 3)."""
    chunk_vocab: int = 4096
    """Vocab entries per chunk (PyTorch) / per forward program (Triton)."""
    check_targets: bool = True
    """Raise on target ids outside the vocab (one device sync per call)."""
    keep_logits_bytes: int = 256 << 20
    """PyTorch backend: keep the forward's fp32 logits for the backward instead of recomputing them (one
    [T, H] x [H, V] matmul less per micro-batch) when they take at most this many bytes; 0: always recompute."""

    def validate(self) -> None:
        from megatron_rl.config import ConfigError

        if self.impl not in ("auto", "torch", "triton"):
            raise ConfigError(f"logprob.impl={self.impl!r}; use 'auto', 'torch' or 'triton'")
        if self.keep_logits_bytes < 0:
            raise ConfigError(f"logprob.keep_logits_bytes must be >= 0 (0: recompute), got {self.keep_logits_bytes}")
        if self.chunk_tokens < 1 or self.chunk_vocab < 1:
            raise ConfigError(f"logprob.chunk_tokens/chunk_vocab must be >= 1; got "
                              f"{self.chunk_tokens}/{self.chunk_vocab}")

    def build(self):
        """A `fused_logprob_entropy` with this config's knobs bound."""
        self.validate()
        return functools.partial(fused_logprob_entropy, impl=self.impl, chunk_tokens=self.chunk_tokens,
                                 chunk_vocab=self.chunk_vocab, check_targets=self.check_targets,
                                 keep_logits_bytes=self.keep_logits_bytes)
