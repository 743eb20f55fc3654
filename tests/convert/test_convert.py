"""HF <-> Megatron conversion in one process: bitwise round trips, logits parity, bad input, atomic output.

Tiny random models are built with transformers from configs (no download). The conversions run in this
pytest process (one gloo group of size 1, reused), through the same `main(argv)` as the CLI.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.mp.convert_models import CONFIGS, hf_tensors, make_hf_model
from tools.convert.cli import main


def _leftovers(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name.startswith(out.name)]


def run_ok(argv: list[str], capsys) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def run_err(argv: list[str], capsys) -> str:
    assert main(argv) == 1
    return capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_round_trip_bitwise_and_logits(arch, tmp_path, capsys):
    hf = make_hf_model(arch, tmp_path / "hf")
    rep = run_ok(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--verify"], capsys)
    assert rep["arch"] == arch and rep["dtype_casts"] == []
    assert rep["verify"]["max_abs_logit_diff"] <= 1e-4
    rep = run_ok(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"), "--verify"], capsys)
    assert rep["verify"]["max_abs_logit_diff"] <= 1e-4 and rep["verify"]["dtypes"] == ["F32"]
    a, b = hf_tensors(hf), hf_tensors(tmp_path / "hf2")
    if json.loads((hf / "config.json").read_text())["tie_word_embeddings"]:
        a.pop("lm_head.weight", None)  # a tied copy: transformers may write it, we do not
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k]) or a[k].dtype != b[k].dtype] == []
    assert (tmp_path / "hf2" / "tokenizer_config.json").read_text() == (hf / "tokenizer_config.json").read_text()
    index = json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in (tmp_path / "hf2").glob("*.safetensors")}


@pytest.mark.slow
def test_mcore_to_hf_with_arch_name_writes_loadable_config(tmp_path, capsys):
    hf = make_hf_model("qwen3", tmp_path / "hf")
    run_ok(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    rep = run_ok(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"),
                  "--hf-config", "qwen3", "--verify"], capsys)
    assert rep["verify"]["max_abs_logit_diff"] <= 1e-4
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


def test_entries_sharing_a_key_are_all_read(tmp_path, capsys):
    """A last pipeline stage's tied output layer is stored under the embedding's key: reading both entries (as
    reshard --verify does with the entries of every stage) fills both with the embedding, not one with torch.empty
    (the bug: reshard --verify to a tied model at pp > 1 compared against an HF model with a garbage embedding)."""
    from dataclasses import replace

    from megatron_rl.convert import layout, runtime
    from megatron_rl.convert.arch import for_hf_config

    hf = make_hf_model("qwen2", tmp_path / "hf")  # tied embeddings
    run_ok(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    hf_cfg = json.loads((hf / "config.json").read_text())
    cfg, extra = for_hf_config(hf_cfg).model_config(hf_cfg)
    entries = layout.ckpt_entries(layout.build_model(cfg, extra, runtime.start(), num_layers=1))
    emb = next(e for e in entries if e.template == "embedding.word_embeddings.weight")
    tied = replace(emb, template="output_layer.weight")  # as Megatron's last stage (not the first) names it
    counts, dtypes = (hf_cfg["num_hidden_layers"], 0), {emb.key: torch.float32}
    alone = layout.load_canonical(str(tmp_path / "mc"), [emb], None, counts, dtypes)[emb.template]
    assert torch.equal(alone[: hf_cfg["vocab_size"]], hf_tensors(hf)["model.embed_tokens.weight"])
    both = layout.load_canonical(str(tmp_path / "mc"), [emb, tied], None, counts, dtypes)
    assert torch.equal(both[emb.template], alone) and torch.equal(both["output_layer.weight"], alone)
    with pytest.raises(ValueError, match="output_layer.weight.*one shape"):
        layout.load_canonical(str(tmp_path / "mc"), [emb, replace(tied, shape=(1, 1))], None, counts, dtypes)


# -- bad input ---------------------------------------------------------------------------------------------
def test_unknown_architecture_lists_supported(tmp_path, capsys):
    hf = make_hf_model("llama", tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg))
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    assert "GPTNeoXForCausalLM" in err and "qwen3_moe" in err and "MixtralForCausalLM" in err
    assert _leftovers(tmp_path / "mc") == []


def test_missing_shard_names_the_file(tmp_path, capsys):
    hf = make_hf_model("llama", tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    (hf / shard).unlink()
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    assert shard in err and "missing" in err
    assert _leftovers(tmp_path / "mc") == []


def test_shape_mismatch_names_tensor_expected_and_got(tmp_path, capsys):
    hf = make_hf_model("qwen2", tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    index = json.loads((hf / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.k_proj.bias"
    f = hf / index["weight_map"][name]
    tensors = load_file(f)
    tensors[name] = torch.zeros(7)
    save_file(tensors, f)
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    assert name in err and "expected [16]" in err and "got [7]" in err


def test_checkpoint_of_another_model_names_first_mismatch(tmp_path, capsys):
    small = make_hf_model("llama", tmp_path / "small")
    run_ok(["hf-to-mcore", "--hf", str(small), "--out", str(tmp_path / "mc")], capsys)
    wide = make_hf_model("llama", tmp_path / "wide", intermediate_size=64)
    err = run_err(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf2"),
                   "--hf-config", str(wide)], capsys)
    assert "mlp.linear_fc1.weight" in err and "expected [2, 128, 32]" in err and "got [2, 96, 32]" in err
    assert _leftovers(tmp_path / "hf2") == []
    moe = make_hf_model("mixtral", tmp_path / "moe")
    err = run_err(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "hf3"),
                   "--hf-config", str(moe)], capsys)
    assert "lacks tensor" in err and "router" in err


def test_unexpected_hf_tensor_is_refused(tmp_path, capsys):
    hf = make_hf_model("llama", tmp_path / "hf")
    from safetensors.torch import save_file

    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(2)}, hf / "extra.safetensors")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "extra.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    assert "model.layers.0.mlp.extra.weight" in err and "unexpected" in err


def test_existing_output_is_refused_and_untouched(tmp_path, capsys):
    hf = make_hf_model("llama", tmp_path / "hf")
    (tmp_path / "mc").mkdir()
    (tmp_path / "mc" / "keep").write_text("x")
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc")], capsys)
    assert "already exists" in err and (tmp_path / "mc" / "keep").read_text() == "x"


@pytest.mark.slow
def test_failure_midway_leaves_nothing(tmp_path, capsys):
    """An error after the temporary folder exists (verify fails) removes it; nothing under the name."""
    hf = make_hf_model("llama", tmp_path / "hf")
    err = run_err(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--verify", "--tol", "-1"],
                  capsys)
    assert "logits differ" in err
    assert _leftovers(tmp_path / "mc") == []
    shutil.rmtree(hf)


def test_help_through_megatron_rl_cli(capsys):
    from megatron_rl.cli import main as top

    assert top(["convert", "--help"]) == 0
    out = capsys.readouterr().out
    assert "hf-to-mcore" in out and "mcore-to-hf" in out and "reshard" in out


def test_safetensors_reader_equals_safe_open_for_every_dtype_and_names_a_truncated_file(tmp_path):
    """The import reads tensors with positioned reads (no memory map, benchmarks/import_memory.py)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_rl.convert.arch.base import ConvertError
    from megatron_rl.convert.hf_io import SafetensorsFile

    g = torch.Generator().manual_seed(0)
    tensors = {f"t.{dt}".replace("torch.", ""): torch.randn(3, 5, generator=g).to(dt)
               for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64)}
    tensors["empty"] = torch.zeros(0, 4)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    st = SafetensorsFile(tmp_path / "m.safetensors")
    with safe_open(tmp_path / "m.safetensors", "pt") as ref:
        for name in tensors:
            got, want = st.read(name), ref.get_tensor(name)
            assert got.dtype == want.dtype and st.shape(name) == tuple(want.shape)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    st.close()
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    cut = SafetensorsFile(tmp_path / "cut.safetensors")
    with pytest.raises(ConvertError, match="is truncated"):
        for name in tensors:
            cut.read(name)
    cut.close()
