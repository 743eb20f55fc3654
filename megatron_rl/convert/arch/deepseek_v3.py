"""DeepSeek-V3 / Kimi-K2 (`DeepseekV3ForCausalLM`): multi-latent attention and a sigmoid-routed MoE.

Attention (Megatron-Core MLASelfAttention, every tensor a plain copy: both sides lay the heads out alike):
  q_a_proj -> linear_q_down_proj, q_a_layernorm -> q_layernorm, q_b_proj -> linear_q_up_proj (or q_proj ->
  linear_q_proj without q_lora_rank), kv_a_proj_with_mqa -> linear_kv_down_proj, kv_a_layernorm -> kv_layernorm,
  kv_b_proj -> linear_kv_up_proj, o_proj -> linear_proj. The RoPE dims are interleaved in the weights
  (rope_interleave = true); both HF and Megatron's MLA de-interleave them before rotating.
MoE: sigmoid scores, the expert choice biased by `e_score_correction_bias` (Megatron's router.expert_bias),
grouped top-k (n_group / topk_group; group score = sum of the top-2 scores, which Megatron's top-(k / topk_group)
equals when k = 2 * topk_group), weights renormalised and scaled by routed_scaling_factor; shared experts of
n_shared_experts * moe_intermediate_size; the first first_k_dense_replace layers dense (intermediate_size).
Kimi-K2 ships the same architecture under model_type `kimi_k2` (one group, 384 experts, YaRN x32).
Multi-token prediction (num_nextn_predict_layers = D, stored as layers n .. n + D - 1 for n = num_hidden_layers)
maps onto Megatron's MTP block (models/mtp.py): enorm, hnorm, eh_proj -> mtp.layers.i.{enorm, hnorm, eh_proj},
shared_head.norm -> mtp.layers.i.final_layernorm, the decoder layer's tensors -> mtp.layers.i.transformer_layer.*
(the same table as a decoder layer). Its embed_tokens and shared_head.head are copies of the model's embedding
and output layer (shared in Megatron): not read on import, written back on export. transformers' DeepseekV3
ignores the MTP layers. A folder whose config.json declares MTP layers but holds none of their tensors (a model
saved by transformers) converts without them (`drop_absent_mtp`).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import ConfigError
from megatron_rl.convert.arch.base import Arch, ConvertError, MoENames, Rule, hf_dtype, hf_rope_scaling, rope_scaling
from megatron_rl.models.gpt import MLAConfig, ModelConfig, MoEConfig

_HF_NORM_EPS = 1e-6
"""transformers' DeepseekV3 builds q_a_layernorm / kv_a_layernorm with this eps whatever rms_norm_eps says."""
_TRAINING_ONLY = ("aux_loss_alpha", "seq_aux", "ep_size")
"""Original DeepSeek config keys that do not change the forward pass."""


