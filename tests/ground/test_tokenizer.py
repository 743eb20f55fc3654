"""The run's tokenizer: HF tokenizer folders with their chat template equal transformers' apply_chat_template
token for token; stop ids; padding ids; bad input named with the fix."""
import json

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.models.gpt import ModelConfig
from megatron_rl.tokenizer import ByteTokenizer, HFTokenizer, TokenizerConfig
from tests.hf_tiny import tiny_tokenizer

CHATS = [
    [{"role": "user", "content": "What is 7 + 5?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 9 * 3?"},
     {"role": "assistant", "content": "9 * 3 = 27."}, {"role": "user", "content": "And 14 - 6? ünïcödé"}],
]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "évalue une expression",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "string"}},
                                                          "required": ["x"]}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return folder, tiny_tokenizer(folder)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_ids_equal_transformers(tiny, chat, tools):
    folder, ref = tiny
    tok = HFTokenizer(folder)
    want = ref.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=True)
    assert tok.prompt_ids(chat, tools) == want
    assert tok.render(chat, tools) == ref.apply_chat_template(chat, tools=tools, add_generation_prompt=True,
                                                              tokenize=False)


def test_encode_decode_and_special_ids(tiny):
    folder, ref = tiny
    tok = HFTokenizer(folder)
    text = "What is 12 + 30? The answer is 42."
    assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode(text) + [tok.eos_id]) == text  # special tokens dropped
    assert tok.vocab_size == len(ref)
    im_end = ref.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.stop_ids and tok.eos_id == im_end


def test_end_of_turn_token_stops_even_when_eos_differs(tmp_path):
    """SmolLM2's GGUF export names <|im_start|> as eos in tokenizer_config.json and <|im_end|> (2) in
    config.json: both stop, and so does the template's end-of-turn token."""
    ref = tiny_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|im_start|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
    tok = HFTokenizer(tmp_path)
    ids = {ref.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    assert ids <= set(tok.stop_ids)


def test_template_less_tokenizer_is_refused_for_chat(tmp_path):
    tiny_tokenizer(tmp_path, template=None)
    tok = HFTokenizer(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ConfigError, match="no chat template"):
        tok.prompt_ids(CHATS[0])


def test_missing_folder_and_vocab_too_large_are_named(tmp_path, tiny):
    with pytest.raises(ConfigError, match="tokenizer.json"):
        HFTokenizer(tmp_path / "nothing")
    folder, ref = tiny
    with pytest.raises(ConfigError, match=r"has \d+ tokens but model.vocab_size is 128"):
        TokenizerConfig(kind="hf", path=str(folder)).build(ModelConfig(vocab_size=128))
    with pytest.raises(ConfigError, match="tokenizer.kind=hf needs tokenizer.path"):
        TokenizerConfig(kind="hf").build(ModelConfig(vocab_size=512))


def test_byte_tokenizer_pads_its_vocab():
    tok = TokenizerConfig(kind="auto").build(ModelConfig(vocab_size=384))
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 259 < 384
    assert tok.prompt_ids([{"role": "user", "content": "1 2 -> 3\n"}]) == [tok.bos_id, *b"1 2 -> 3\n"]


def test_engine_never_samples_padding_ids():
    """A model of 384 ids with a 259-id tokenizer: sampled tokens stay below 259 and their log-probs are
    normalised over those 259 ids only (the padded rows here carry large logits that would win otherwise)."""
    import torch
    from megatron.core import tensor_parallel

    from megatron_rl.convert.runtime import start
    from megatron_rl.rollout import RolloutEngine, SamplingParams

    ctx = start()  # one process (reused when another test started it)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=384, max_seq_length=64)
    engine = RolloutEngine.build(cfg, None, ctx.parallel, ctx.pgs, valid_vocab=259)
    with torch.no_grad():
        engine.model.embedding.word_embeddings.weight[259:] *= 50.0  # padding rows dominate the raw logits
    outs = engine.generate([[257, 49, 50]] * 4, SamplingParams(temperature=1.0, max_new_tokens=16, seed=3, n=2))
    toks = [t for o in outs for s in o.samples for t in s.token_ids]
    assert toks and max(toks) < 259
    greedy = engine.generate([[257, 49, 50]], SamplingParams(temperature=0.0, max_new_tokens=8))[0].samples[0]
    assert max(greedy.token_ids) < 259
