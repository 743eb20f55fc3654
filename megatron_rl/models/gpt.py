"""The policy model: Megatron-Core's `GPTModel` built from our config (dense or MoE).

Model code stays single-device-simple: this module maps `ModelConfig` onto Megatron-Core's
`TransformerConfig` and layer specs. Parallel plumbing (groups, layouts) arrives through the
`ParallelConfig` and the explicit process-group collection; nothing here reads globals.
Local (non-TE) spec on CPU; the Transformer Engine spec on GPU (with FP8 recipes selected by config).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from megatron_rl.config import ConfigError
from megatron_rl.parallel import ParallelConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class MoEConfig:
    """Mixture-of-experts settings (num_experts = 0 means a dense model)."""

    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    topk: int = 2
    """Experts each token is routed to."""
    ffn_hidden_size: int | None = None
    """Hidden size of each expert's MLP; None means model.ffn_hidden_size."""
    shared_expert_ffn_hidden_size: int | None = None
    """Hidden size of the always-on shared expert(s); None for no shared expert."""
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """Token dispatcher between expert-parallel ranks."""
    aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient."""
    z_loss_coeff: float | None = None
    """Router z-loss coefficient; None disables it."""
    grouped_gemm: bool = False
    """Use grouped GEMM experts (needs TE or grouped_gemm; GPU only)."""
    router_pre_softmax: bool = False
    """Softmax over all experts before top-k (Mixtral-style False: top-k, then softmax; Qwen3-MoE True)."""

    def validate(self) -> None:
        if self.num_experts < 0:
            raise ConfigError(f"moe.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts and not 1 <= self.topk <= self.num_experts:
            raise ConfigError(f"moe.topk={self.topk} must be in [1, num_experts={self.num_experts}]")


@dataclass
class ModelConfig:
    """Shape and numerics of the policy (and of the frozen reference model, built the same way)."""

    init: str = ""
    """Pretrained weights: hf:DIR (HF folder) or mcore:DIR (converted checkpoint); the shape then comes from
    the checkpoint's config.json (models/source.py). '' = random weights of the shape below."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Attention heads."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None for plain multi-head attention."""
    head_dim: int | None = None
    """Size of each attention head; None means hidden_size / num_attention_heads (Qwen3 sets it)."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers (Llama 3: 1e-5, Qwen: 1e-6)."""
    ffn_hidden_size: int | None = None
    """MLP hidden size; None means 4 * hidden_size."""
    vocab_size: int = 128
    """Vocabulary size (padded to a multiple of 128 * tp by Megatron conventions when needed)."""
    max_seq_length: int = 256
    """Longest sequence (prompt + response) the model handles."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Normalisation layer."""
    activation: Literal["swiglu", "gelu"] = "swiglu"
    """MLP activation (swiglu doubles the first projection)."""
    position_embedding: Literal["rope", "learned_absolute"] = "rope"
    """Position encoding."""
    rotary_base: int = 10000
    """RoPE base."""
    tie_embeddings: bool = True
    """Share the input embedding and the output layer weights."""
    qkv_bias: bool = False
    """Bias in the QKV projection (Qwen2-style)."""
    qk_layernorm: bool = False
    """Normalise queries and keys (Qwen3-style)."""
    init_std: float = 0.02
    """Standard deviation of weight initialisation."""
    params_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter dtype (fp32 on CPU)."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Layer implementation: Megatron-Core local modules (CPU) or Transformer Engine (GPU)."""
    fp8: Literal["none", "delayed", "tensorwise", "blockwise", "mxfp8"] = "none"
    """FP8 recipe through Transformer Engine (GPU only)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-experts settings."""

    def validate(self) -> None:
        if self.init:
            from megatron_rl.models.source import resolve

            resolve(self)
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}")
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"num_query_groups={self.num_query_groups}")
        if self.fp8 != "none" and self.transformer_impl != "transformer_engine":
            raise ConfigError("model.fp8 needs model.transformer_impl=transformer_engine (FP8 runs through TE)")

    def check_parallel(self, parallel: ParallelConfig) -> None:
        parallel.check_model(num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                             num_query_groups=self.num_query_groups, num_experts=self.moe.num_experts or None)


