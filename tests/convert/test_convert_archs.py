"""Converter features of real checkpoints, each on a tiny random HF model built locally: RoPE scaling
(linear, llama3, yarn, default), sliding windows, the source dtype, top-1 routing, Qwen3-MoE routing without
renormalisation, mixed dense/MoE layers, Qwen2-MoE's gated shared expert; and the refusals.

Each conversion is checked by `--verify` (logits on 4 x 128 tokens vs the HF model, written config vs the
source) and, where the feature changes the logits, the test also shows that the HF model's logits without
the feature differ (so a converter ignoring it would fail).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.mp.convert_models import KIMI_K2, hf_tensors, make_hf_model
from tests.convert.test_convert import run_err, run_ok

pytestmark = pytest.mark.slow
TOL = 1e-4


def hf_logits(path: Path, **config_changes) -> torch.Tensor:
    """Logits of the HF model in `path` on the verify tokens, with config entries changed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.convert.verify import tokens

    cfg = AutoConfig.from_pretrained(path, **config_changes)
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(tokens(cfg.vocab_size)).logits


def assert_feature_matters(path: Path, **without) -> None:
    diff = (hf_logits(path) - hf_logits(path, **without)).abs().max().item()
    assert diff > 1e-3, f"the test model does not exercise the feature ({without}): logits differ by {diff}"


