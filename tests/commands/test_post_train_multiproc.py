"""The README's main job (`megatron-rl train configs/post_train_cpu.yaml`) on a tiny HF model built here:
HF folder in (model.init), chat-template prompts, GRPO in the loop, HF folder out (export verified), and
summary.json. The first step's behaviour log-probs equal transformers' on the same tokens (fp32, 1e-5)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.hf_tiny import tiny_deepseek_v3, tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")
# entropy bonus: a random model earns no reward variance, the update must still change the weights
SHORT = ("rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=4", "rl.max_new_tokens=16", "eval.tasks=6", "eval.k=2",
         "model.max_seq_length=128", "rl.trainer.loss.entropy_coef=0.05", "rl.optim.lr=1e-3", "export.verify=true",
         "engine.num_blocks=128", "monitor.tensorboard=false",
         "rl.dynamic_sampling=false")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    model = tiny_llama(folder, tiny_tokenizer(folder))
    return folder, model


@pytest.mark.slow
@pytest.mark.multiproc
def test_hf_in_rl_hf_out(tmp_path, tiny_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data.shards import read_shard

    folder, ref = tiny_hf
    proc = subprocess.run([EXE, "train", "configs/post_train_cpu.yaml", f"output_dir={tmp_path}",
                           f"model.init=hf:{folder}", *SHORT], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # a quiet start: the run's first line is its own, no known-harmless Megatron warning (megatron_rl.compat.quiet)
    assert proc.stdout.startswith("[megatron-rl] run 'post_train'") and "and rollout engine ready in" in proc.stdout
    from megatron_rl.compat.quiet import KNOWN

    assert not [w.name for w in KNOWN if re.search(w.message, proc.stderr)], proc.stderr[-3000:]
    run = tmp_path / "post_train"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == f"hf:{folder}" and summary["rl_steps"] == 2 and summary["cpu_s"] > 0
    for when in ("heldout_before", "heldout_after"):
        assert summary[when]["tasks"] == 6 and "arithmetic" in summary[when]["domains"]
        assert 0.0 <= summary[when]["domains"]["arithmetic"]["pass@1"] <= 1.0

    rl = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"rl"' in x]
    assert abs(rl[0]["mismatch_kl"]) < 1e-6  # one epoch on behaviour log-probs: trainer vs engine before the update
    # the step-0 rollouts: chat-template prompts, behaviour log-probs of the HF weights
    tok = AutoTokenizer.from_pretrained(folder)
    trajs = read_shard(run / "rl_shards" / "step-000000.h5")
    assert trajs
    for t in trajs:
        prompt = tok.apply_chat_template([{"role": "user", "content": _task_prompt(t.task_id)}],
                                         add_generation_prompt=True, tokenize=True)
        assert t.tokens[:t.prompt_len].tolist() == prompt
        with torch.no_grad():
            logits = ref.float()(torch.as_tensor(t.tokens[None].astype(np.int64))).logits[0]  # [S, V]
        lp = torch.log_softmax(logits.double(), -1)[:-1].gather(1, torch.as_tensor(t.tokens[1:, None].astype(
            np.int64)))[:, 0]  # [S-1]: log p(token i+1 | ..i)
        mine = torch.as_tensor(t.logprobs[t.prompt_len:], dtype=torch.float64)
        assert (mine - lp[t.prompt_len - 1:]).abs().max().item() < 1e-5

    # the exported folder loads in transformers, was verified against the policy, and holds the RL'd weights
    out = Path(summary["export_dir"])
    assert out.is_dir() and "verified: max |logit diff|" in proc.stdout
    exported = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    moved = max((a - b).abs().max().item() for a, b in zip(exported.state_dict().values(), ref.state_dict().values()))
    assert moved > 1e-6  # RL updated the policy; the export is not the starting checkpoint
    assert AutoTokenizer.from_pretrained(out).apply_chat_template([{"role": "user", "content": "hi"}]) == \
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    gen = json.loads((out / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in np.atleast_1d(gen["eos_token_id"]).tolist()
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"
    # `megatron-rl export` of another step, with --verify, from the CLI
    ex = subprocess.run([EXE, "export", str(run), "--step", "2", "--out", str(tmp_path / "again"), "--verify"],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr[-3000:]
    assert json.loads(ex.stdout.strip().splitlines()[-1])["verify"]["max_abs_logit_diff"] < 1e-4


@pytest.mark.slow
@pytest.mark.multiproc
def test_python_api_through_a_submitit_executor(tmp_path, tiny_hf):
    """`executor.submit(train, cfg)` (the README's example, local executor): the job returns the summary."""
    import submitit

    from megatron_rl import load_config, train

    folder, _ = tiny_hf
    cfg = load_config(str(REPO / "configs/post_train_cpu.yaml"),
                      [f"output_dir={tmp_path / 'runs'}", f"model.init=hf:{folder}", *SHORT, "rl.steps=1",
                       "export.verify=false", "name=api"])
    executor = submitit.LocalExecutor(folder=tmp_path / "logs")
    executor.update_parameters(timeout_min=15)
    summary = executor.submit(train, cfg).result()
    assert summary["name"] == "api" and summary["rl_steps"] == 1
    assert (Path(summary["export_dir"]) / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.multiproc
def test_deepseek_v3_hf_in_rl_hf_out(tmp_path):
    """The main job on a tiny DeepseekV3ForCausalLM (MLA + YaRN, sigmoid router with expert bias, grouped top-k,
    first layer dense): the engine's behaviour log-probs equal the trainer's before the update (mismatch_kl 0:
    the expert bias reaches the engine), the export is verified and keeps the (not updated) expert bias."""
    from safetensors.torch import load_file

    hf = tmp_path / "hf"
    hf.mkdir()
    tiny_deepseek_v3(hf, tiny_tokenizer(hf))
    proc = subprocess.run([EXE, "train", "configs/post_train_cpu.yaml", f"output_dir={tmp_path}",
                           f"model.init=hf:{hf}", *SHORT], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "post_train"
    rl = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"rl"' in x]
    assert len(rl) == 2 and abs(rl[0]["mismatch_kl"]) < 1e-6
    assert "verified: max |logit diff|" in proc.stdout
    out = Path(json.loads((run / "summary.json").read_text())["export_dir"])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    a = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()}
    b = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert sorted(a) == sorted(b)
    bias = [k for k in a if k.endswith("e_score_correction_bias")]
    assert bias and all(torch.equal(a[k], b[k]) for k in bias) and a[bias[0]].abs().max() > 0
    assert max((a[k] - b[k]).abs().max().item() for k in a if k not in bias) > 1e-6  # RL moved the weights


def test_export_without_a_checkpoint_is_named(tmp_path):
    from megatron_rl.commands.export import main

    (tmp_path / "config.yaml").write_text("name: x\n")
    assert main([str(tmp_path)]) == 1


def _task_prompt(task_id: str) -> str:
    from envs.tasks import load_domain

    return {t.id: t.prompt for t in load_domain("arithmetic")}[task_id]
