"""Tiny random HF models (built with transformers from configs, no download) for the conversion tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0)

CONFIGS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None, head_dim=None)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                         norm_topk_prob=False)),
    # DeepSeek-V3 in miniature: MLA (q and kv latents, decoupled RoPE), 8 sigmoid-routed experts in 4 groups
    # (top-2 groups, top-4 experts), routed scaling, a shared expert, the first layer dense, YaRN with mscale
    "deepseek_v3": ("DeepseekV3Config", dict(
        tie_word_embeddings=False, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
        moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        num_hidden_layers=3, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                           "mscale_all_dim": 1.0})),
}
ROUTER_BIAS = "e_score_correction_bias"
"""DeepSeek-V3's expert-choice bias: a zero buffer in a fresh model, randomised here so that it matters."""
KIMI_K2 = dict(
    model_type="kimi_k2", num_key_value_heads=2, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=8,
    qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=12, num_experts_per_tok=3, n_group=1,
    topk_group=1, moe_intermediate_size=8, n_shared_experts=2, routed_scaling_factor=2.827, num_hidden_layers=2,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4, "beta_fast": 1.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
"""make_hf_model("deepseek_v3", **KIMI_K2): Kimi-K2's variant of the class in miniature -- one expert group, more
experts, two shared, scaling 2.827, YaRN x32, config.json model_type kimi_k2 -- and no q latent (q_proj)."""


def make_hf_model(arch: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
                  model_type: str | None = None, **overrides) -> Path:
    """Save a random tiny model of `arch` into `path` (sharded safetensors + index, plus a tokenizer file);
    `model_type`: written into config.json instead of the class's own."""
    import transformers

    cls_name, kw = CONFIGS[arch]
    config = getattr(transformers, cls_name)(**{**COMMON, **kw, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # norms at 1 would hide a swapped norm: randomise them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith(ROUTER_BIAS):
                b.copy_(torch.rand_like(b) * 0.2)  # shifts the choice among scores of ~0.5 +- 0.1
    model.to(dtype).save_pretrained(path, max_shard_size="20KB", safe_serialization=True)
    if model_type:
        cfg_file = Path(path) / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "model_type": model_type}, indent=2))
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64, "seed": seed}))
    return Path(path)


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out
