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
}


def make_hf_model(arch: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Save a random tiny model of `arch` into `path` (sharded safetensors + index, plus a tokenizer file)."""
    import transformers

    cls_name, kw = CONFIGS[arch]
    config = getattr(transformers, cls_name)(**{**COMMON, **kw, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # norms at 1 would hide a swapped norm: randomise them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(dtype).save_pretrained(path, max_shard_size="20KB", safe_serialization=True)
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64, "seed": seed}))
    return Path(path)


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out
