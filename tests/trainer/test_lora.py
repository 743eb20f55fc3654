"""LoRA RL on the Megatron path (megatron_rl/trainer/lora.py), one process (a gloo world of one shared with other
tests): step 0 equals the base model, an RL step changes only the adapters, checkpoints hold only adapters and
resume exactly, the engine gets the merged weights (its log-probs equal the trainer's), the config refuses bad
values. TP=2 parity: tests/trainer/test_trainer_multiproc.py::test_tp2_lora_steps_match_one_process; export and
PEFT: tests/convert/test_lora_export.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.trainer.lora import LoRAConfig, is_adapter

SEED = 1234
LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0)


def _policy(lora: LoRAConfig | None = LORA, lr: float = 1e-2):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.convert.runtime import start
    from megatron_rl.trainer.policy import OptimConfig, Policy
    from tests.mp.trainer_parity import model_config

    ctx = start()
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    return Policy(model_config(2, False), OptimConfig(lr=lr, distributed_optimizer=False), ctx, total_steps=4,
                  init=lambda m: init_weights_by_name(m, SEED), lora=lora)


def _trainer(policy):
    from megatron_rl.kernels.logprob import LogprobKernelConfig
    from megatron_rl.rl.config import LossConfig
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer

    return RLTrainer(policy, RLConfig(loss=LossConfig(name="grpo"), packing=PackingConfig(max_tokens=64),
                                      logprob_kernel=LogprobKernelConfig(impl="torch")))


def _logits(policy, tokens: torch.Tensor) -> torch.Tensor:
    model = policy.chunks[0].module
    model.eval()
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        out = model(tokens, pos, None)
    model.train()
    return out


TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def _params(policy) -> dict:
    return {n: p.detach().clone() for n, p in policy.chunks[0].module.named_parameters()}


def test_step0_equals_base_and_only_adapters_train():
    base, lora = _policy(None), _policy()
    torch.testing.assert_close(_logits(lora, TOKENS), _logits(base, TOKENS), rtol=0, atol=0)
    params = dict(lora.chunks[0].module.named_parameters())
    adapters = {n for n in params if is_adapter(n)}
    assert len(adapters) == 2 * 4 * 2  # A and B of qkv, proj, fc1, fc2 in two layers
    assert {n for n, p in params.items() if p.requires_grad} == adapters
    opt = {id(p) for g in lora.optimizer.param_groups for p in g["params"]}
    assert opt == {id(params[n]) for n in adapters}  # the optimizer holds only the adapters
    before = _params(lora)
    from tests.mp.trainer_parity import batch

    m = _trainer(lora).step(batch(0))
    assert not m["update_skipped"]
    after = _params(lora)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and changed <= adapters and any(n.endswith("lora_B") for n in changed)
    assert not torch.equal(_logits(lora, TOKENS), _logits(base, TOKENS))


def test_checkpoint_holds_adapters_only_and_resumes_exactly(tmp_path):
    from megatron.core import dist_checkpointing

    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from tests.mp.trainer_parity import batch

    a = _policy()
    ta = _trainer(a)
    ta.step(batch(0))
    save_checkpoint(a, tmp_path / "ck")
    keys = [k for k in dist_checkpointing.load_tensors_metadata(str(tmp_path / "ck"))]
    model_keys = [k for k in keys if not k.startswith("optimizer.")]
    assert model_keys and all(is_adapter(k) for k in model_keys), model_keys
    assert all(is_adapter(k.split("optimizer.state.")[-1].split(".", 1)[-1]) or "lora_" in k
               for k in keys if k.startswith("optimizer."))
    ta.step(batch(1))
    want = _params(a)
    b = _policy()
    load_checkpoint(b, tmp_path / "ck")
    assert b.step_count == 1
    _trainer(b).step(batch(1))
    got = _params(b)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)


def test_checkpoint_without_adapters_is_refused(tmp_path):
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(_policy(LoRAConfig(enabled=True, rank=4, targets=["fc1"])), tmp_path / "ck")
    with pytest.raises(ValueError, match="lacks LoRA adapters"):
        load_checkpoint(_policy(), tmp_path / "ck")


def test_engine_gets_merged_weights_and_matches_trainer_logprobs():
    from megatron_rl.rollout import RolloutEngine, SamplingParams
    from megatron_rl.rollout.engine import EngineConfig
    from tests.mp.trainer_parity import batch

    policy = _policy()
    trainer = _trainer(policy)
    trainer.step(batch(0))
    named = dict(policy.named_parameters())
    assert not any(is_adapter(n) for n in named)
    qkv = policy.chunks[0].module.decoder.layers[0].self_attention.linear_qkv
    merged = named["decoder.layers.0.self_attention.linear_qkv.weight"]
    torch.testing.assert_close(merged, qkv.weight + LORA.scale * qkv.lora_B @ qkv.lora_A)
    assert not torch.equal(merged, qkv.weight)  # the update reached the merged weight
    ctx = policy.ctx
    engine = RolloutEngine.build(policy.cfg, EngineConfig(num_blocks=64, block_size=4), ctx.parallel, ctx.pgs)
    engine.update_weights(1, policy.named_parameters())
    prompt = [3, 5, 7, 9]
    out = engine.generate([prompt], [SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)])[0].samples[0]
    toks = torch.tensor([prompt + list(out.token_ids)])
    logits = _logits(policy, toks)[0].double()  # [s, V]
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, toks[0, len(prompt):, None])[:, 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), lp.numpy(), atol=2e-5)


def test_bf16_base_is_frozen_in_bf16_and_close_to_fp32():
    lora = _policy(LoRAConfig(enabled=True, rank=4, base_dtype="bf16"))
    qkv = lora.chunks[0].module.decoder.layers[0].self_attention.linear_qkv
    assert qkv.weight.dtype == torch.bfloat16 and qkv.lora_A.dtype == torch.float32
    base = _policy(None)
    torch.testing.assert_close(_logits(lora, TOKENS), _logits(base, TOKENS), rtol=0, atol=0.05)


@pytest.mark.parametrize("override,match", [
    ("lora.rank=0", "lora.rank must be >= 1"), ("lora.targets=[qkv,gate]", "lora.targets"),
    ("lora.base_dtype=fp8", "lora.base_dtype"), ("lora.dropout=1.0", "lora.dropout"),
    ("lora.ranks=4", "ranks")])
def test_config_refuses_bad_values(override, match):
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    with pytest.raises(ConfigError, match=match):
        C.load(RunConfig, None, ["lora.enabled=true", override])


def test_config_off_by_default_and_documented():
    from megatron_rl.config import undocumented_fields
    from megatron_rl.run_config import RunConfig

    assert RunConfig().lora.enabled is False
    assert undocumented_fields(LoRAConfig) == []
