"""Qwen2 / Qwen2.5 (dense): Llama layout plus a bias on q/k/v projections."""
from tools.convert.arch.base import Arch

ARCH = Arch(name="qwen2", hf_architectures=("Qwen2ForCausalLM",), model_type="qwen2",
            qkv_bias=lambda hf: True, hf_defaults={"use_sliding_window": False})
