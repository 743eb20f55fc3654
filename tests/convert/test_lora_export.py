"""Export of a LoRA run (megatron_rl/commands/lora_export.py) from a tiny HF Llama: the merged HF folder gives the
trainer's logits, and Hugging Face PEFT loads the adapter folder onto the base with the merged folder's logits."""
from __future__ import annotations

import pytest
import torch

from megatron_rl import config as C
from megatron_rl.run_config import RunConfig
from tests.hf_tiny import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A run folder holding config.yaml and one LoRA checkpoint (adapters drawn non-zero), and the trainer's
    logits of TOKENS."""
    from megatron.core import tensor_parallel

    from megatron_rl.convert.runtime import megatron_logits, start
    from megatron_rl.convert.source import initializer
    from megatron_rl.trainer.checkpoint import save_checkpoint
    from megatron_rl.trainer.policy import Policy

    base = tmp_path_factory.mktemp("llama")
    tiny_llama(base, tiny_tokenizer(base), heads=4, kv_heads=2, hidden=32)
    run = tmp_path_factory.mktemp("run")
    cfg = C.load(RunConfig, None, [f"model.init=hf:{base}", "data.domain=arithmetic", "curriculum.enabled=false",
                                   "train.steps=0", "launch.nproc_per_node=1", "model.max_seq_length=64",
                                   "lora.enabled=true", "lora.rank=4", "lora.alpha=8"])
    (run / "config.yaml").write_text(C.dump_yaml(cfg))
    ctx = start()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    policy = Policy(cfg.model, cfg.rl.optim, ctx, total_steps=1, init=initializer(cfg.model), lora=cfg.lora)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in policy.chunks[0].module.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model = policy.chunks[0].module
    model.eval()
    with torch.no_grad():
        logits = megatron_logits(model, TOKENS, ctx)  # [b, s, V]
    save_checkpoint(policy, run / "checkpoints" / "step-000001")
    (run / "checkpoints" / "latest").write_text("step-000001\n")
    return run, base, logits


TOKENS = torch.randint(0, 150, (2, 20), generator=torch.Generator().manual_seed(0))


def test_merged_export_gives_the_trainers_logits(lora_run):
    from transformers import AutoModelForCausalLM

    from megatron_rl.commands.export import export_run

    run, base, logits = lora_run
    report = export_run(run)
    out = AutoModelForCausalLM.from_pretrained(report["out"], torch_dtype=torch.float32)
    with torch.no_grad():
        got = out(TOKENS).logits
        plain = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)(TOKENS).logits
    assert (got - logits).abs().max().item() < 1e-4
    assert (plain - logits).abs().max().item() > 1e-2  # the adapters changed the model


def test_peft_loads_the_adapter_folder_with_the_merged_logits(lora_run):
    pytest.importorskip("peft", reason="Hugging Face PEFT is installed with the hf extra (setup.py)")
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_rl.commands.export import export_run

    run, base, logits = lora_run
    report = export_run(run, adapter=True)
    cfg = json.loads((run / "export" / "adapter-step-1" / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                             "v_proj"]
    assert report["adapter_tensors"] == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32),
                                      report["out"])
    model.eval()
    with torch.no_grad():
        got = model(TOKENS).logits
    assert (got - logits).abs().max().item() < 1e-4


def test_adapter_export_of_a_full_run_is_refused(tmp_path):
    from megatron_rl.commands.export import export_run

    cfg = C.load(RunConfig, None, ["train.steps=0", "launch.nproc_per_node=1"])
    (tmp_path / "config.yaml").write_text(C.dump_yaml(cfg))
    ck = tmp_path / "checkpoints" / "step-000001"
    ck.mkdir(parents=True)
    (ck / "metadata.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest").write_text("step-000001\n")
    with pytest.raises(C.ConfigError, match="trained without lora.enabled"):
        export_run(tmp_path, adapter=True)
