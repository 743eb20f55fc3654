"""The fused log-prob/entropy Triton kernels compiled on CUDA, and the trainer's fused path on one GPU.

Needs a CUDA GPU with triton (skipped otherwise by the hardware guard in conftest.py). The kernels at a
moderate size (T=1,000 tokens, H=512, V=32,000 with a padded tail, several vocab splits) are checked against
the naive full-logits computation in fp64 on the same device (values and gradients of both inputs, fp32 and
bf16 inputs), and against the PyTorch backend; then one RL step of a tiny Megatron-Core policy runs with
rl.logprob_impl='fused' and logprob_kernel.impl='triton' and must match the logits path.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels.logprob import fused_logprob_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                  reason="needs triton (the GPU backend)")]


def _case(dtype, T=1000, H=512, V=32000, vocab_size=31_900, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, H, generator=g, device="cuda").to(dtype).requires_grad_()  # [T, H]
    w = (torch.randn(V, H, generator=g, device="cuda") * 3 / H ** 0.5).to(dtype).requires_grad_()  # [V, H]
    t = torch.randint(0, vocab_size, (T,), generator=g, device="cuda")  # [T]
    ca, cc = torch.randn(2, T, generator=g, device="cuda")  # upstream weights of logprob and entropy
    return h, w, t, ca, cc


def _values_and_grads(lp, ent, h, w, ca, cc):
    gh, gw = torch.autograd.grad((ca * lp + cc * ent).sum(), (h, w))
    return lp.double(), ent.double(), gh.double(), gw.double()


def _naive(h, w, t, temperature, vocab_size, ca, cc):
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp = torch.log_softmax(hd @ wd[:vocab_size].t() / temperature, dim=-1)  # [T, V] fp64
    lp, ent = logp.gather(1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    return _values_and_grads(lp, ent, hd, wd, ca.double(), cc.double())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_kernels_match_naive_on_cuda(dtype, tol, temperature):
    h, w, t, ca, cc = _case(dtype)
    lp, ent = fused_logprob_entropy(h, w, t, temperature=temperature, impl="triton", vocab_size=31_900,
                                    chunk_vocab=4096)
    assert lp.dtype == ent.dtype == torch.float32 and lp.is_cuda
    got = _values_and_grads(lp, ent, h, w, ca, cc)
    want = _naive(h, w, t, temperature, 31_900, ca, cc)
    for name, a, b in zip(("logprob", "entropy", "grad_h", "grad_w"), got, want):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= tol * max(scale, 1.0), (name, float((a - b).abs().max()), scale)
    assert float(got[3][31_900:].abs().max()) == 0.0  # padded vocab rows get no gradient
    torch_lp, torch_ent = fused_logprob_entropy(h, w, t, temperature=temperature, impl="torch",
                                                vocab_size=31_900)
    torch.testing.assert_close(lp, torch_lp, rtol=0, atol=tol)
    torch.testing.assert_close(ent, torch_ent, rtol=0, atol=tol * 10)


def test_auto_picks_triton_on_cuda():
    from kernels.logprob import _backend
    from kernels.logprob.triton_kernels import TritonBackend

    assert _backend("auto", torch.zeros(1, device="cuda")) is TritonBackend


def test_trainer_step_with_triton_matches_logits_path():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.distributed import init_distributed
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.trainer.policy import OptimConfig, Policy
    from megatron_rl.trainer.rl_step import RLTrainer
    from tests.mp.trainer_parity import SEED, batch, model_config, rl_config

    if not parallel_state.model_parallel_is_initialized():
        init_distributed(ParallelConfig(), source="single")
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rl.distributed import DistContext, LaunchInfo

    ctx = DistContext(LaunchInfo(0, 1, 0, "127.0.0.1", 0, "single"), ParallelConfig().resolve(1),
                      torch.distributed.get_backend(), ProcessGroupCollection.use_mpu_process_groups())
    runs = {}
    for impl in ("logits", "fused"):
        torch.manual_seed(SEED)
        model_parallel_cuda_manual_seed(SEED)
        policy = Policy(model_config(2, False), OptimConfig(lr=1e-3, distributed_optimizer=False), ctx,
                        total_steps=2, init=lambda m: init_weights_by_name(m, SEED))
        cfg = rl_config(120, impl)
        cfg.logprob_kernel.impl = "triton"
        trainer = RLTrainer(policy, cfg)
        runs[impl] = [trainer.step(batch(s)) for s in range(2)]
    for a, b in zip(runs["logits"], runs["fused"]):
        assert a["update_ok"] and b["update_ok"]
        for k in ("loss", "entropy_mean", "ref_kl", "tokens"):
            assert abs(a[k] - b[k]) < 1e-4, (k, a[k], b[k])
