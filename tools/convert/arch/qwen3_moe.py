"""Qwen3-MoE: Qwen3 attention (QK-norm), every layer MoE: router `mlp.gate`, experts
`mlp.experts.E.{gate,up,down}_proj`; no shared expert. norm_topk_prob=true is Megatron's default routing
(softmax over the top-k logits); false maps to moe_router_pre_softmax (softmax over all, no renormalisation).
"""
from tools.convert.arch.base import Arch, MoENames

ARCH = Arch(
    name="qwen3_moe", hf_architectures=("Qwen3MoeForCausalLM",), model_type="qwen3_moe",
    qkv_bias=lambda hf: bool(hf.get("attention_bias")), qk_norm=True,
    moe=MoENames(router="model.layers.{l}.mlp.gate.weight",
                 gate="model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
                 up="model.layers.{l}.mlp.experts.{e}.up_proj.weight",
                 down="model.layers.{l}.mlp.experts.{e}.down_proj.weight",
                 num_experts_key="num_experts", ffn_key="moe_intermediate_size",
                 renormalize=lambda hf: bool(hf.get("norm_topk_prob", True))),
    hf_defaults={"use_sliding_window": False, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": []})