def assert_same_inv_freq(hf: Path, capsys) -> None:
    """Megatron's RoPE frequencies (with positions scaled as Megatron scales them) equal HF's."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_rl.convert import layout, runtime
    from megatron_rl.convert.arch import for_hf_config

    src = json.loads((hf / "config.json").read_text())
    cfg, extra = for_hf_config(src).model_config(src)
    rot = layout.build_model(cfg, extra, runtime.start()).rotary_pos_emb
    ours = rot.get_freqs_non_repeated(2)[1]  # position 1: [dim/2] angles = inv_freq (/ interpolation factor)
    conf = AutoConfig.from_pretrained(hf)
    theirs, _ = ROPE_INIT_FUNCTIONS[conf.rope_scaling["rope_type"]](conf, "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)


def convert_both_ways(hf: Path, tmp: Path, capsys, arch_name: str | None = None) -> tuple[dict, dict]:
    """hf-to-mcore --verify, then mcore-to-hf --verify (by architecture name when given); tensors bitwise."""
    a = run_ok(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp / "mc"), "--verify"], capsys)
    assert a["verify"]["max_abs_logit_diff"] <= TOL and a["dtype_casts"] == []
    argv = ["mcore-to-hf", "--ckpt", str(tmp / "mc"), "--out", str(tmp / "hf2"), "--verify"]
    b = run_ok(argv + (["--hf-config", arch_name] if arch_name else []), capsys)
    assert b["verify"]["max_abs_logit_diff"] <= TOL and b["verify"]["config"]["same_model_config"]
    x, y = hf_tensors(hf), hf_tensors(tmp / "hf2")
    assert sorted(x) == sorted(y) and [k for k in x if not torch.equal(x[k], y[k])] == []
    return a, json.loads((tmp / "hf2" / "config.json").read_text())


def written_logits_diff(tmp: Path, src: Path) -> float:
    return (hf_logits(tmp / "hf2") - hf_logits(src)).abs().max().item()


# -- RoPE scaling ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.1's own values: Megatron's built-in limits
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},  # other band limits: recomputed with Megatron's _apply_scaling
    {"rope_type": "linear", "factor": 4.0},
], ids=["llama3-8192", "llama3-64", "linear"])
def test_llama_rope_scaling(rope, tmp_path, capsys):
    hf = make_hf_model("llama", tmp_path / "hf", rope_scaling=rope, head_dim=16, num_attention_heads=2,
                       num_key_value_heads=1)
    if rope["original_max_position_embeddings" if "llama3" in rope["rope_type"] else "rope_type"] != 8192:
        assert_feature_matters(hf, rope_scaling=None)  # 8192: the scaled bands only show past ~2k tokens
    assert_same_inv_freq(hf, capsys)
    _, cfg = convert_both_ways(hf, tmp_path, capsys, "llama")
    assert cfg["rope_scaling"] == {k: v for k, v in rope.items()}
    assert written_logits_diff(tmp_path, hf) <= TOL


def test_qwen3_yarn(tmp_path, capsys):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    hf = make_hf_model("qwen3", tmp_path / "hf", rope_scaling=rope)
    assert_feature_matters(hf, rope_scaling=None)
    _, cfg = convert_both_ways(hf, tmp_path, capsys, "qwen3")
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 4.0
    assert written_logits_diff(tmp_path, hf) <= TOL


def test_yarn_with_mscale(tmp_path, capsys):
    """DeepSeek-style mscale / mscale_all_dim: Megatron's concentration factor equals HF's attention factor."""
    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 1.0,
            "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}
    hf = make_hf_model("qwen2", tmp_path / "hf", rope_scaling=rope)
    rep = run_ok(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--verify"], capsys)
    assert rep["verify"]["max_abs_logit_diff"] <= TOL


def test_default_rope_type_is_plain_rope(tmp_path, capsys):
    hf = make_hf_model("qwen2", tmp_path / "hf", rope_scaling={"rope_type": "default"})
    rep = run_ok(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--verify"], capsys)
    assert rep["verify"]["max_abs_logit_diff"] <= TOL


@pytest.mark.parametrize("rope, words", [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.0}, "attention_factor=2.0 differs"),
    ({"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0], "long_factor": [1.0]}, "'longrope'"),
])
def test_rope_kinds_megatron_cannot_express_are_refused(rope, words, tmp_path, capsys):
    hf = make_hf_model("llama", tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "rope_scaling": rope}))
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    assert words in err and not (tmp_path / "mc").exists()


# -- sliding windows ---------------------------------------------------------------------------------------
FULL = dict(sliding_window=None, use_sliding_window=False, layer_types=["full_attention"] * 2)


@pytest.mark.parametrize("arch, kw", [
    ("mixtral", dict(sliding_window=32)),
    ("mistral", dict(sliding_window=32)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1)),  # layer 0 full, 1 windowed
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=32)),
])
def test_sliding_window_in_effect(arch, kw, tmp_path, capsys):
    hf = make_hf_model(arch, tmp_path / "hf", **kw)
    assert_feature_matters(hf, **FULL)
    _, cfg = convert_both_ways(hf, tmp_path, capsys, arch)
    assert cfg["sliding_window"] == 32
    assert written_logits_diff(tmp_path, hf) <= TOL


def test_qwen2_moe_sliding_window_is_refused(tmp_path, capsys):
    hf = make_hf_model("qwen2_moe", tmp_path / "hf", use_sliding_window=True, sliding_window=32)
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    assert "qwen2_moe" in err and "sliding_window=32" in err


# -- dtype -------------------------------------------------------------------------------------------------
def test_bf16_checkpoint_stays_bf16(tmp_path, capsys):
    hf = make_hf_model("llama", tmp_path / "hf", dtype=torch.bfloat16)
    src = json.loads((hf / "config.json").read_text())
    assert src.get("dtype") == "bfloat16" and "torch_dtype" not in src  # transformers 4.57's key
    rep = run_ok(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--verify"], capsys)
    assert rep["dtype_casts"] == [] and rep["verify"]["max_abs_logit_diff"] <= 5e-2
    rep = run_ok(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"), "--hf-config",
                  "llama", "--verify"], capsys)
    assert rep["dtype"] == "bfloat16" and rep["verify"]["dtypes"] == ["BF16"]
    out = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert out["dtype"] == out["torch_dtype"] == "bfloat16"
    x, y = hf_tensors(hf), hf_tensors(tmp_path / "hf2")
    assert all(y[k].dtype == torch.bfloat16 and torch.equal(x[k], y[k]) for k in x)


# -- routing -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, kw", [
    ("mixtral", dict(num_experts_per_tok=1)),
    ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=True)),  # weight 1: softmax after top-1
    ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=False)),  # weight p: pre-softmax
], ids=["mixtral", "qwen3_moe-norm", "qwen3_moe-nonorm"])
def test_top1_routing(arch, kw, tmp_path, capsys):
    hf = make_hf_model(arch, tmp_path / "hf", **kw)
    convert_both_ways(hf, tmp_path, capsys, arch)
    assert written_logits_diff(tmp_path, hf) <= TOL


def test_qwen3_moe_without_topk_renormalisation_exports_it(tmp_path, capsys):
    hf = make_hf_model("qwen3_moe", tmp_path / "hf", norm_topk_prob=False)
    assert_feature_matters(hf, norm_topk_prob=True)
    _, cfg = convert_both_ways(hf, tmp_path, capsys, "qwen3_moe")
    assert cfg["norm_topk_prob"] is False
    assert written_logits_diff(tmp_path, hf) <= TOL


def test_written_config_is_compared_with_the_source(tmp_path):
    from megatron_rl.convert.arch.base import ConvertError
    from megatron_rl.convert.verify import check_written_config

    hf = make_hf_model("qwen3_moe", tmp_path / "hf", norm_topk_prob=False)
    src = json.loads((hf / "config.json").read_text())
    (tmp_path / "w.json").write_text(json.dumps({**src, "norm_topk_prob": True}))
    with pytest.raises(ConvertError, match="router_pre_softmax"):
        check_written_config(tmp_path / "w.json", src)
    (tmp_path / "w.json").write_text(json.dumps({**src, "rope_theta": 5e5}))
    with pytest.raises(ConvertError, match="rotary_base"):
        check_written_config(tmp_path / "w.json", src)
    assert check_written_config(hf / "config.json", src)["same_model_config"]


# -- mixed dense / MoE layers and shared experts -----------------------------------------------------------
@pytest.mark.parametrize("arch, kw", [
    ("qwen3_moe", dict(num_hidden_layers=4, mlp_only_layers=[0, 2])),
    ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2)),  # layers 1 and 3 MoE
    ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
], ids=["mlp_only_layers", "decoder_sparse_step", "qwen2_moe-mixed"])
def test_mixed_dense_and_moe_layers(arch, kw, tmp_path, capsys):
    hf = make_hf_model(arch, tmp_path / "hf", **kw)
    names = hf_tensors(hf)
    dense = [i for i in range(kw["num_hidden_layers"]) if f"model.layers.{i}.mlp.gate_proj.weight" in names]
    assert dense and len(dense) < kw["num_hidden_layers"]
    _, cfg = convert_both_ways(hf, tmp_path, capsys, arch)
    assert cfg["mlp_only_layers"] == dense and cfg["decoder_sparse_step"] == 1
    assert written_logits_diff(tmp_path, hf) <= TOL


def test_qwen2_moe_shared_expert_gate(tmp_path, capsys):
    hf = make_hf_model("qwen2_moe", tmp_path / "hf")
    rep, cfg = convert_both_ways(hf, tmp_path, capsys, "qwen2_moe")
    assert cfg["shared_expert_intermediate_size"] == 24 and cfg["norm_topk_prob"] is False
    assert written_logits_diff(tmp_path, hf) <= TOL
    # the gate matters: zeroing it (sigmoid 0.5 everywhere) changes the HF logits beyond the tolerance
    from safetensors.torch import load_file, save_file

    index = json.loads((hf / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    shard = hf / index["weight_map"][name]
    before = hf_logits(hf)
    tensors = load_file(shard)
    save_file({**tensors, name: torch.zeros_like(tensors[name])}, shard, metadata={"format": "pt"})
    assert (hf_logits(hf) - before).abs().max().item() > 1e-3


# -- FP8 block-scaled checkpoints (DeepSeek-V3's format) ----------------------------------------------------
BLOCK = (16, 16)


def quantize_fp8_folder(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """Write `src` as DeepSeek-V3 does: projection weights float8_e4m3fn with one fp32 `weight_scale_inv`
    per 16x16 block (amax / 448); returns the dequantized weights (the test's own reference)."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    tensors, out, ref = hf_tensors(src), {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            bo, bi = BLOCK
            blocks = w.reshape(w.shape[0] // bo, bo, w.shape[1] // bi, bi)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # [out/16, in/16]
            q = (blocks / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
            out[name], out[name + "_scale_inv"] = q, scale
            ref[name] = (q.float().reshape(blocks.shape) * scale[:, None, :, None]).reshape(w.shape)
        else:
            out[name] = ref[name] = w
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").unlink()
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return ref


def test_fp8_block_scaled_weights_are_dequantized_on_import(tmp_path, capsys):
    src = make_hf_model("qwen3", tmp_path / "src")
    ref = quantize_fp8_folder(src, tmp_path / "fp8")
    orig = hf_tensors(src)["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(ref["model.layers.0.mlp.up_proj.weight"], orig)  # fp8 really lost bits
    rep = run_ok(["hf-to-mcore", "--hf", str(tmp_path / "fp8"), "--out", str(tmp_path / "mc"), "--verify"],
                 capsys)
    assert rep["verify"]["max_abs_logit_diff"] <= TOL and rep["dtype_casts"] == []
    rep = run_ok(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"), "--verify"],
                 capsys)
    assert rep["verify"]["max_abs_logit_diff"] <= TOL
    got = hf_tensors(tmp_path / "hf2")
    assert sorted(got) == sorted(ref) and [k for k in ref if not torch.equal(ref[k], got[k])] == []
    assert "quantization_config" not in json.loads((tmp_path / "hf2" / "config.json").read_text())


def test_other_quantization_is_refused(tmp_path, capsys):
    hf = make_hf_model("llama", tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    assert "gptq" in err and "only FP8 block-scaled" in err


# -- DeepSeek-V3 / Kimi-K2 ---------------------------------------------------------------------------------
def ref_logits(path: Path, zero_bias: bool = False, **config_changes) -> torch.Tensor:
    """HF logits read through the converter's reference config (Kimi-K2's model_type kimi_k2 included)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.convert.verify import reference_config, tokens

    cfg = reference_config({**json.loads((path / "config.json").read_text()), **config_changes})
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, torch_dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if zero_bias and name.endswith("e_score_correction_bias"):
                b.zero_()
        return model(tokens(cfg.vocab_size)).logits


def assert_dsv3_features_matter(path: Path, *changes: dict, least: float = 1e-3) -> None:
    """Each change (and zeroing the expert bias) moves the HF logits by more than `least` (> 5 x TOL)."""
    base = ref_logits(path)
    for change in [*changes, "expert bias"]:
        other = ref_logits(path, zero_bias=True) if change == "expert bias" else ref_logits(path, **change)
        diff = (other - base).abs().max().item()
        assert diff > least, f"the test model does not exercise {change}: logits differ by {diff}"


def test_deepseek_v3_mla_sigmoid_router_grouped_topk(tmp_path, capsys):
    """MLA (q/kv latents, decoupled interleaved RoPE, YaRN with mscale), sigmoid routing with the expert bias,
    grouped top-k, routed scaling, a shared expert, the first layer dense: both ways exact, by name too."""
    hf = make_hf_model("deepseek_v3", tmp_path / "hf")
    assert_dsv3_features_matter(hf, dict(routed_scaling_factor=1.0), dict(n_group=1, topk_group=1),
                                dict(rope_scaling=None), dict(first_k_dense_replace=0))
    rep, cfg = convert_both_ways(hf, tmp_path, capsys, "deepseek_v3")
    assert rep["arch"] == "deepseek_v3"
    src = json.loads((hf / "config.json").read_text())
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
            "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
            "num_experts_per_tok", "moe_intermediate_size", "intermediate_size")
    assert {k: cfg[k] for k in keys} == {k: src[k] for k in keys}
    assert {k: cfg["rope_scaling"][k] for k in src["rope_scaling"]} == src["rope_scaling"]
    assert written_logits_diff(tmp_path, hf) <= TOL


def test_kimi_k2_variant(tmp_path, capsys):
    """Kimi-K2's config.json: the same class under model_type kimi_k2, one expert group, two shared experts,
    YaRN x32, scaling 2.827 (and here no q latent): both ways exact; the export keeps its config."""
    hf = make_hf_model("deepseek_v3", tmp_path / "hf", **KIMI_K2)
    assert json.loads((hf / "config.json").read_text())["model_type"] == "kimi_k2"
    assert_dsv3_features_matter(hf, dict(routed_scaling_factor=1.0), dict(rope_scaling=None), least=5e-4)
    _, cfg = convert_both_ways(hf, tmp_path, capsys)
    assert cfg["model_type"] == "kimi_k2" and cfg["n_group"] == 1 and cfg["q_lora_rank"] is None
    assert (ref_logits(tmp_path / "hf2") - ref_logits(hf)).abs().max().item() <= TOL
    rep = run_ok(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf3"), "--hf-config",
                  "deepseek_v3", "--verify"], capsys)
    assert rep["verify"]["max_abs_logit_diff"] <= TOL
    assert json.loads((tmp_path / "hf3" / "config.json").read_text())["model_type"] == "deepseek_v3"


def add_mtp_layer(hf: Path, seed: int = 1) -> Path:
    """DeepSeek-V3's multi-token-prediction module as its checkpoints store it (transformers writes none): layer
    n = num_hidden_layers holds enorm, hnorm, eh_proj, shared_head.norm, a full decoder layer (here layer n-1's
    tensors, perturbed) and copies of embed_tokens and lm_head; config.json says num_nextn_predict_layers: 1."""
    from safetensors.torch import save_file

    cfg = json.loads((hf / "config.json").read_text())
    n, h, src = cfg["num_hidden_layers"], cfg["hidden_size"], hf_tensors(hf)
    g = torch.Generator().manual_seed(seed)
    new = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v + 0.05 * torch.randn(v.shape, generator=g)
           for k, v in src.items() if k.startswith(f"model.layers.{n - 1}.")}
    p = f"model.layers.{n}."
    new.update({p + k: 1 + 0.1 * torch.randn(h, generator=g) for k in ("enorm.weight", "hnorm.weight",
                                                                         "shared_head.norm.weight")})
    new[p + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    new[p + "embed_tokens.weight"] = src["model.embed_tokens.weight"].clone()
    new[p + "shared_head.head.weight"] = src["lm_head.weight"].clone()
    save_file(new, str(hf / "mtp.safetensors"))
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(new, "mtp.safetensors"))
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    (hf / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return hf


def hf_mtp_logits(hf: Path, toks: torch.Tensor) -> torch.Tensor:
    """Depth-1 MTP logits [1, s-1, V] computed the way DeepSeek-V3 defines them, from the HF tensors with
    transformers' own decoder layer: lm_head(norm(layer(eh_proj([enorm(emb(x_t+1)); hnorm(h_t)]))))."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from megatron_rl.convert.verify import load_hf

    model = load_hf(hf)[0].eval()
    n, t, s = model.config.num_hidden_layers, hf_tensors(hf), toks.shape[1]
    p = f"model.layers.{n}."

    def norm(x, w):  # DeepSeek's RMSNorm
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps))

    layer = DeepseekV3DecoderLayer(model.config, layer_idx=n).eval()
    own = {k[len(p):]: v for k, v in t.items() if k.startswith(p)}
    missing, _ = layer.load_state_dict(own, strict=False)
    assert missing == [], missing
    with torch.no_grad():
        h = model.model(toks).last_hidden_state[:, :-1]  # [1, s-1, H] after the final norm
        e = model.model.embed_tokens(toks[:, 1:])  # [1, s-1, H]: the next token's embedding
        x = torch.cat([norm(e, own["enorm.weight"]), norm(h, own["hnorm.weight"])], -1) @ own["eh_proj.weight"].T
        pos = torch.arange(s - 1)[None]
        mask = torch.full((s - 1, s - 1), float("-inf")).triu(1)[None, None]  # [1, 1, s-1, s-1] causal
        y = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        return norm(y, own["shared_head.norm.weight"]) @ own["shared_head.head.weight"].T


@pytest.mark.slow
def test_deepseek_v3_mtp_layers_round_trip_bit_exact(tmp_path, capsys):
    """num_nextn_predict_layers=1: imported into Megatron's MTP block and written back, every tensor bitwise
    (the MTP layer's and its embed/head copies too); the main logits stay exact (transformers ignores MTP)."""
    hf = add_mtp_layer(make_hf_model("deepseek_v3", tmp_path / "hf"))
    _, cfg = convert_both_ways(hf, tmp_path, capsys)
    assert cfg["num_nextn_predict_layers"] == 1
    assert [k for k in hf_tensors(tmp_path / "hf2") if k.startswith("model.layers.3.")]


def test_deepseek_v3_mtp_layer_from_hf_predicts_as_deepseek_defines_it(tmp_path):
    """model.init=hf:DIR with an MTP layer: the trainer's model gets model.mtp_num_layers=1 and its MTP logits
    equal DeepSeek-V3's definition computed with transformers' decoder layer from the HF tensors. A folder whose
    config.json declares MTP but holds no MTP tensors (saved by transformers) loads without them."""
    from megatron.core import tensor_parallel

    from megatron_rl.convert.runtime import start
    from megatron_rl.convert.source import initializer, resolve
    from megatron_rl.models.gpt import ModelConfig, build_gpt
    from megatron_rl.models.mtp import emit_mtp, split

    ctx = start()
    plain = make_hf_model("deepseek_v3", tmp_path / "plain")
    (plain / "config.json").write_text(json.dumps({**json.loads((plain / "config.json").read_text()),
                                                   "num_nextn_predict_layers": 1}))
    cfg = ModelConfig(init=f"hf:{plain}", max_seq_length=64)
    resolve(cfg)
    assert cfg.mtp_num_layers == 0
    hf = add_mtp_layer(make_hf_model("deepseek_v3", tmp_path / "hf"))
    cfg = ModelConfig(init=f"hf:{hf}", max_seq_length=64)
    resolve(cfg)
    assert cfg.mtp_num_layers == 1
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_gpt(cfg, ctx.parallel, ctx.pgs).eval()
    initializer(cfg)(model)
    toks = torch.randint(cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), emit_mtp(model):
        _, (depth,) = split(model(toks, torch.arange(24)[None], None), 24, 1)  # [1, 24, V]
    ref = hf_mtp_logits(hf, toks)
    assert ref.std() > 0.1 and (depth[:, :-1] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("change, words", [
    (dict(rope_interleave=False), "rope_interleave=False"),
    (dict(n_group=2, topk_group=1), "num_experts_per_tok=4 with topk_group=1"),
    (dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-05"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "takes plain RoPE or YaRN"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}), "mscale_all_dim without mscale"),
], ids=["interleave", "groups", "eps", "softmax", "norm", "linear", "mscale"])
def test_deepseek_v3_variants_it_cannot_convert_are_refused(change, words, tmp_path, capsys):
    hf = make_hf_model("deepseek_v3", tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, **change}))
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    assert words in err, err


def test_deepseek_v3_bf16_with_the_original_config_keys(tmp_path, capsys):
    """A bf16 checkpoint whose config.json carries DeepSeek's own keys (topk_method, scoring_func, auto_map...):
    converted; exported in bf16 except the expert bias, which Megatron and DeepSeek's files keep in fp32."""
    hf = make_hf_model("deepseek_v3", tmp_path / "hf", dtype=torch.bfloat16)
    cfg = json.loads((hf / "config.json").read_text())
    own = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "ep_size": 1,
           "aux_loss_alpha": 0.001, "seq_aux": True, "num_nextn_predict_layers": 0,
           "auto_map": {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}}
    (hf / "config.json").write_text(json.dumps({**cfg, **own}))
    rep = run_ok(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--verify"], capsys)
    assert rep["dtype_casts"] == [] and rep["verify"]["max_abs_logit_diff"] <= 5e-2
    rep = run_ok(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"), "--verify"], capsys)
    assert rep["verify"]["dtypes"] == ["BF16", "F32"]
    x, y = hf_tensors(hf), hf_tensors(tmp_path / "hf2")
    bias = [k for k in x if k.endswith("e_score_correction_bias")]
    assert bias and all(y[k].dtype == torch.float32 and torch.equal(y[k], x[k].float()) for k in bias)
    assert all(y[k].dtype == torch.bfloat16 and torch.equal(x[k], y[k]) for k in x if k not in bias)


def test_random_models_export_as_the_architecture_that_describes_them():
    """`megatron-rl export` of a random-weights run writes the first architecture whose config.json reads back
    to the same model (it wrote Llama for every model: an MoE's export then failed, "lacks tensor
    decoder.layers.mlp.linear_fc1.weight"); a model no architecture describes is refused up front, by
    `megatron-rl train`'s config check, naming export.enabled."""
    from megatron_rl.config import ConfigError, from_dict
    from megatron_rl.convert.arch import describe
    from megatron_rl.convert.arch.base import ConvertError
    from megatron_rl.models.gpt import ModelConfig, MoEConfig
    from megatron_rl.run_config import RunConfig

    moe = MoEConfig(num_experts=8, topk=2, ffn_hidden_size=32)
    assert describe(ModelConfig())[0].name == "llama"
    arch, hf = describe(ModelConfig(moe=moe))
    assert arch.name == "mixtral" and hf["num_local_experts"] == 8 and hf["intermediate_size"] == 32
    mixed = dataclasses.replace(moe, layer_pattern=[1, 0], router_pre_softmax=True)
    assert describe(ModelConfig(qk_layernorm=True, moe=mixed))[0].name == "qwen3_moe"
    with pytest.raises(ConvertError, match="no HF architecture describes this model exactly"):
        describe(ModelConfig(moe=mixed))
    base = {"curriculum": {"enabled": False}, "train": {"steps": 0}, "data": {"domain": "countdown"}}
    model = {"moe": {"num_experts": 8, "topk": 2, "layer_pattern": [1, 0]}}
    with pytest.raises(ConfigError, match="export.enabled=true, but the run's random model cannot be written"):
        from_dict(RunConfig, {**base, "model": model}).validate()
    from_dict(RunConfig, {**base, "model": model, "export": {"enabled": False}}).validate()
    from_dict(RunConfig, {**base, "model": {"moe": {"num_experts": 8, "topk": 2}}}).validate()