@dataclass(frozen=True)
class DeepseekV3Arch(Arch):
    """The DeepSeek-V3 table: Llama-style names where they agree, MLA and router names of its own."""

    aliases: tuple[str, ...] = ("kimi_k2",)
    """Other model_type values of the same architecture (transformers knows them as deepseek_v3)."""

    def model_config(self, hf: dict, dtype: str | None = None) -> tuple[ModelConfig, dict]:
        self.check_supported(hf)
        heads, n = hf["num_attention_heads"], hf["num_hidden_layers"]
        cfg = ModelConfig(
            num_layers=n, hidden_size=hf["hidden_size"], num_attention_heads=heads,
            ffn_hidden_size=hf["intermediate_size"], norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            vocab_size=hf["vocab_size"], max_seq_length=hf.get("max_position_embeddings", 4096),
            rotary_base=int(hf.get("rope_theta", 10000)), tie_embeddings=bool(hf.get("tie_word_embeddings")),
            rope_scaling=rope_scaling(hf, self.name), params_dtype=dtype or hf_dtype(hf),
            mla=MLAConfig(kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank"),
                          qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
                          v_head_dim=hf["v_head_dim"]),
            moe=self._moe_config(hf), mtp_num_layers=hf.get("num_nextn_predict_layers") or 0)
        try:
            cfg.validate()
            cfg.moe.validate()
        except ConfigError as e:
            raise ConvertError(f"{self.name}: {e}") from None
        return cfg, {}

    def _moe_config(self, hf: dict) -> MoEConfig:
        groups = hf.get("n_group") or 1
        shared = (hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"]
        return MoEConfig(num_experts=hf["n_routed_experts"], topk=hf["num_experts_per_tok"],
                         ffn_hidden_size=hf["moe_intermediate_size"], shared_expert_ffn_hidden_size=shared or None,
                         router_score_function="sigmoid", router_expert_bias=True,
                         router_num_groups=groups if groups > 1 else None,
                         router_group_topk=hf.get("topk_group") if groups > 1 else None,
                         routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
                         layer_pattern=self.moe_pattern(hf))

    def moe_pattern(self, hf: dict) -> list[int] | None:
        k = hf.get("first_k_dense_replace") or 0
        pattern = [int(i >= k) for i in range(hf["num_hidden_layers"])]
        return None if all(pattern) else pattern

    def check_supported(self, hf: dict) -> None:
        """Refuse DeepSeek-V3 variants this table would convert wrongly (each named)."""
        super().check_supported({k: v for k, v in hf.items() if k not in ("attention_bias",)})
        groups, keep, k = hf.get("n_group") or 1, hf.get("topk_group") or 1, hf["num_experts_per_tok"]
        bad = [f"{key}={hf[key]!r}" for key, ok in (
            ("attention_bias", lambda v: not v), ("rope_interleave", lambda v: v is not False),
            ("norm_topk_prob", lambda v: v is not False), ("scoring_func", lambda v: v in (None, "sigmoid")),
            ("topk_method", lambda v: v in (None, "noaux_tc")), ("moe_layer_freq", lambda v: v in (None, 1)),
            ("rms_norm_eps", lambda v: v is None or abs(v - _HF_NORM_EPS) < 1e-12)) if key in hf and not ok(hf[key])]
        if groups > 1 and k != 2 * keep:
            bad.append(f"num_experts_per_tok={k} with topk_group={keep} (HF ranks groups by their top-2 scores, "
                       f"Megatron by their top-(k / topk_group): equal only for k = 2 * topk_group)")
        if k == 1:
            bad.append("num_experts_per_tok=1 (HF renormalises a single sigmoid weight to 1, Megatron keeps it)")
        if hf.get("rope_scaling") and rope_scaling(hf, self.name).kind not in ("yarn",):
            bad.append(f"rope_scaling {hf['rope_scaling']} (multi-latent attention takes plain RoPE or YaRN)")
        if bad:
            raise ConvertError(f"{self.name}: unsupported HF config features: {', '.join(bad)}")

    def hf_config(self, cfg: ModelConfig, extra: dict) -> dict:
        mla, moe = cfg.mla, cfg.moe
        if not mla.enabled or moe.router_score_function != "sigmoid" or not moe.router_expert_bias:
            raise ConvertError(f"{self.name}: the checkpoint is not a DeepSeek-V3 model (MLA and sigmoid routing "
                               f"with an expert bias); export to an architecture that describes it")
        pattern = moe.layer_pattern or [1] * cfg.num_layers
        first = pattern.index(1) if 1 in pattern else cfg.num_layers
        if pattern != [0] * first + [1] * (cfg.num_layers - first):
            raise ConvertError(f"{self.name}: dense layers {pattern} other than the first k cannot be written")
        shared = moe.shared_expert_ffn_hidden_size or 0
        if shared % moe.ffn_hidden_size:
            raise ConvertError(f"{self.name}: shared expert size {shared} is not a multiple of the expert size")
        from megatron_rl.convert.arch.base import DTYPE_HF

        return {"architectures": [self.hf_architectures[0]], "model_type": self.model_type,
                "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
                "intermediate_size": cfg.ffn_hidden_size, "vocab_size": cfg.vocab_size,
                "max_position_embeddings": cfg.max_seq_length, "rope_theta": float(cfg.rotary_base),
                "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "rms_norm_eps": cfg.norm_epsilon,
                **dict.fromkeys(("dtype", "torch_dtype"), DTYPE_HF[cfg.params_dtype]),
                "rope_scaling": hf_rope_scaling(cfg), "rope_interleave": True, "attention_bias": False,
                "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
                "qk_nope_head_dim": mla.qk_head_dim, "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
                "v_head_dim": mla.v_head_dim, "n_routed_experts": moe.num_experts,
                "num_experts_per_tok": moe.topk, "moe_intermediate_size": moe.ffn_hidden_size,
                "n_shared_experts": shared // moe.ffn_hidden_size, "n_group": moe.router_num_groups or 1,
                "topk_group": moe.router_group_topk or 1, "routed_scaling_factor": moe.routed_scaling_factor or 1.0,
                "norm_topk_prob": True, "first_k_dense_replace": first,
                "num_nextn_predict_layers": cfg.mtp_num_layers}

    def layer_rules(self, hf: dict, layer: int) -> dict[str, Rule]:
        p, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        a, s = p + "self_attention.", h + "self_attn."
        rules = {p + "input_layernorm.weight": Rule("copy", (h + "input_layernorm.weight",)),
                 p + "pre_mlp_layernorm.weight": Rule("copy", (h + "post_attention_layernorm.weight",)),
                 a + "linear_kv_down_proj.weight": Rule("copy", (s + "kv_a_proj_with_mqa.weight",)),
                 a + "kv_layernorm.weight": Rule("copy", (s + "kv_a_layernorm.weight",)),
                 a + "linear_kv_up_proj.weight": Rule("copy", (s + "kv_b_proj.weight",)),
                 a + "linear_proj.weight": Rule("copy", (s + "o_proj.weight",))}
        if hf.get("q_lora_rank"):
            rules.update({a + "linear_q_down_proj.weight": Rule("copy", (s + "q_a_proj.weight",)),
                          a + "q_layernorm.weight": Rule("copy", (s + "q_a_layernorm.weight",)),
                          a + "linear_q_up_proj.weight": Rule("copy", (s + "q_b_proj.weight",))})
        else:
            rules[a + "linear_q_proj.weight"] = Rule("copy", (s + "q_proj.weight",))
        rules.update(self._mlp_rules(hf, layer))
        pattern = self.moe_pattern(hf)
        if pattern is None or layer >= len(pattern) or pattern[layer]:  # (the MTP layers: like the last, MoE)
            rules[p + "mlp.router.expert_bias"] = Rule("copy", (h + "mlp.gate.e_score_correction_bias",))
        return rules

    def expected_shape(self, name: str, hf: dict) -> tuple[int, ...] | None:
        """Shape of an MLA / router-bias tensor under config.json (None: the generic table's)."""
        heads, h, q = hf["num_attention_heads"], hf["hidden_size"], hf.get("q_lora_rank")
        kv, nope, rope, v = hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
        table = {"q_a_proj.weight": (q, h), "q_a_layernorm.weight": (q,), "q_b_proj.weight": (heads * (nope + rope), q),
                 "q_proj.weight": (heads * (nope + rope), h), "kv_a_proj_with_mqa.weight": (kv + rope, h),
                 "kv_a_layernorm.weight": (kv,), "kv_b_proj.weight": (heads * (nope + v), kv),
                 "o_proj.weight": (h, heads * v), "e_score_correction_bias": (hf["n_routed_experts"],),
                 "eh_proj.weight": (h, 2 * h)}
        return next((shp for suffix, shp in table.items() if name.endswith("." + suffix)), None)

    def global_rules(self, hf: dict) -> dict[str, Rule]:
        """Also the multi-token-prediction layers (Megatron's `mtp.layers.i.*`, outside the decoder's layers)."""
        rules = super().global_rules(hf)
        n = hf["num_hidden_layers"]
        for i in range(hf.get("num_nextn_predict_layers") or 0):
            p, h = f"mtp.layers.{i}.", f"model.layers.{n + i}."
            rules.update({p + "enorm.weight": Rule("copy", (h + "enorm.weight",)),
                          p + "hnorm.weight": Rule("copy", (h + "hnorm.weight",)),
                          p + "eh_proj.weight": Rule("copy", (h + "eh_proj.weight",)),
                          p + "final_layernorm.weight": Rule("copy", (h + "shared_head.norm.weight",))})
            own = f"decoder.layers.{n + i}."
            rules.update({p + "transformer_layer." + k.removeprefix(own): r
                          for k, r in self.layer_rules(hf, n + i).items()})
        return rules

    def shared_copies(self, hf: dict) -> dict[str, list[str]]:
        """Each MTP layer's embed_tokens and shared_head.head: copies of the embedding and the output layer."""
        n, out = hf["num_hidden_layers"], {}
        head = "embedding.word_embeddings.weight" if hf.get("tie_word_embeddings") else "output_layer.weight"
        for i in range(hf.get("num_nextn_predict_layers") or 0):
            out.setdefault("embedding.word_embeddings.weight", []).append(f"model.layers.{n + i}.embed_tokens.weight")
            out.setdefault(head, []).append(f"model.layers.{n + i}.shared_head.head.weight")
        return out

    def ignorable(self, hf: dict, name: str) -> bool:
        """Also the MTP layers' copies of the embedding and the output layer (the model's own are read)."""
        return name in {c for names in self.shared_copies(hf).values() for c in names} or \
            super().ignorable(hf, name)


def drop_absent_mtp(hf: dict, names) -> dict:
    """The config as the weights have it: num_nextn_predict_layers 0 when no tensor of an MTP layer exists."""
    n, d = hf.get("num_hidden_layers"), hf.get("num_nextn_predict_layers") or 0
    if not d or any(x.startswith(f"model.layers.{n + i}.") for x in names for i in range(d)):
        return hf
    return {**hf, "num_nextn_predict_layers": 0}


ARCH = DeepseekV3Arch(
    name="deepseek_v3", hf_architectures=("DeepseekV3ForCausalLM",), model_type="deepseek_v3",
    qkv_bias=lambda hf: False,
    moe=MoENames(router="model.layers.{l}.mlp.gate.weight",
                 gate="model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
                 up="model.layers.{l}.mlp.experts.{e}.up_proj.weight",
                 down="model.layers.{l}.mlp.experts.{e}.down_proj.weight",
                 num_experts_key="n_routed_experts", ffn_key="moe_intermediate_size",
                 renormalize_key="norm_topk_prob", renormalize_default=True, mixed_layers=True,
                 shared="model.layers.{l}.mlp.shared_experts."))
