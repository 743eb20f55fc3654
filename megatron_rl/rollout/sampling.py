"""Sampling parameters and the batched sampler.

The log-prob returned with each sampled token is taken under the distribution actually sampled from:
softmax of the temperature-scaled logits restricted to the top-k / top-p set (renormalised). With
temperature 0 (greedy) that distribution is a point mass, so the log-prob of the plain softmax
(temperature 1, no filtering) is returned instead.

Each sample owns a `torch.Generator` seeded from (request seed + sample index); a token is drawn by
inverse CDF from one uniform number of that generator, so a sample's tokens do not depend on which
other sequences share its batch, and every tensor-parallel rank draws the same token. A batch of only
greedy rows draws nothing (argmax + log-softmax only); greedy samples never use their generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron_rl.config import ConfigError


@dataclass
class SamplingParams:
    """How to sample one request's continuations."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with probability >= top_p (1 disables)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 disables)."""
    max_new_tokens: int = 16
    """Generated tokens at most (finish reason 'length')."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample (finish reason 'stop'); the stop token is kept in the output."""
    stop: list[list[int]] = field(default_factory=list)
    """Token-id sequences that end a sample when generated (kept in the output)."""
    seed: int | None = None
    """Seed of sample 0; sample i uses seed + i. None draws a seed from the engine's generator."""
    n: int = 1
    """Samples per prompt (they share the prompt's KV blocks)."""

    def validate(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ConfigError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise ConfigError("stop sequences must be non-empty lists of token ids")


def filtered_logprobs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Log-probs [B, V] of the sampling distributions for fp32 logits [B, V] and per-row params [B].

    Rows with temperature 0 get the plain log-softmax (see the module docstring).
    """
    greedy = temperature == 0  # [B]
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]  # [B, V]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        scaled = torch.where(greedy[:, None], scaled, _mask_top_k_top_p(scaled, top_k, top_p))
    return torch.log_softmax(scaled, dim=-1)  # [B, V]


def _mask_top_k_top_p(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k and top-p set to -inf; scaled [B, V] -> [B, V]."""
    sorted_z, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, scaled.shape[-1])[:, None]  # [B, 1]
    drop = rank >= k  # [B, V]
    probs = torch.softmax(sorted_z.masked_fill(drop, float("-inf")), dim=-1)  # [B, V]
    before = probs.cumsum(-1) - probs  # [B, V] mass of strictly more likely tokens
    drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)  # the first token always stays (before = 0)
    sorted_z = sorted_z.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_z)


def sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator]
           ) -> tuple[Tensor, Tensor]:
    """Tokens [B] and their log-probs [B] for fp32 logits [B, V], one params/generator per row."""
    dev = logits.device  # the engine's (the rank's GPU under NCCL); the per-sample generators stay on the CPU
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)  # [B]
    top_k = torch.tensor([p.top_k for p in params], device=dev)  # [B]
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)  # [B]
    if all(p.temperature == 0 for p in params):  # all greedy: no draw, the plain log-softmax (see above)
        tokens = logits.argmax(-1)  # [B]
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    logp = filtered_logprobs(logits, temperature, top_k, top_p)  # [B, V]
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]).to(dev)  # [B]
    cdf = logp.double().exp().cumsum(-1)  # [B, V]
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)  # [B]
    drawn = drawn.clamp(max=logits.shape[-1] - 1)
    greedy = temperature == 0  # [B]
    tokens = torch.where(greedy, logits.argmax(-1), drawn) if bool(greedy.any()) else drawn  # [B]
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
