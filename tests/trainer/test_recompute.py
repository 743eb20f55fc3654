"""model.recompute_activations: the trainer keeps far fewer activation bytes for the backward and computes the
same loss and gradients (one CPU process, the trainer-parity model at 4 layers)."""
from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from megatron_rl.config import ConfigError
from tests.mp.trainer_parity import SEED, batch, init_model, model_config, rl_config
from tests.trainer.test_trainer_fused_logprob import _ctx


def _gradients_and_saved_bytes(recompute: bool) -> tuple[float, dict, int]:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.trainer.policy import OptimConfig, Policy
    from megatron_rl.trainer.rl_step import RLTrainer

    ctx = _ctx()
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    mcfg = dataclasses.replace(model_config(4, False), recompute_activations=recompute)
    policy = Policy(mcfg, OptimConfig(lr=1e-3, distributed_optimizer=False), ctx, total_steps=2, init=init_model)
    trainer = RLTrainer(policy, rl_config(120))
    live, peak = [0], [0]  # bytes of activations held for the backward now, and at most

    def release(nbytes: int) -> None:
        live[0] -= nbytes

    def pack(t):
        if not (t.is_leaf and t.requires_grad):  # activations, not the weights
            live[0] += t.numel() * t.element_size()
            peak[0] = max(peak[0], live[0])
            weakref.finalize(t, release, t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, grads = trainer.compute_gradients(batch(0))
    return loss, {k: v.clone() for k, v in grads.items()}, peak[0]


def test_recompute_keeps_fewer_activation_bytes_and_gives_the_same_gradients():
    loss0, g0, saved0 = _gradients_and_saved_bytes(False)
    loss1, g1, saved1 = _gradients_and_saved_bytes(True)
    assert abs(loss0) > 1e-4 and abs(loss1 - loss0) < 1e-6
    assert sorted(g0) == sorted(g1) and len(g0) > 0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6)
    assert saved1 < saved0 / 2, (saved0, saved1)  # only the layers' inputs are kept for the backward


def test_recompute_is_refused_for_moe_models_naming_the_setting():
    cfg = dataclasses.replace(model_config(2, True), recompute_activations=True)
    with pytest.raises(ConfigError, match="model.recompute_activations with model.moe.num_experts"):
        cfg.validate()
