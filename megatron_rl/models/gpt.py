"""The policy model: Megatron-Core's `GPTModel` built from our config (dense or MoE).

Model code stays single-device-simple: this module maps `ModelConfig` onto Megatron-Core's
`TransformerConfig` and layer specs. Parallel plumbing (groups, layouts) arrives through the
`ParallelConfig` and the explicit process-group collection; nothing here reads globals.
Local (non-TE) spec on CPU; the Transformer Engine spec on GPU (with FP8 recipes selected by config).
"""
from __future__ import annotations

import dataclasses
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
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x @ gate) (Qwen2-MoE); needs a shared expert."""
    layer_pattern: list[int] | None = None
    """Per layer 1 = MoE, 0 = dense MLP (model.ffn_hidden_size); None: every layer is MoE."""
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax (Mixtral, Qwen) or per-expert sigmoid, renormalised over the top-k (DeepSeek-V3)."""
    router_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for choosing the top-k only (sigmoid)."""
    router_bias_update_rate: float = 0.0
    """Expert-bias step after each optimizer step (sign of the load imbalance); 0 keeps the loaded bias."""
    router_num_groups: int | None = None
    """Grouped top-k: experts split into this many groups (DeepSeek-V3: 8); None: no grouping."""
    router_group_topk: int | None = None
    """Grouped top-k: groups kept per token, ranked by the sum of their top-(topk / group_topk) scores."""
    routed_scaling_factor: float | None = None
    """Multiplier of the routed experts' weights (DeepSeek-V3: 2.5, Kimi-K2: 2.827); None: 1."""

    def validate(self) -> None:
        if self.num_experts < 0:
            raise ConfigError(f"moe.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts and not 1 <= self.topk <= self.num_experts:
            raise ConfigError(f"moe.topk={self.topk} must be in [1, num_experts={self.num_experts}]")
        self._validate_router()
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise ConfigError("moe.shared_expert_gate needs moe.shared_expert_ffn_hidden_size (a shared expert)")
        if self.layer_pattern is not None and set(self.layer_pattern) - {0, 1}:
            raise ConfigError(f"moe.layer_pattern must hold only 0 (dense) and 1 (MoE), got {self.layer_pattern}")

    def _validate_router(self) -> None:
        sig = self.router_score_function == "sigmoid"
        if self.router_expert_bias and not sig:
            raise ConfigError("moe.router_expert_bias needs moe.router_score_function=sigmoid")
        if self.router_bias_update_rate < 0 or (self.router_bias_update_rate and not self.router_expert_bias):
            raise ConfigError(f"moe.router_bias_update_rate={self.router_bias_update_rate} must be >= 0 and "
                              f"needs moe.router_expert_bias")
        if sig and self.router_pre_softmax:
            raise ConfigError("moe.router_pre_softmax applies to softmax routing only "
                              "(moe.router_score_function=sigmoid)")
        if self.routed_scaling_factor is not None and not self.routed_scaling_factor > 0:
            raise ConfigError(f"moe.routed_scaling_factor={self.routed_scaling_factor} must be > 0")
        groups, keep = self.router_num_groups, self.router_group_topk
        if (groups is None) != (keep is None):
            raise ConfigError("moe.router_num_groups and moe.router_group_topk are set together (grouped top-k)")
        if groups is None:
            return
        if groups < 1 or self.num_experts % groups or not 1 <= keep <= groups:
            raise ConfigError(f"moe.router_num_groups={groups} must divide num_experts={self.num_experts} and "
                              f"moe.router_group_topk={keep} be in [1, {groups}]")
        if self.topk % keep or keep * (self.num_experts // groups) < self.topk:
            raise ConfigError(f"moe.router_group_topk={keep} must divide moe.topk={self.topk}, and its groups hold "
                              f"at least topk experts ({keep} x {self.num_experts // groups})")


@dataclass
class RopeScaling:
    """RoPE frequency scaling of long-context checkpoints (HF `rope_scaling`), in Megatron-Core's terms."""

    kind: Literal["none", "linear", "llama3", "yarn"] = "none"
    """none; linear (positions / factor); llama3 (Llama 3.1 band-wise scaling); yarn (YaRN, with mscale)."""
    factor: float = 1.0
    """Context extension factor."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3 and yarn: the pre-training context length."""
    beta_fast: float = 32.0
    """yarn: rotations bounding the extrapolated band."""
    beta_slow: float = 1.0
    """yarn: rotations bounding the interpolated band."""
    mscale: float | None = None
    """yarn: attention factor numerator coefficient (with mscale_all_dim; None: 0.1 ln(factor) + 1)."""
    mscale_all_dim: float | None = None
    """yarn: attention factor denominator coefficient."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions."""


@dataclass
class MLAConfig:
    """Multi-latent attention (DeepSeek-V2/V3, Kimi-K2) through Megatron-Core's MLASelfAttention."""

    kv_lora_rank: int = 0
    """Rank of the compressed key/value latent; 0 = standard (grouped-query) attention."""
    q_lora_rank: int | None = None
    """Rank of the compressed query (normalised, then projected up); None: queries from the hidden state."""
    qk_head_dim: int = 128
    """Per-head query/key size without RoPE (HF qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head size of the decoupled RoPE part of queries and keys (HF qk_rope_head_dim; one key for all heads)."""
    v_head_dim: int = 128
    """Per-head value size."""

    @property
    def enabled(self) -> bool:
        return self.kv_lora_rank > 0

    def validate(self) -> None:
        if self.kv_lora_rank < 0:
            raise ConfigError(f"model.mla.kv_lora_rank={self.kv_lora_rank} must be >= 0")
        if not self.enabled:
            return
        sizes = {"q_lora_rank": self.q_lora_rank or 1, "qk_head_dim": self.qk_head_dim,
                 "qk_pos_emb_head_dim": self.qk_pos_emb_head_dim, "v_head_dim": self.v_head_dim}
        for key, n in sizes.items():
            if n < 1 or (key == "qk_pos_emb_head_dim" and n % 2):
                raise ConfigError(f"model.mla.{key}={n} must be a positive size (even for the RoPE part)")

    def check_model(self, cfg: ModelConfig) -> None:
        """Refuse model settings MLA does not combine with (each names its key)."""
        self.validate()
        if not self.enabled:
            return
        for key in _mla_clashes(cfg):
            raise ConfigError(f"model.{key}={_get(cfg, key)!r} does not apply to multi-latent attention "
                              f"(model.mla.kv_lora_rank > 0: MLA has its own head sizes, always normalises its "
                              f"latents, and Megatron's MLA RoPE is plain or YaRN with whole-dimension ranges)")
        rs = cfg.rope_scaling
        if rs.kind == "yarn" and rs.mscale_all_dim and not rs.mscale:
            raise ConfigError("model.rope_scaling.mscale_all_dim without mscale: Megatron's MLA YaRN would scale "
                              "its RoPE by 1 / mscale(mscale_all_dim), HF does not; set mscale too")


def _mla_clashes(cfg: ModelConfig) -> list[str]:
    """ModelConfig keys set to something multi-latent attention cannot honour."""
    rs = cfg.rope_scaling
    clash = {"num_query_groups": cfg.num_query_groups not in (None, cfg.num_attention_heads),
             "head_dim": cfg.head_dim is not None, "qkv_bias": cfg.qkv_bias, "qk_layernorm": cfg.qk_layernorm,
             "sliding_window": cfg.sliding_window is not None, "position_embedding": cfg.position_embedding != "rope",
             "rope_scaling.kind": rs.kind not in ("none", "yarn"),
             "rope_scaling.truncate": rs.kind == "yarn" and not rs.truncate}
    return [k for k, bad in clash.items() if bad]


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class ModelConfig:
    """Shape and numerics of the policy (and of the frozen reference model, built the same way)."""

    init: str = ""
    """Pretrained weights: hf:DIR (HF folder) or mcore:DIR (converted checkpoint); the shape then comes from
    the checkpoint's config.json, filled in by the run's resolve step (megatron_rl/convert/source.py: `resolve`,
    run by `RunConfig.resolve_sources`); `validate` reads nothing. '' = random weights of the shape below."""
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
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    """RoPE frequency scaling (Llama 3.1 and YaRN long-context checkpoints)."""
    sliding_window: int | None = None
    """Sliding-window attention: each token sees itself and the window - 1 tokens before it; None: full."""
    sliding_window_layers: list[int] | None = None
    """Per layer 1 = sliding window, 0 = full attention; None: the window applies to every layer."""
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
    mla: MLAConfig = field(default_factory=MLAConfig)
    """Multi-latent attention (DeepSeek-V3, Kimi-K2); off unless mla.kv_lora_rank > 0."""
    mtp_num_layers: int = 0
    """Multi-token-prediction depth (DeepSeek-V3's num_nextn_predict_layers: 1); 0: none (models/mtp.py)."""
    recompute_activations: bool = False
    """Recompute every transformer layer's activations in the trainer's backward (Megatron's full, uniform
    recompute, one layer per checkpoint): a micro-batch keeps only each layer's input ([S, H]) instead of all
    its intermediate tensors (SmolLM2-135M, 2048 tokens: about 3 GB less), for one more forward of the layers."""

    def validate(self) -> None:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}")
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                              f"num_query_groups={self.num_query_groups}")
        if self.recompute_activations and self.moe.num_experts:
            raise ConfigError("model.recompute_activations with model.moe.num_experts: the backward would route "
                              "every token again (routing replay and the routed-expert counts assume one routing "
                              "per forward); set model.recompute_activations=false for MoE models")
        if self.sliding_window_layers is not None and len(self.sliding_window_layers) != self.num_layers:
            raise ConfigError(f"model.sliding_window_layers has {len(self.sliding_window_layers)} entries for "
                              f"num_layers={self.num_layers}")
        if self.moe.layer_pattern is not None and len(self.moe.layer_pattern) != self.num_layers:
            raise ConfigError(f"model.moe.layer_pattern has {len(self.moe.layer_pattern)} entries for "
                              f"num_layers={self.num_layers}")
        if self.fp8 != "none" and self.transformer_impl != "transformer_engine":
            raise ConfigError("model.fp8 needs model.transformer_impl=transformer_engine (FP8 runs through TE)")
        self.mla.check_model(self)
        if self.mtp_num_layers < 0:
            raise ConfigError(f"model.mtp_num_layers must be >= 0, got {self.mtp_num_layers}")

    def check_parallel(self, parallel: ParallelConfig) -> None:
        parallel.check_model(num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                             num_query_groups=self.num_query_groups, num_experts=self.moe.num_experts or None,
                             mtp_num_layers=self.mtp_num_layers)
        if self.mla.enabled:
            _check_mla_parallel(self.mla, parallel)
        if self.mtp_num_layers and parallel.cp > 1:
            raise ConfigError(f"model.mtp_num_layers={self.mtp_num_layers} with parallel.cp={parallel.cp}: the "
                              f"multi-token-prediction loss is not served with context parallelism (its targets "
                              f"t + k and Megatron's rolled MTP inputs would cross this trainer's per-sample CP "
                              f"chunks); use cp=1 (pp, tp, ep are fine) or model.mtp_num_layers=0")

    def check_training(self, parallel: ParallelConfig) -> None:
        """Layouts Megatron-Core trains only with extra settings (serving them is fine)."""
        if self.moe.num_experts and parallel.tp > 1 and not parallel.sequence_parallel:
            raise ConfigError(f"parallel.sequence_parallel=false with MoE at parallel.tp={parallel.tp}: Megatron-Core "
                              f"refuses to train MoE layers under TP without sequence parallelism; set "
                              f"parallel.sequence_parallel=true")


