"""What an architecture table is: HF tensor names of a Llama-style decoder, dense or MoE.

A `Rule` says how one canonical Megatron tensor is made from HF tensors:
  copy  one HF tensor, same shape
  qkv   Megatron's fused QKV, interleaved per query group: [q heads of group g, k_g, v_g] for g in groups
  glu   Megatron's fused gated MLP input projection: concat(gate, up) along the output dimension
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_rl.models.gpt import ModelConfig, MoEConfig

_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class ConvertError(ValueError):
    """Bad input to a conversion (unknown architecture, missing shard, shape mismatch...)."""


@dataclass(frozen=True)
class Rule:
    """How one canonical Megatron tensor is made of HF tensors."""

    kind: str
    """copy, qkv or glu."""
    hf: tuple[str, ...]
    """HF tensor names: (name,), (q, k, v) or (gate, up)."""


@dataclass(frozen=True)
class MoENames:
    """HF names of one MoE layer (format strings with {l} = layer and {e} = expert)."""

    router: str
    """Router (gate) weight [num_experts, hidden]."""
    gate: str
    """Expert gate projection [ffn, hidden]."""
    up: str
    """Expert up projection [ffn, hidden]."""
    down: str
    """Expert down projection [hidden, ffn]."""
    num_experts_key: str
    """HF config key holding the number of routed experts."""
    ffn_key: str
    """HF config key holding each expert's hidden size."""
    renormalize: Callable[[dict], bool]
    """Whether the top-k routing probabilities are renormalised (Megatron: softmax after top-k)."""


@dataclass(frozen=True)
class Arch:
    """One supported HF architecture (a Llama-style decoder)."""

    name: str
    """Short name (used by --hf-config ARCH)."""
    hf_architectures: tuple[str, ...]
    """Values of config.json `architectures` handled by this table."""
    model_type: str
    """config.json `model_type`."""
    qkv_bias: Callable[[dict], bool]
    """Whether q/k/v projections carry a bias, from the HF config."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys (Qwen3)."""
    moe: MoENames | None = None
    """MoE names; None for a dense model."""
    hf_defaults: dict = field(default_factory=dict)
    """Extra config.json entries written when only the architecture name is known."""

    # -- config ----------------------------------------------------------------------------------------
    def model_config(self, hf: dict, dtype: str | None = None) -> tuple[ModelConfig, dict]:
        """(ModelConfig, TransformerConfig overrides) for an HF config.json."""
        self.check_supported(hf)
        heads = hf["num_attention_heads"]
        cfg = ModelConfig(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
            vocab_size=hf["vocab_size"], max_seq_length=hf.get("max_position_embeddings", 4096),
            rotary_base=int(hf.get("rope_theta", 10000)), tie_embeddings=bool(hf.get("tie_word_embeddings")),
            qkv_bias=self.qkv_bias(hf), qk_layernorm=self.qk_norm,
            params_dtype=dtype or _DTYPE_NAMES.get(str(hf.get("torch_dtype", "float32")), "fp32"))
        extra = {"layernorm_epsilon": hf.get("rms_norm_eps", 1e-6), "kv_channels": head_dim(hf)}
        if self.moe:
            cfg.moe = MoEConfig(num_experts=hf[self.moe.num_experts_key], topk=hf["num_experts_per_tok"],
                                ffn_hidden_size=hf[self.moe.ffn_key])
            extra["moe_router_pre_softmax"] = not self.moe.renormalize(hf)
        return cfg, extra

    def check_supported(self, hf: dict) -> None:
        """Refuse HF features these tables do not map (rather than convert them wrongly)."""
        bad = []
        if hf.get("rope_scaling"):
            bad.append(f"rope_scaling={hf['rope_scaling']}")
        if hf.get("hidden_act", "silu") != "silu":
            bad.append(f"hidden_act={hf['hidden_act']}")
        if hf.get("mlp_bias"):
            bad.append("mlp_bias=true")
        if self.model_type == "llama" and hf.get("attention_bias"):
            bad.append("attention_bias=true (o_proj bias is not mapped)")
        if hf.get("use_sliding_window"):
            bad.append("use_sliding_window=true")
        if self.moe and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
            bad.append("mixed dense/MoE layers (mlp_only_layers / decoder_sparse_step)")
        if bad:
            raise ConvertError(f"{self.name}: unsupported HF config features: {', '.join(bad)}")

    def hf_config(self, cfg: ModelConfig, extra: dict) -> dict:
        """A config.json for `cfg` (used when mcore-to-hf is given only an architecture name)."""
        out = {"architectures": [self.hf_architectures[0]], "model_type": self.model_type,
               "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
               "num_attention_heads": cfg.num_attention_heads,
               "num_key_value_heads": cfg.num_query_groups or cfg.num_attention_heads,
               "intermediate_size": cfg.ffn_hidden_size or 4 * cfg.hidden_size, "vocab_size": cfg.vocab_size,
               "max_position_embeddings": cfg.max_seq_length, "rope_theta": float(cfg.rotary_base),
               "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
               "rms_norm_eps": extra.get("layernorm_epsilon", 1e-5),
               "head_dim": extra.get("kv_channels") or cfg.hidden_size // cfg.num_attention_heads,
               "torch_dtype": {v: k for k, v in _DTYPE_NAMES.items()}[cfg.params_dtype], **self.hf_defaults}
        if self.moe:
            out.update({self.moe.num_experts_key: cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.topk,
                        self.moe.ffn_key: cfg.moe.ffn_hidden_size or out["intermediate_size"]})
        return out

    # -- names -----------------------------------------------------------------------------------------
    def global_rules(self, hf: dict) -> dict[str, Rule]:
        """Rules of the tensors outside the decoder layers (output_layer only when untied)."""
        rules = {"embedding.word_embeddings.weight": Rule("copy", ("model.embed_tokens.weight",)),
                 "decoder.final_layernorm.weight": Rule("copy", ("model.norm.weight",))}
        if not hf.get("tie_word_embeddings"):
            rules["output_layer.weight"] = Rule("copy", ("lm_head.weight",))
        return rules

    def layer_rules(self, hf: dict, layer: int) -> dict[str, Rule]:
        """Rules of decoder layer `layer` (global index)."""
        p, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        att = h + "self_attn."
        rules = {p + "input_layernorm.weight": Rule("copy", (h + "input_layernorm.weight",)),
                 p + "self_attention.linear_qkv.weight": Rule("qkv", tuple(f"{att}{x}_proj.weight" for x in "qkv")),
                 p + "self_attention.linear_proj.weight": Rule("copy", (att + "o_proj.weight",)),
                 p + "pre_mlp_layernorm.weight": Rule("copy", (h + "post_attention_layernorm.weight",))}
        if self.qkv_bias(hf):
            rules[p + "self_attention.linear_qkv.bias"] = Rule("qkv", tuple(f"{att}{x}_proj.bias" for x in "qkv"))
        if self.qk_norm:
            rules[p + "self_attention.q_layernorm.weight"] = Rule("copy", (att + "q_norm.weight",))
            rules[p + "self_attention.k_layernorm.weight"] = Rule("copy", (att + "k_norm.weight",))
        rules.update(self._mlp_rules(hf, layer))
        return rules

    def _mlp_rules(self, hf: dict, layer: int) -> dict[str, Rule]:
        p, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
        if not self.moe:
            return {p + "linear_fc1.weight": Rule("glu", (h + "gate_proj.weight", h + "up_proj.weight")),
                    p + "linear_fc2.weight": Rule("copy", (h + "down_proj.weight",))}
        m = self.moe
        rules = {p + "router.weight": Rule("copy", (m.router.format(l=layer),))}
        for e in range(hf[m.num_experts_key]):
            q = f"{p}experts.local_experts.{e}."
            rules[q + "linear_fc1.weight"] = Rule("glu", (m.gate.format(l=layer, e=e), m.up.format(l=layer, e=e)))
            rules[q + "linear_fc2.weight"] = Rule("copy", (m.down.format(l=layer, e=e),))
        return rules

    def ignorable(self, hf: dict, name: str) -> bool:
        """HF tensors that carry no information of their own (tied lm_head copy, RoPE buffers)."""
        return name.endswith("rotary_emb.inv_freq") or (bool(hf.get("tie_word_embeddings"))
                                                        and name == "lm_head.weight")