def transformer_config(cfg: ModelConfig, parallel: ParallelConfig):
    """Megatron-Core TransformerConfig for this model and layout."""
    from megatron.core.transformer import TransformerConfig

    moe = cfg.moe
    kw = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        kv_channels=cfg.head_dim, layernorm_epsilon=cfg.norm_epsilon,
        normalization=cfg.normalization, gated_linear_unit=cfg.activation == "swiglu",
        activation_func=torch.nn.functional.silu if cfg.activation == "swiglu" else torch.nn.functional.gelu,
        add_bias_linear=False, add_qkv_bias=cfg.qkv_bias, qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=cfg.init_std,
        params_dtype=_DTYPES[cfg.params_dtype], bf16=cfg.params_dtype == "bf16", fp16=cfg.params_dtype == "fp16",
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp if parallel.pp > 1 else None,
        context_parallel_size=parallel.cp, expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp, sequence_parallel=parallel.sequence_parallel,
        pipeline_dtype=_DTYPES[cfg.params_dtype], use_cpu_initialization=not torch.cuda.is_available(),
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    if moe.num_experts:
        kw.update(num_moe_experts=moe.num_experts, moe_router_topk=moe.topk,
                  moe_ffn_hidden_size=moe.ffn_hidden_size or kw["ffn_hidden_size"],
                  moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
                  moe_token_dispatcher_type=moe.dispatcher, moe_aux_loss_coeff=moe.aux_loss_coeff,
                  moe_z_loss_coeff=moe.z_loss_coeff, moe_grouped_gemm=moe.grouped_gemm,
                  moe_router_pre_softmax=moe.router_pre_softmax,
                  moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff else "none")
    if cfg.fp8 != "none":
        kw.update(fp8="hybrid" if cfg.fp8 == "delayed" else "e4m3", fp8_recipe=cfg.fp8)
    return TransformerConfig(**kw)


def layer_spec(cfg: ModelConfig, cp: int = 1):
    """The per-layer module spec: local modules on CPU, Transformer Engine modules on GPU.

    Context parallelism (cp > 1): TE's attention does it natively (THD + cu_seqlens); the local spec's
    DotProductAttention refuses it, so its core attention is swapped for `CPDotProductAttention` (K/V
    all-gathered in the CP group; no parameters, so weights and checkpoints are unchanged).
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    n_exp = cfg.moe.num_experts or None
    if cfg.transformer_impl == "transformer_engine":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=n_exp, moe_grouped_gemm=cfg.moe.grouped_gemm, qk_layernorm=cfg.qk_layernorm)
    spec = specs.get_gpt_layer_local_spec(num_experts=n_exp, moe_grouped_gemm=cfg.moe.grouped_gemm,
                                          qk_layernorm=cfg.qk_layernorm, normalization=cfg.normalization)
    if cp > 1:
        from megatron_rl.models.cp_attention import CPDotProductAttention

        spec.submodules.self_attention.submodules.core_attention = CPDotProductAttention
    return spec


def build_gpt(cfg: ModelConfig, parallel: ParallelConfig, pgs=None, *, pre_process: bool = True,
              post_process: bool = True, vp_stage: int | None = None):
    """One (pipeline-stage) chunk of the policy as a Megatron-Core GPTModel."""
    from megatron.core.models.gpt import GPTModel

    cfg.check_parallel(parallel)
    return GPTModel(
        config=transformer_config(cfg, parallel), transformer_layer_spec=layer_spec(cfg, parallel.cp),
        vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_seq_length, pre_process=pre_process,
        post_process=post_process, parallel_output=True, share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type=cfg.position_embedding, rotary_base=cfg.rotary_base, pg_collection=pgs,
        vp_stage=vp_stage)