def _check_mla_parallel(mla: MLAConfig, parallel: ParallelConfig) -> None:
    """MLA's down projections are column-parallel (split over TP ranks, then gathered); no CP here."""
    sizes = {"model.mla.q_lora_rank": mla.q_lora_rank or 0,
             "model.mla.kv_lora_rank + qk_pos_emb_head_dim": mla.kv_lora_rank + mla.qk_pos_emb_head_dim}
    for key, n in sizes.items():
        if n % parallel.tp:
            raise ConfigError(f"{key}={n} is not divisible by parallel.tp={parallel.tp}")
    if parallel.cp > 1:
        raise ConfigError(f"parallel.cp={parallel.cp} with multi-latent attention (model.mla) is not supported "
                          f"(the CPU context-parallel attention is for standard attention)")


def transformer_config(cfg: ModelConfig, parallel: ParallelConfig, overrides: dict | None = None):
    """Megatron-Core TransformerConfig for this model and layout (`overrides`: extra TransformerConfig fields)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

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
        window_size=(cfg.sliding_window - 1, 0) if cfg.sliding_window else None,
        window_attn_skip_freq=list(cfg.sliding_window_layers) if cfg.sliding_window_layers is not None else None,
        mtp_num_layers=cfg.mtp_num_layers or None,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
           if cfg.recompute_activations else {}),
        **parallel.transformer_kwargs(),  # uneven pipeline stages (megatron_rl/stages.py)
    )
    if moe.num_experts:
        kw.update(num_moe_experts=moe.num_experts, moe_router_topk=moe.topk,
                  moe_ffn_hidden_size=moe.ffn_hidden_size or kw["ffn_hidden_size"],
                  moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
                  moe_token_dispatcher_type=moe.dispatcher, moe_aux_loss_coeff=moe.aux_loss_coeff,
                  moe_z_loss_coeff=moe.z_loss_coeff, moe_grouped_gemm=moe.grouped_gemm,
                  moe_router_pre_softmax=moe.router_pre_softmax, moe_shared_expert_gate=moe.shared_expert_gate,
                  moe_layer_freq=list(moe.layer_pattern) if moe.layer_pattern is not None else 1,
                  moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff else "none",
                  moe_router_score_function=moe.router_score_function,
                  moe_router_enable_expert_bias=moe.router_expert_bias,
                  moe_router_bias_update_rate=moe.router_bias_update_rate,
                  moe_router_num_groups=moe.router_num_groups, moe_router_group_topk=moe.router_group_topk,
                  moe_router_topk_scaling_factor=moe.routed_scaling_factor)
    if cfg.mla.enabled:
        kw.update(_mla_kwargs(cfg))
    if cfg.fp8 != "none":
        kw.update(fp8="hybrid" if cfg.fp8 == "delayed" else "e4m3", fp8_recipe=cfg.fp8)
    kw.update(overrides or {})
    top1_after = kw.get("num_moe_experts") and kw["moe_router_topk"] == 1 and not kw["moe_router_pre_softmax"] \
        and kw["moe_router_score_function"] == "softmax"
    if top1_after:  # Megatron refuses this combination up front (see below): validate as pre-softmax
        kw["moe_router_pre_softmax"] = True
    tc = (MLATransformerConfig if cfg.mla.enabled else TransformerConfig)(**kw)
    if top1_after:
        # Top-1 routing with softmax after top-k gives every token weight 1.0 (Mixtral, Qwen-MoE with
        # norm_topk_prob at k=1). Megatron refuses it because the router then gets no gradient from the
        # loss -- exactly as in the HF model; pre-softmax would scale each expert's output by p < 1 instead.
        tc.moe_router_pre_softmax = False
    _set_yarn(tc, cfg)
    return tc


def _mla_kwargs(cfg: ModelConfig) -> dict:
    """MLATransformerConfig fields: the latent sizes, and its own RoPE (plain, or YaRN with the concentration
    factor mscale / mscale_all_dim applied to the RoPE and mscale_all_dim's squared to the softmax scale)."""
    mla, rs = cfg.mla, cfg.rope_scaling
    kw = dict(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
              qk_head_dim=mla.qk_head_dim, qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim, v_head_dim=mla.v_head_dim,
              qk_layernorm=True, num_query_groups=None, kv_channels=None, rotary_base=cfg.rotary_base,
              rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if rs.kind == "yarn":
        both = bool(rs.mscale) and bool(rs.mscale_all_dim)  # HF: the RoPE factor uses both or neither
        kw.update(rope_type="yarn", rotary_scaling_factor=rs.factor,
                  original_max_position_embeddings=rs.original_max_position_embeddings,
                  beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
                  mscale=rs.mscale if both else 1.0, mscale_all_dim=rs.mscale_all_dim if both else 0.0)
    return kw


def _set_yarn(tc, cfg: ModelConfig) -> None:
    """GPTModel(position_embedding_type='yarn') and attention read these from the config (not fields of
    TransformerConfig in 0.16.1: MLATransformerConfig's names)."""
    rs = cfg.rope_scaling
    if rs.kind != "yarn" or cfg.mla.enabled:  # MLA: MLATransformerConfig's own YaRN fields
        return
    tc.yarn_rotary_scaling_factor = rs.factor
    tc.yarn_original_max_position_embeddings = rs.original_max_position_embeddings
    tc.yarn_beta_fast, tc.yarn_beta_slow = rs.beta_fast, rs.beta_slow
    # Megatron's concentration factor falls back to 0.1 ln(factor) + 1 when either is None, as HF does
    # when either is missing or zero
    both = bool(rs.mscale) and bool(rs.mscale_all_dim)
    tc.yarn_mscale, tc.yarn_mscale_all_dim = (rs.mscale, rs.mscale_all_dim) if both else (None, None)
    tc.yarn_correction_range_round_to_int = rs.truncate


def rope_kwargs(cfg: ModelConfig) -> dict:
    """GPTModel keyword arguments for the position embedding and its RoPE scaling."""
    rs = cfg.rope_scaling
    if cfg.position_embedding != "rope" or rs.kind == "none" or cfg.mla.enabled:  # MLA: RoPE inside attention
        return {"position_embedding_type": cfg.position_embedding}
    if rs.kind == "linear":
        return {"position_embedding_type": "rope", "seq_len_interpolation_factor": rs.factor}
    if rs.kind == "llama3":
        return {"position_embedding_type": "rope", "rope_scaling": True, "rope_scaling_factor": rs.factor}
    return {"position_embedding_type": "yarn"}


def finish_rope(model, cfg: ModelConfig) -> None:
    """llama3 scaling with band limits other than Megatron's fixed (1, 4, 8192): recompute the frequencies
    with Megatron's own `RotaryEmbedding._apply_scaling`, passing the checkpoint's limits."""
    rs = cfg.rope_scaling
    rot = getattr(model, "rotary_pos_emb", None)
    if rs.kind != "llama3" or rot is None or (rs.low_freq_factor, rs.high_freq_factor,
                                              rs.original_max_position_embeddings) == (1.0, 4.0, 8192):
        return
    dim = model.config.kv_channels
    base = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]
    rot.inv_freq = rot._apply_scaling(base, factor=rs.factor, low_freq_factor=rs.low_freq_factor,
                                      high_freq_factor=rs.high_freq_factor,
                                      original_max_position_embeddings=rs.original_max_position_embeddings
                                      ).to(rot.inv_freq.device)
    rot.forward.cache_clear()


def layer_spec(cfg: ModelConfig, cp: int = 1, tcfg=None, *, vp_stage: int | None = None,
               pp_rank: int | None = None):
    """The per-layer module spec: local modules on CPU, Transformer Engine modules on GPU.

    Context parallelism (cp > 1): TE's attention does it natively (THD + cu_seqlens); the local spec's
    DotProductAttention refuses it, so its core attention is swapped for `CPDotProductAttention` (K/V
    all-gathered in the CP group; no parameters, so weights and checkpoints are unchanged).
    Mixed dense/MoE layers (`moe.layer_pattern`): Megatron's block spec of this stage's layers, built from
    the TransformerConfig `tcfg` (its moe_layer_freq list), `vp_stage` and `pp_rank`.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    n_exp = cfg.moe.num_experts or None
    te = cfg.transformer_impl == "transformer_engine"
    if n_exp and cfg.moe.layer_pattern is not None:
        block = specs.get_gpt_decoder_block_spec(tcfg, use_transformer_engine=te, normalization=cfg.normalization,
                                                 vp_stage=vp_stage, pp_rank=pp_rank)
        for spec in block.layer_specs if not te else []:
            _swap_core_attention(spec, cfg, cp)
        return block
    mla = dict(multi_latent_attention=cfg.mla.enabled, qk_layernorm=cfg.qk_layernorm or cfg.mla.enabled)
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=n_exp, moe_grouped_gemm=cfg.moe.grouped_gemm, **mla)
    spec = specs.get_gpt_layer_local_spec(num_experts=n_exp, moe_grouped_gemm=cfg.moe.grouped_gemm,
                                          normalization=cfg.normalization, **mla)
    _swap_core_attention(spec, cfg, cp)
    return spec


def _swap_core_attention(spec, cfg: ModelConfig, cp: int) -> None:
    """Local spec: CP attention for cp > 1; for multi-latent attention its head sizes and a replicated kv down
    projection (models/mla_attention: the TP gradient of the shared RoPE key); else Megatron's attention with
    torch SDPA arithmetic (models/sdpa_attention: per packed segment, not the S x S scores)."""
    from megatron_rl.models.cp_attention import CPDotProductAttention
    from megatron_rl.models.mla_attention import MLADotProductAttention, replicated_linear
    from megatron_rl.models.sdpa_attention import SDPADotProductAttention

    if cfg.mla.enabled:
        spec.submodules.self_attention.submodules.core_attention = MLADotProductAttention
        spec.submodules.self_attention.submodules.linear_kv_down_proj = replicated_linear()
    elif cp > 1:
        spec.submodules.self_attention.submodules.core_attention = CPDotProductAttention
    else:
        spec.submodules.self_attention.submodules.core_attention = SDPADotProductAttention


def _mtp_source_spec(cfg: ModelConfig, parallel: ParallelConfig, spec):
    """The spec the MTP layers copy (the model's last layer's): this chunk's, or, when this chunk holds no layer
    (an uneven layout such as DeepSeek-V3's 'Et|(tt|)*30mL': the MTP layer and the loss alone), the last layer's of
    the whole model's block spec."""
    if not cfg.mtp_num_layers or not hasattr(spec, "layer_specs") or spec.layer_specs:
        return spec
    one = dataclasses.replace(parallel, pp=1, vpp=None, first_stage_layers=None, last_stage_layers=None,
                              pipeline_layout=None)
    return layer_spec(cfg, parallel.cp, transformer_config(cfg, one), vp_stage=None, pp_rank=0)


def build_gpt(cfg: ModelConfig, parallel: ParallelConfig, pgs=None, *, pre_process: bool = True,
              post_process: bool = True, vp_stage: int | None = None, config_overrides: dict | None = None):
    """One (pipeline-stage) chunk of the policy as a Megatron-Core GPTModel.

    `config_overrides`: extra TransformerConfig fields (the converter's, for settings ModelConfig lacks).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.models.mtp import mtp_block_spec, mtp_model_class

    cfg.check_parallel(parallel)
    tcfg = transformer_config(cfg, parallel, config_overrides)
    pp_rank = None
    if cfg.moe.layer_pattern is not None:  # the block spec slices this stage's layers
        pp_rank = pgs.pp.rank() if getattr(pgs, "pp", None) is not None else \
            parallel_state.get_pipeline_model_parallel_rank()
    spec = layer_spec(cfg, parallel.cp, tcfg, vp_stage=vp_stage, pp_rank=pp_rank)
    mtp = mtp_block_spec(tcfg, _mtp_source_spec(cfg, parallel, spec), cfg.transformer_impl == "transformer_engine",
                         vp_stage) if post_process else None
    model = (mtp_model_class() if mtp is not None else GPTModel)(
        config=tcfg, transformer_layer_spec=spec, mtp_block_spec=mtp,
        vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_seq_length, pre_process=pre_process,
        post_process=post_process, parallel_output=True, share_embeddings_and_output_weights=cfg.tie_embeddings,
        rotary_base=cfg.rotary_base, pg_collection=pgs, vp_stage=vp_stage, **rope_kwargs(cfg))
    finish_rope(model, cfg)
    if cfg.mla.enabled:
        from megatron_rl.models.mla_attention import fix_rope_key_grad

        fix_rope_key_grad(model, pgs.tp if pgs is not None else parallel_state.get_tensor_model_parallel_group())
    return model
