"""What an architecture table is: HF tensor names of a Llama-style decoder, dense or MoE.

A `Rule` says how one canonical Megatron tensor is made from HF tensors:
  copy  one HF tensor, same shape
  qkv   Megatron's fused QKV, interleaved per query group: [q heads of group g, k_g, v_g] for g in groups
  glu   Megatron's fused gated MLP input projection: concat(gate, up) along the output dimension
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_rl.models.gpt import ModelConfig, MoEConfig, RopeScaling

_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPE_HF = {v: k for k, v in _DTYPE_NAMES.items()}
# the ModelConfig fields a checkpoint's config.json decides (model.init: the run may not set them differently)
ARCH_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "norm_epsilon",
               "ffn_hidden_size", "vocab_size", "rotary_base", "rope_scaling", "sliding_window",
               "sliding_window_layers", "tie_embeddings", "qkv_bias", "qk_layernorm", "normalization", "activation",
               "position_embedding", "moe", "mla", "mtp_num_layers")


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
    renormalize_key: str | None = None
    """HF config key saying whether the top-k probabilities are renormalised (None: always, Mixtral)."""
    renormalize_default: bool = False
    """Its default in the HF config class."""
    shared: str | None = None
    """Shared-expert prefix ({l}) holding gate_proj/up_proj/down_proj (Qwen2-MoE); None: no shared expert."""
    shared_gate: str | None = None
    """Shared-expert sigmoid gate weight [1, hidden] ({l})."""
    shared_ffn_key: str | None = None
    """HF config key of the shared expert's hidden size."""
    mixed_layers: bool = False
    """The HF config may make some layers dense (mlp_only_layers / decoder_sparse_step)."""

    def renormalize(self, hf: dict) -> bool:
        return True if self.renormalize_key is None else bool(hf.get(self.renormalize_key,
                                                                      self.renormalize_default))


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
    window: str = "none"
    """Sliding-window style of the HF config: none (refused if set), all (`sliding_window` on every layer:
    Mistral, Mixtral), qwen (`use_sliding_window`; layers from `layer_types` or >= `max_window_layers`),
    qwen_all (`use_sliding_window`, every layer: Qwen3-MoE)."""
    qkv_bias_key: str | None = None
    """config.json key written for qkv_bias by hf_config (None: none written)."""
    hf_defaults: dict = field(default_factory=dict)
    """Extra config.json entries written when only the architecture name is known."""

    # -- config ----------------------------------------------------------------------------------------
    def model_config(self, hf: dict, dtype: str | None = None) -> tuple[ModelConfig, dict]:
        """(ModelConfig, TransformerConfig overrides) for an HF config.json; the ModelConfig is complete
        (the overrides are empty for every supported architecture)."""
        self.check_supported(hf)
        heads = hf["num_attention_heads"]
        window, window_layers = self.sliding_window(hf)
        cfg = ModelConfig(
            num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
            head_dim=head_dim(hf), norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            vocab_size=hf["vocab_size"], max_seq_length=hf.get("max_position_embeddings", 4096),
            rotary_base=int(hf.get("rope_theta", 10000)), tie_embeddings=bool(hf.get("tie_word_embeddings")),
            qkv_bias=self.qkv_bias(hf), qk_layernorm=self.qk_norm, rope_scaling=rope_scaling(hf, self.name),
            sliding_window=window, sliding_window_layers=window_layers,
            params_dtype=dtype or hf_dtype(hf))
        if self.moe:
            m = self.moe
            cfg.moe = MoEConfig(num_experts=hf[m.num_experts_key], topk=hf["num_experts_per_tok"],
                                ffn_hidden_size=hf[m.ffn_key], router_pre_softmax=not m.renormalize(hf),
                                layer_pattern=self.moe_pattern(hf))
            if m.shared:
                cfg.moe.shared_expert_ffn_hidden_size = hf[m.shared_ffn_key]
                cfg.moe.shared_expert_gate = True
        cfg.validate()
        cfg.moe.validate()
        return cfg, {}

    def moe_pattern(self, hf: dict) -> list[int] | None:
        """1 = MoE layer, 0 = dense (HF: not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0)."""
        if not (self.moe and self.moe.mixed_layers):
            return None
        dense, step = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step") or 1
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
        return None if all(pattern) else pattern

    def sliding_window(self, hf: dict) -> tuple[int | None, list[int] | None]:
        """(window, per-layer 0/1 pattern or None for all layers) the HF model applies."""
        n = hf["num_hidden_layers"]
        if self.window == "all":
            return hf.get("sliding_window"), None
        if self.window in ("qwen", "qwen_all") and hf.get("use_sliding_window") and hf.get("sliding_window"):
            if self.window == "qwen_all":
                return hf["sliding_window"], None
            types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28)
                                              else "full_attention" for i in range(n)]
            layers = [int(t == "sliding_attention") for t in types]
            return (hf["sliding_window"], None if all(layers) else layers) if any(layers) else (None, None)
        return None, None

    def check_supported(self, hf: dict) -> None:
        """Refuse HF features these tables do not map (rather than convert them wrongly)."""
        bad = []
        if hf.get("hidden_act", "silu") != "silu":
            bad.append(f"hidden_act={hf['hidden_act']}")
        if hf.get("mlp_bias"):
            bad.append("mlp_bias=true")
        if hf.get("attention_bias") and self.model_type in ("llama", "mistral", "mixtral"):
            bad.append("attention_bias=true (o_proj bias is not mapped)")
        q = hf.get("quantization_config")
        if q and not (q.get("quant_method") == "fp8" and len(q.get("weight_block_size") or []) == 2):
            bad.append(f"quantization_config {q} (only FP8 block-scaled weights are dequantized on import)")
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            bad.append(f"partial_rotary_factor={hf['partial_rotary_factor']}")
        if self.window == "none" and (hf.get("use_sliding_window") or (
                hf.get("sliding_window") and "use_sliding_window" not in hf)):
            bad.append(f"sliding_window={hf.get('sliding_window')} (this architecture's HF code applies it "
                       f"inconsistently across attention implementations)")
        if self.moe and not self.moe.mixed_layers and (hf.get("mlp_only_layers") or
                                                       hf.get("decoder_sparse_step", 1) != 1):
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
               "rms_norm_eps": extra.get("layernorm_epsilon", cfg.norm_epsilon),
               "head_dim": extra.get("kv_channels") or cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads,
               **dict.fromkeys(("dtype", "torch_dtype"), DTYPE_HF[cfg.params_dtype]),
               "rope_scaling": hf_rope_scaling(cfg), **self.hf_defaults}
        if self.qkv_bias_key:
            out[self.qkv_bias_key] = cfg.qkv_bias
        out.update(self._hf_window(cfg))
        if self.moe:
            out.update(self._hf_moe(cfg))
        return out

    def _hf_window(self, cfg: ModelConfig) -> dict:
        w, layers = cfg.sliding_window, cfg.sliding_window_layers
        if self.window == "all" and (layers is None or all(layers)):
            return {"sliding_window": w}
        if self.window == "qwen":
            layers = [1] * cfg.num_layers if layers is None else list(layers)
            return {"use_sliding_window": bool(w), "sliding_window": w, "max_window_layers": (
                    layers.index(1) if 1 in layers else cfg.num_layers),
                    "layer_types": [("sliding_attention" if (w and x) else "full_attention") for x in layers]}
        if self.window == "qwen_all" and (layers is None or all(layers)):
            return {"use_sliding_window": bool(w), "sliding_window": w}
        if w:
            raise ConvertError(f"{self.name}: a sliding window on layers {layers} cannot be written in its "
                               f"config.json; export to an architecture that can say it")
        return {}

    def _hf_moe(self, cfg: ModelConfig) -> dict:
        m, moe = self.moe, cfg.moe
        out = {m.num_experts_key: moe.num_experts, "num_experts_per_tok": moe.topk,
               m.ffn_key: moe.ffn_hidden_size or cfg.ffn_hidden_size}
        if m.renormalize_key:
            out[m.renormalize_key] = not moe.router_pre_softmax
        elif moe.router_pre_softmax:
            raise ConvertError(f"{self.name}: routing without renormalisation cannot be written in its config")
        if m.mixed_layers:
            pattern = moe.layer_pattern or [1] * cfg.num_layers
            out.update(mlp_only_layers=[i for i, x in enumerate(pattern) if not x], decoder_sparse_step=1)
        elif moe.layer_pattern is not None and not all(moe.layer_pattern):
            raise ConvertError(f"{self.name}: dense layers in a MoE model cannot be written in its config")
        if bool(m.shared) != bool(moe.shared_expert_ffn_hidden_size) or (m.shared and not moe.shared_expert_gate):
            raise ConvertError(f"{self.name}: the checkpoint's shared expert (size "
                               f"{moe.shared_expert_ffn_hidden_size}, gate {moe.shared_expert_gate}) does not "
                               f"fit this architecture")
        if m.shared:
            out[m.shared_ffn_key] = moe.shared_expert_ffn_hidden_size
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
        pattern = self.moe_pattern(hf)
        if not self.moe or (pattern is not None and layer < len(pattern) and not pattern[layer]):
            return {p + "linear_fc1.weight": Rule("glu", (h + "gate_proj.weight", h + "up_proj.weight")),
                    p + "linear_fc2.weight": Rule("copy", (h + "down_proj.weight",))}
        m = self.moe
        rules = {p + "router.weight": Rule("copy", (m.router.format(l=layer),))}
        for e in range(hf[m.num_experts_key]):
            q = f"{p}experts.local_experts.{e}."
            rules[q + "linear_fc1.weight"] = Rule("glu", (m.gate.format(l=layer, e=e), m.up.format(l=layer, e=e)))
            rules[q + "linear_fc2.weight"] = Rule("copy", (m.down.format(l=layer, e=e),))
        if m.shared:
            s, q = m.shared.format(l=layer), p + "shared_experts."
            rules[q + "linear_fc1.weight"] = Rule("glu", (s + "gate_proj.weight", s + "up_proj.weight"))
            rules[q + "linear_fc2.weight"] = Rule("copy", (s + "down_proj.weight",))
            if m.shared_gate:
                rules[q + "gate_weight"] = Rule("copy", (m.shared_gate.format(l=layer),))
        return rules

    def expected_shape(self, name: str, hf: dict) -> tuple[int, ...] | None:
        """Shape of an HF tensor this architecture names itself (None: the generic table's, checks.py)."""
        return None

    def shared_copies(self, hf: dict) -> dict[str, list[str]]:
        """Canonical tensor -> further HF names holding a copy of it (written on export, not read on import)."""
        return {}

    def ignorable(self, hf: dict, name: str) -> bool:
        """HF tensors that carry no information of their own (tied lm_head copy, RoPE buffers)."""
        return name.endswith("rotary_emb.inv_freq") or (bool(hf.get("tie_word_embeddings"))
                                                        and name == "lm_head.weight") or (
            name.endswith(".weight_scale_inv") and bool(hf.get("quantization_config")))  # read with the weight


