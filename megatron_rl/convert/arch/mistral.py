"""Mistral (dense): the Llama layout; `sliding_window` (every layer) maps to Megatron's window_size."""
from megatron_rl.convert.arch.base import Arch

ARCH = Arch(name="mistral", hf_architectures=("MistralForCausalLM",), model_type="mistral",
            qkv_bias=lambda hf: False, window="all")
