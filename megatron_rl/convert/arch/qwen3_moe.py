"""Qwen3-MoE: Qwen3 attention (QK-norm), MoE layers: router `mlp.gate`, experts
`mlp.experts.E.{gate,up,down}_proj`; no shared expert. norm_topk_prob=true is Megatron's default routing
(softmax over the top-k logits); false maps to moe_router_pre_softmax (softmax over all, no renormalisation).
Layers in `mlp_only_layers` or off `decoder_sparse_step` are dense (`mlp.{gate,up,down}_proj`, intermediate_size):
Megatron's moe_layer_freq list. `use_sliding_window` applies to every layer.
"""
from megatron_rl.convert.arch.base import Arch, MoENames

ARCH = Arch(
    name="qwen3_moe", hf_architectures=("Qwen3MoeForCausalLM",), model_type="qwen3_moe",
    qkv_bias=lambda hf: bool(hf.get("attention_bias")), qk_norm=True, window="qwen_all",
    qkv_bias_key="attention_bias",
    moe=MoENames(router="model.layers.{l}.mlp.gate.weight",
                 gate="model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
                 up="model.layers.{l}.mlp.experts.{e}.up_proj.weight",
                 down="model.layers.{l}.mlp.experts.{e}.down_proj.weight",
                 num_experts_key="num_experts", ffn_key="moe_intermediate_size",
                 renormalize_key="norm_topk_prob", mixed_layers=True))
