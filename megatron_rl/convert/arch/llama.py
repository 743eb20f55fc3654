"""Llama 2/3 (dense): HF `LlamaForCausalLM`. No QKV bias unless attention_bias (refused: o_proj bias)."""
from megatron_rl.convert.arch.base import Arch

ARCH = Arch(name="llama", hf_architectures=("LlamaForCausalLM",), model_type="llama",
            qkv_bias=lambda hf: False)
