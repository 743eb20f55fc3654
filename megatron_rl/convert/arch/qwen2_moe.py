"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v bias), MoE layers as Qwen3-MoE plus a
shared expert `mlp.shared_expert.{gate,up,down}_proj` scaled by sigmoid(`mlp.shared_expert_gate`) (Megatron:
shared_experts with moe_shared_expert_gate). norm_topk_prob defaults to false (pre-softmax routing); mixed
dense/MoE layers as Qwen3-MoE. Sliding windows are refused (HF applies them differently per attention
implementation for this model).
"""
from megatron_rl.convert.arch.base import Arch, MoENames

ARCH = Arch(
    name="qwen2_moe", hf_architectures=("Qwen2MoeForCausalLM",), model_type="qwen2_moe",
    qkv_bias=lambda hf: bool(hf.get("qkv_bias", True)), qkv_bias_key="qkv_bias",
    moe=MoENames(router="model.layers.{l}.mlp.gate.weight",
                 gate="model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
                 up="model.layers.{l}.mlp.experts.{e}.up_proj.weight",
                 down="model.layers.{l}.mlp.experts.{e}.down_proj.weight",
                 num_experts_key="num_experts", ffn_key="moe_intermediate_size",
                 renormalize_key="norm_topk_prob", mixed_layers=True,
                 shared="model.layers.{l}.mlp.shared_expert.",
                 shared_gate="model.layers.{l}.mlp.shared_expert_gate.weight",
                 shared_ffn_key="shared_expert_intermediate_size"))
