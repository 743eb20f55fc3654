"""Mixtral: Llama attention, every layer MoE under `block_sparse_moe`: router `gate`, experts
`experts.E.w1` (gate), `w3` (up), `w2` (down). Routing = softmax over the top-k logits (Megatron's default;
at top-1 every token's weight is 1). `sliding_window` (every layer) maps to Megatron's window_size.
"""
from megatron_rl.convert.arch.base import Arch, MoENames

ARCH = Arch(
    name="mixtral", hf_architectures=("MixtralForCausalLM",), model_type="mixtral", qkv_bias=lambda hf: False,
    window="all",
    moe=MoENames(router="model.layers.{l}.block_sparse_moe.gate.weight",
                 gate="model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
                 up="model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
                 down="model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
                 num_experts_key="num_local_experts", ffn_key="intermediate_size"))
