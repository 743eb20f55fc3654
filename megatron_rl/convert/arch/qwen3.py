"""Qwen3 (dense): Llama layout plus per-head RMSNorm of queries and keys (q_norm / k_norm); sliding
window as Qwen2."""
from megatron_rl.convert.arch.base import Arch

ARCH = Arch(name="qwen3", hf_architectures=("Qwen3ForCausalLM",), model_type="qwen3",
            qkv_bias=lambda hf: bool(hf.get("attention_bias")), qk_norm=True, window="qwen",
            qkv_bias_key="attention_bias")
