"""Qwen2 / Qwen2.5 (dense): Llama layout plus a bias on q/k/v projections; `use_sliding_window` on the
layers `layer_types` (or max_window_layers) names maps to Megatron's window_size + window_attn_skip_freq."""
from megatron_rl.convert.arch.base import Arch

ARCH = Arch(name="qwen2", hf_architectures=("Qwen2ForCausalLM",), model_type="qwen2",
            qkv_bias=lambda hf: True, window="qwen")
