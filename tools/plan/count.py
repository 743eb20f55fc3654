"""Parameter counts per layer kind, split the way Megatron-Core shards them, and model FLOPs per token.

Layer kinds: "dense" (attention + dense MLP), "moe" (attention + router + routed experts + shared expert)
and "mtp" (a multi-token-prediction module: norms + 2h->h projection + one layer like the model's last).
Attention is GQA/MHA (q: h*a*d, k,v: h*g*d each, o: a*d*h) or MLA (q_a: h*q_lora, q_b: q_lora*a*(nope+rope),
kv_a: h*(kv_lora+rope), kv_b: kv_lora*a*(nope+v), o: a*v*h; the down-projections are replicated over TP).
MLP: (3 if SwiGLU else 2) * h * ffn. Norms: h (RMSNorm) or 2h (LayerNorm) each.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from megatron_rl.models.gpt import ModelConfig
from megatron_rl.tools.plan.spec import ArchSpec


@dataclass(frozen=True)
class LayerParams:
    """One layer's parameters by sharding: tp_split / tp + replicated + experts / (ep * etp) per rank."""

    tp_split: int
    """Matrices split over tensor parallel (attention, dense MLP, shared expert)."""
    replicated: int
    """Full copy on every TP rank (norms, router, MLA down-projections)."""
    experts: int
    """All routed experts of the layer."""
    active: int
    """Matmul parameters one token goes through (top-k of the routed experts)."""
    selective_recompute: int
    """Matmul parameters re-run in backward by selective recompute (MLA up-projections)."""

    @property
    def total(self) -> int:
        return self.tp_split + self.replicated + self.experts


