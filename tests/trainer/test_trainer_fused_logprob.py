"""The trainer's fused log-prob path (rl.logprob_impl='fused') on one CPU process, against the logits path.

The same Megatron-Core policy (tied and untied embeddings) computes a GRPO loss with a KL reference,
recomputed old log-probs, TIS and an entropy bonus at temperature 0.9, once from Megatron's logits and once
from the final hidden states + output weight through `kernels.logprob.fused_logprob_entropy` (small chunks):
losses, per-token log-probs and every parameter's gradient must agree, and the output layer must not form
logits in fused mode. The TP / PP / SP layouts are in tests/trainer/test_trainer_multiproc.py.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError, from_dict, undocumented_fields
from megatron_rl.parallel import ParallelConfig
from megatron_rl.trainer.rl_step import RLConfig
from tests.mp.trainer_parity import SEED, batch, model_config, rl_config

HIDDEN = 32  # model_config's hidden size


def _ctx():
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rl.distributed import DistContext, LaunchInfo, init_distributed

    if not parallel_state.model_parallel_is_initialized():
        return init_distributed(ParallelConfig(), source="single")
    return DistContext(LaunchInfo(0, 1, 0, "127.0.0.1", 0, "single"), ParallelConfig().resolve(1), "gloo",
                       ProcessGroupCollection.use_mpu_process_groups())


@pytest.fixture(scope="module")
def ctx():
    return _ctx()


def _trainer(ctx, impl: str, tied: bool, max_tokens: int = 120):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.trainer.policy import OptimConfig, Policy
    from megatron_rl.trainer.rl_step import RLTrainer

    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    mcfg = model_config(2, False)
    mcfg.tie_embeddings = tied
    policy = Policy(mcfg, OptimConfig(lr=1e-3, distributed_optimizer=False), ctx, total_steps=2,
                    init=lambda m: init_weights_by_name(m, SEED))
    cfg = rl_config(max_tokens)
    cfg.logprob_impl = impl
    cfg.logprob_kernel.chunk_tokens, cfg.logprob_kernel.chunk_vocab = 7, 24  # several chunks of both
    return RLTrainer(policy, cfg)


def _output_widths(trainer) -> list[int]:
    """Record the last dim of every output-layer output during the trainer's next passes."""
    widths: list[int] = []
    layer = trainer.policy.chunks[-1].module.output_layer
    layer.register_forward_hook(lambda mod, args, out: widths.append(out[0].shape[-1]))
    return widths


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_fused_gradients_equal_logits_path(ctx, tied):
    results = {}
    for impl in ("logits", "fused"):
        trainer = _trainer(ctx, impl, tied)
        widths = _output_widths(trainer)
        loss, grads = trainer.compute_gradients(batch(0))
        mbs, _ = trainer.prepare(batch(0))
        trainer._set_old_and_ref(mbs)
        results[impl] = (loss, grads, torch.cat([mb["old_logprobs"].view(-1) for mb in mbs]), widths)
    (loss0, g0, lp0, w0), (loss1, g1, lp1, w1) = results["logits"], results["fused"]
    assert set(w0) == {64} and set(w1) == {HIDDEN}  # the fused path never formed [T, V] logits
    assert abs(loss0) > 1e-4 and abs(loss1 - loss0) < 1e-6
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    assert sorted(g0) == sorted(g1)
    out_name = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert float(g0[out_name].abs().max()) > 1e-4  # the output weight really receives a gradient
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-7, msg=name)
    if not tied:
        assert float(g1["embedding.word_embeddings.weight"].abs().max()) > 0


@pytest.mark.slow
def test_fused_steps_equal_logits_steps(ctx):
    runs = {}
    for impl in ("logits", "fused"):
        trainer = _trainer(ctx, impl, tied=True)
        metrics = [trainer.step(batch(s)) for s in range(2)]
        runs[impl] = (metrics, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()})
    (m0, p0), (m1, p1) = runs["logits"], runs["fused"]
    for a, b in zip(m0, m1):
        for k in ("loss", "entropy_mean", "ref_kl", "clip_fraction", "tokens", "grad_norm"):
            assert abs(a[k] - b[k]) < 1e-5, (k, a[k], b[k])
    assert abs(m1[1]["loss"] - m1[0]["loss"]) > 1e-6  # the update moved the weights
    for name in p0:
        torch.testing.assert_close(p1[name], p0[name], rtol=0, atol=1e-6, msg=name)


def test_hidden_head_keeps_parameter_names_and_state_dict(ctx):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_rl.models.gpt import build_gpt
    from megatron_rl.models.output_head import emit_hidden, install_hidden_head

    plain = build_gpt(model_config(2, False), ctx.parallel, ctx.pgs)
    headed = build_gpt(model_config(2, False), ctx.parallel, ctx.pgs)
    install_hidden_head(headed)
    install_hidden_head(headed)  # idempotent
    assert isinstance(headed.output_layer, ColumnParallelLinear)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in headed.named_parameters()]
    assert list(plain.state_dict()) == list(headed.state_dict())
    headed.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 64, (1, 12))
    pos = torch.arange(12)[None]
    with torch.no_grad():
        logits = headed(tokens, pos, None)  # flag off: the ordinary logits
        torch.testing.assert_close(logits, plain(tokens, pos, None))
        with emit_hidden(headed) as head:
            hidden = headed(tokens, pos, None)  # [b, s, h]
    assert hidden.shape == (1, 12, HIDDEN) and head.weight_used is headed.embedding.word_embeddings.weight
    torch.testing.assert_close(logits, hidden @ head.weight_used.t())  # hidden is after the final norm
    assert headed.output_layer.emit_hidden is False  # reset after the block
    with pytest.raises(RuntimeError, match="install_hidden_head"):
        with emit_hidden(plain):
            pass


def test_rl_config_logprob_switch():
    assert RLConfig().logprob_impl == "fused"
    assert not undocumented_fields(RLConfig)
    cfg = from_dict(RLConfig, {"logprob_impl": "logits", "logprob_kernel": {"impl": "torch", "chunk_tokens": 64}})
    assert cfg.logprob_impl == "logits" and cfg.logprob_kernel.chunk_tokens == 64
    with pytest.raises(ConfigError, match="logprob_impl"):
        RLConfig(logprob_impl="dense").validate()
    with pytest.raises(ConfigError, match="chunk_tokens"):
        RLConfig(logprob_kernel=from_dict(type(cfg.logprob_kernel), {"chunk_vocab": 0})).validate()
    with pytest.raises(ConfigError, match="impl"):
        from_dict(RLConfig, {"logprob_kernel": {"impl": "cuda"}}).validate()
