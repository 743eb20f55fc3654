"""Tiny Hugging Face models and tokenizers built here (no download): a BPE tokenizer trained on a few lines
with ChatML special tokens and a chat template (tools included), and a random Llama of its vocabulary."""
from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% elif messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["What is 7 + 5? 7 + 5 = 12. The answer is 12.", "What is 9 * 3? 9 * 3 = 27.",
          "What is 14 - 6? 14 - 6 = 8.", "system user assistant tool You are a tiny test model.",
          "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 Answer: the sum of and is"]


def tiny_tokenizer(folder: Path, vocab_size: int = 200, template: str | None = CHAT_TEMPLATE):
    """Train a byte-level BPE tokenizer and save it as an HF tokenizer folder; returns the transformers one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    if template:
        hf.chat_template = template
    hf.save_pretrained(folder)
    return hf


def tiny_llama(folder: Path, tok, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               seed: int = 0, dtype: str = "float32", max_positions: int = 512):
    """A random LlamaForCausalLM whose vocabulary is `tok`'s, saved (safetensors) with the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    with torch.no_grad():  # larger logits than the default init: sampled answers differ between seeds
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return model


def tiny_deepseek_v3(folder: Path, tok, seed: int = 0):
    """A random DeepseekV3ForCausalLM (MLA with YaRN, first layer dense, 8 sigmoid-routed experts in 4 groups,
    expert bias, shared expert) whose vocabulary is `tok`'s, saved with the tokenizer."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1, max_position_embeddings=512,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
                      "mscale_all_dim": 1.0}, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # larger logits than the default init; a non-zero expert bias
        for name, p in model.named_parameters():
            p.mul_(4.0) if p.dim() > 1 and "gate" not in name.split(".")[-2:-1] else None
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return model