@dataclass(frozen=True)
class Arch:
    """The resolved architecture: ModelConfig + ArchSpec, with parameter counts per layer kind."""

    model: ModelConfig
    spec: ArchSpec

    # ------------------------------------------------------------------------------------ shapes
    @property
    def h(self) -> int:
        return self.model.hidden_size

    @property
    def heads(self) -> int:
        return self.model.num_attention_heads

    @property
    def groups(self) -> int:
        return self.model.num_query_groups or self.heads

    @property
    def head_dim(self) -> int:
        return self.model.head_dim or self.spec.kv_channels or self.h // self.heads

    @property
    def ffn(self) -> int:
        return self.model.ffn_hidden_size or 4 * self.h

    @property
    def mlp_mult(self) -> int:
        return 3 if self.model.activation == "swiglu" else 2

    @property
    def norm(self) -> int:
        return self.h if self.model.normalization == "RMSNorm" else 2 * self.h

    @property
    def num_experts(self) -> int:
        return self.model.moe.num_experts

    @property
    def moe_ffn(self) -> int:
        return self.model.moe.ffn_hidden_size or self.ffn

    @property
    def qk_dim(self) -> int:
        """Per-head query/key width (the attention FLOPs' QK^T inner dimension)."""
        mla = self.spec.mla
        return mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.spec.mla.v_head_dim if self.spec.mla else self.head_dim

    def layer_kinds(self) -> tuple[str, ...]:
        """Kinds of the decoder layers followed by the MTP modules (the pipeline's slots)."""
        k = self.spec.first_k_dense_layers if self.num_experts else self.model.num_layers
        kinds = ["dense"] * min(k, self.model.num_layers) + ["moe"] * max(0, self.model.num_layers - k)
        return tuple(kinds + ["mtp"] * self.spec.mtp_layers)

    # --------------------------------------------------------------------------- per-layer params
    def _attention(self) -> tuple[int, int, int, int]:
        """(tp_split, replicated, matmul, selective_recompute) parameters of one attention block + its norm."""
        h, a, mla = self.h, self.heads, self.spec.mla
        if mla is None:
            d, g = self.head_dim, self.groups
            split = h * a * d + 2 * h * g * d + a * d * h + (a * d + 2 * g * d if self.model.qkv_bias else 0)
            return split, self.norm + (2 * d if self.model.qk_layernorm else 0), split, 0
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        kv_a = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
        kv_b = mla.kv_lora_rank * a * (mla.qk_nope_head_dim + mla.v_head_dim)
        o = a * mla.v_head_dim * h
        repl = self.norm + kv_a + mla.kv_lora_rank
        if mla.q_lora_rank is None:
            return h * a * qk + kv_b + o, repl, h * a * qk + kv_b + o + kv_a, kv_b
        q_a, q_b = h * mla.q_lora_rank, mla.q_lora_rank * a * qk
        return q_b + kv_b + o, repl + q_a + mla.q_lora_rank, q_a + q_b + kv_a + kv_b + o, q_b + kv_b

    @cached_property
    def layers(self) -> dict[str, LayerParams]:
        a_split, a_repl, a_mat, a_rec = self._attention()
        dense_mlp = self.mlp_mult * self.h * self.ffn
        out = {"dense": LayerParams(a_split + dense_mlp, a_repl + self.norm, 0, a_mat + dense_mlp, a_rec)}
        if self.num_experts:
            moe = self.model.moe
            expert = self.mlp_mult * self.h * self.moe_ffn
            shared = self.mlp_mult * self.h * (moe.shared_expert_ffn_hidden_size or 0)
            router = self.num_experts * self.h + (self.num_experts if self.spec.router_bias else 0)
            out["moe"] = LayerParams(a_split + shared, a_repl + self.norm + router, self.num_experts * expert,
                                     a_mat + shared + self.num_experts * self.h + moe.topk * expert, a_rec)
        inner = out["moe" if self.num_experts else "dense"]
        eh_proj = 2 * self.h * self.h
        out["mtp"] = LayerParams(inner.tp_split + eh_proj, inner.replicated + 3 * self.h, inner.experts,
                                 inner.active + eh_proj + self.embedding, inner.selective_recompute)
        return out

    @property
    def embedding(self) -> int:
        return self.model.vocab_size * self.h

    # ------------------------------------------------------------------------------------ totals
    @cached_property
    def total_params(self) -> int:
        """Main model (no MTP): embeddings, output layer (unless tied), decoder layers, final norm."""
        body = sum(self.layers[k].total for k in self.layer_kinds() if k != "mtp")
        head = 0 if self.model.tie_embeddings else self.embedding
        return self.embedding + head + body + self.norm

    @cached_property
    def mtp_params(self) -> int:
        """MTP modules (they share the main model's embedding and output layer)."""
        return self.spec.mtp_layers * self.layers["mtp"].total

    @cached_property
    def active_params(self) -> int:
        """Matmul parameters per token in the main model: layers (top-k experts) + output layer.

        The input embedding is a lookup, not a matmul, so it is not counted (as in 6*N*T FLOP counts);
        `active_params + embedding` is the "touched per token" figure some model cards quote.
        """
        body = sum(self.layers[k].active for k in self.layer_kinds() if k != "mtp")
        return body + self.embedding

    def attention_flops_per_token(self, seq_length: int) -> float:
        """Training (fwd + bwd) causal-attention FLOPs per token: 3 * s * a * (d_qk + d_v) per layer.

        Forward QK^T and AV cost 2 * s * a * (d_qk + d_v) per token against all s keys; causal masking
        halves it; backward doubles the forward (x3 in all).
        """
        n = sum(1 for _ in self.layer_kinds())
        return 3.0 * seq_length * self.heads * (self.qk_dim + self.v_dim) * n

    def train_matmul_params(self) -> int:
        """Matmul parameters per token in training: main model + MTP modules (their own output pass)."""
        return self.active_params + self.spec.mtp_layers * self.layers["mtp"].active

    def kv_cache_bytes_per_token(self, elem_bytes: int) -> int:
        """KV cache per token of context over all layers (MLA caches the latent + the RoPE key)."""
        mla = self.spec.mla
        per_layer = (mla.kv_lora_rank + mla.qk_rope_head_dim) if mla else 2 * self.groups * self.head_dim
        return per_layer * self.model.num_layers * elem_bytes