def head_dim(hf: dict) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def hf_dtype(hf: dict) -> str:
    """Parameter dtype of an HF config (transformers >= 4.56 writes `dtype`, older ones `torch_dtype`)."""
    name = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ConvertError(f"config.json dtype {name!r} is not one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


_ROPE_KEYS = {"linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings"},
              "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "truncate", "attention_factor"}}


def rope_scaling(hf: dict, arch: str = "") -> RopeScaling:
    """HF `rope_scaling` as Megatron-Core RoPE settings; refuses kinds Megatron cannot express."""
    rs = dict(hf.get("rope_scaling") or {})
    kind = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
    rs.pop("type", None)
    if kind == "default":
        return RopeScaling()
    if kind not in _ROPE_KEYS:
        raise ConvertError(f"{arch}: rope_scaling type {kind!r} is not supported (Megatron-Core expresses "
                           f"default, linear, llama3 and yarn)")
    unknown = sorted(set(rs) - _ROPE_KEYS[kind])
    if unknown:
        raise ConvertError(f"{arch}: rope_scaling {kind} has keys {unknown} that are not mapped")
    factor = float(rs["factor"])
    if kind == "linear":
        return RopeScaling(kind="linear", factor=factor)
    orig = rs.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    if kind == "llama3":
        return RopeScaling(kind="llama3", factor=factor, low_freq_factor=float(rs["low_freq_factor"]),
                           high_freq_factor=float(rs["high_freq_factor"]), original_max_position_embeddings=orig)
    out = RopeScaling(kind="yarn", factor=factor, original_max_position_embeddings=orig,
                      beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                      mscale=rs.get("mscale"), mscale_all_dim=rs.get("mscale_all_dim"),
                      truncate=bool(rs.get("truncate", True)))
    if rs.get("attention_factor") is not None and abs(rs["attention_factor"] - yarn_attention_factor(out)) > 1e-9:
        raise ConvertError(f"{arch}: rope_scaling yarn attention_factor={rs['attention_factor']} differs from the "
                           f"one Megatron-Core derives from factor/mscale ({yarn_attention_factor(out):g})")
    return out


def yarn_attention_factor(rs: RopeScaling) -> float:
    def get(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rs.mscale and rs.mscale_all_dim:
        return get(rs.factor, rs.mscale) / get(rs.factor, rs.mscale_all_dim)
    return get(rs.factor)


def hf_rope_scaling(cfg: ModelConfig) -> dict | None:
    """The HF `rope_scaling` entry of `cfg` (None without scaling)."""
    rs = cfg.rope_scaling
    if rs.kind == "none":
        return None
    out = {"rope_type": rs.kind, "factor": rs.factor}
    if rs.kind == "llama3":
        out.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                   original_max_position_embeddings=rs.original_max_position_embeddings)
    if rs.kind == "yarn":
        out.update(original_max_position_embeddings=rs.original_max_position_embeddings, beta_fast=rs.beta_fast,
                   beta_slow=rs.beta_slow, truncate=rs.truncate)
        out.update({k: v for k, v in (("mscale", rs.mscale), ("mscale_all_dim", rs.mscale_all_dim)) if v})
    return out


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


def all_rules(arch: Arch, hf: dict) -> dict[str, Rule]:
    """Every rule of `arch` for the HF config `hf`: the global tensors' and each layer's."""
    rules = dict(arch.global_rules(hf))
    for layer in range(hf["num_hidden_layers"]):
        rules.update(arch.layer_rules(hf, layer))
    return rules