def head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


# -- the three rule kinds, both directions ----------------------------------------------------------------
def to_mcore(rule: Rule, parts: list[torch.Tensor], hf: dict) -> torch.Tensor:
    """The canonical Megatron tensor from the rule's HF tensors (in rule.hf order)."""
    if rule.kind == "copy":
        return parts[0]
    if rule.kind == "glu":
        return torch.cat(parts, dim=0)  # [2 * ffn, hidden] = [gate; up]
    q, k, v = parts  # q [heads * d, ...], k/v [groups * d, ...]
    groups, d = hf.get("num_key_value_heads") or hf["num_attention_heads"], head_dim(hf)
    rest = q.shape[1:]
    per_group = [t.reshape(groups, -1, *rest) for t in (q, k, v)]  # [groups, (heads/groups) * d | d, ...]
    assert per_group[1].shape[1] == d, "k rows per group must equal head_dim"
    return torch.cat(per_group, dim=1).reshape(-1, *rest)  # [groups * (heads/groups + 2) * d, ...]


def to_hf(rule: Rule, tensor: torch.Tensor, hf: dict) -> list[torch.Tensor]:
    """The rule's HF tensors (in rule.hf order) from the canonical Megatron tensor."""
    if rule.kind == "copy":
        return [tensor]
    if rule.kind == "glu":
        return list(torch.chunk(tensor, 2, dim=0))
    heads, d = hf["num_attention_heads"], head_dim(hf)
    groups = hf.get("num_key_value_heads") or heads
    rest = tensor.shape[1:]
    t = tensor.reshape(groups, (heads // groups + 2) * d, *rest)
    q, k, v = torch.split(t, [heads // groups * d, d, d], dim=1)
    return [x.reshape(-1, *rest) for x in (q, k, v)]
