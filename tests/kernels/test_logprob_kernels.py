"""Fused log-prob/entropy (kernels.logprob) against the naive full-logits computation, on CPU.

Naive: logp = log_softmax(h @ W.T / temperature), entropy = -(p * logp).sum(-1), with autograd. Losses weight
tokens by a mask and by random per-token coefficients, so the upstream grads of both outputs matter. The
Triton kernels run under TRITON_INTERPRET=1 in a subprocess (the flag must be set before they are compiled).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.config import ConfigError, undocumented_fields
from megatron_rl.kernels.logprob import LogprobKernelConfig, fused_logprob_entropy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def make(T=50, H=32, V=203, seed=0, dtype=torch.float32, scale=3.0, vocab_size=None):
    """hidden [T, H], weight [V, H] (leaf tensors), targets [T] < vocab_size, mask-weighted coefficients [T]."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * scale / H ** 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab_size or V, (T,), generator=g)
    mask = (torch.rand(T, generator=g) < 0.7).to(dtype)  # [T] 0 = token excluded from the loss
    ca, cc = torch.randn(T, generator=g).to(dtype) * mask, torch.randn(T, generator=g).to(dtype) * mask
    return h, w, targets, mask, ca, cc


def naive(h, w, targets, temperature):
    logp_all = torch.log_softmax(h @ w.T / temperature, dim=-1)  # [T, V]
    logprob = logp_all.gather(1, targets[:, None]).squeeze(1)  # [T]
    return logprob, -(logp_all.exp() * logp_all).sum(-1)


def values_and_grads(fn, h, w, ca, cc):
    logprob, entropy = fn(h, w)
    grad_h, grad_w = torch.autograd.grad((ca * logprob + cc * entropy).sum(), (h, w))
    return logprob, entropy, grad_h, grad_w


def assert_matches(got, want, atol=1e-5, rtol=1e-4):
    for name, a, b in zip(("logprob", "entropy", "grad_h", "grad_w"), got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunks", [(7, 13), (512, 4096), (1, 203)])
def test_fp32_values_and_grads_match_naive(temperature, chunks):
    h, w, targets, mask, ca, cc = make()
    fused = lambda h, w: fused_logprob_entropy(h, w, targets, temperature=temperature, chunk_tokens=chunks[0],
                                               chunk_vocab=chunks[1], impl="torch")
    got = values_and_grads(fused, h, w, ca, cc)
    want = values_and_grads(lambda h, w: naive(h, w, targets, temperature), h, w, ca, cc)
    assert_matches(got, want)
    assert got[2][mask == 0].abs().max() == 0, "masked tokens must get zero hidden-state gradient"
    assert got[3].abs().sum() > 0 and got[2].abs().sum() > 0


@pytest.mark.parametrize("which", ["logprob", "entropy"])
def test_single_output_upstream(which):
    """Only one output in the loss: the other's upstream grad is None (autograd materialises zeros)."""
    h, w, targets, _, ca, _ = make(T=30, V=77, seed=1)
    pick = lambda out: out[0] if which == "logprob" else out[1]
    got = torch.autograd.grad((ca * pick(fused_logprob_entropy(h, w, targets, temperature=0.8,
                                                                chunk_vocab=16))).sum(), (h, w))
    want = torch.autograd.grad((ca * pick(naive(h, w, targets, 0.8))).sum(), (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.slow  # torch.autograd.gradcheck in fp64: ~10 s
def test_gradcheck_fp64_with_padded_vocab():
    """fp64 inputs keep fp64 statistics, so finite differences check both gradients, padding rows included."""
    h, w, targets, _, _, _ = make(T=6, H=4, V=17, dtype=torch.float64, vocab_size=15)
    fn = lambda h, w: fused_logprob_entropy(h, w, targets, temperature=0.9, chunk_tokens=4, chunk_vocab=7,
                                            vocab_size=15)
    assert torch.autograd.gradcheck(fn, (h, w))


def test_padded_vocab_equals_naive_on_real_rows():
    h, w, targets, _, ca, cc = make(vocab_size=190)
    got = values_and_grads(lambda h, w: fused_logprob_entropy(h, w, targets, temperature=1.2, chunk_vocab=64,
                                                              vocab_size=190), h, w, ca, cc)
    want = values_and_grads(lambda h, w: naive(h, w[:190], targets, 1.2), h, w, ca, cc)
    assert_matches(got, want)
    assert got[3][190:].abs().max() == 0, "padding rows of W must get zero gradient"


def test_large_logits_stay_finite_and_exact():
    """Logits in the hundreds (and an fp32 lse far from 0): no overflow, matches fp64 naive."""
    h, w, targets, _, ca, cc = make(T=20, V=300, scale=60.0)
    got = values_and_grads(lambda h, w: fused_logprob_entropy(h, w, targets, temperature=0.5, chunk_vocab=32),
                           h, w, ca, cc)
    want = values_and_grads(lambda h, w: naive(h.double(), w.double(), targets, 0.5), h, w, ca, cc)
    assert all(torch.isfinite(x).all() for x in got)
    assert_matches(got, want, atol=2e-3, rtol=1e-4)


def test_bf16_inputs_give_fp32_outputs_and_input_dtype_grads():
    h, w, targets, _, ca, cc = make(dtype=torch.bfloat16)
    logprob, entropy, grad_h, grad_w = values_and_grads(
        lambda h, w: fused_logprob_entropy(h, w, targets, temperature=0.7, chunk_vocab=64), h, w, ca, cc)
    assert logprob.dtype == entropy.dtype == torch.float32
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16
    # The torch backend rounds logits to bf16 like a bf16 matmul does; compare with fp32 math on bf16 logits.
    want = naive(h.detach().float(), w.detach().float(), targets, 0.7)
    torch.testing.assert_close(logprob, want[0], atol=0.3, rtol=0.05)
    torch.testing.assert_close(entropy, want[1], atol=0.1, rtol=0.05)


class _MaxAlloc(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_never_materialises_token_by_vocab_tensors():
    """Forward + backward: no tensor bigger than W (the grad of W) or one chunk; naive makes [T, V] ones."""
    T, H, V, ct, cv = 128, 16, 1024, 32, 256
    h, w, targets, _, ca, cc = make(T=T, H=H, V=V)
    with _MaxAlloc() as fused_mode:
        values_and_grads(lambda h, w: fused_logprob_entropy(h, w, targets, chunk_tokens=ct, chunk_vocab=cv),
                         h, w, ca, cc)
    with _MaxAlloc() as naive_mode:
        values_and_grads(lambda h, w: naive(h, w, targets, 1.0), h, w, ca, cc)
    assert naive_mode.max_numel == T * V
    assert fused_mode.max_numel <= max(V * H, ct * cv), fused_mode.max_numel


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(impl="cuda"), "impl='cuda'"),
    (dict(vocab_size=500), "vocab_size=500"),
    (dict(chunk_vocab=0), "chunk_vocab (0)"),
])
def test_bad_arguments_are_named(kwargs, message):
    h, w, targets, *_ = make(T=4, V=10)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fused_logprob_entropy(h, w, targets, **kwargs)


def test_bad_inputs_are_named():
    h, w, targets, *_ = make(T=4, V=10)
    with pytest.raises(ValueError, match=r"target ids \[-100\] outside \[0, 10\)"):
        fused_logprob_entropy(h, w, torch.tensor([1, -100, 2, 3]))
    with pytest.raises(ValueError, match="hidden \\[T, H\\]"):
        fused_logprob_entropy(h[None], w, targets)
    with pytest.raises(ValueError, match="targets must be int32/int64"):
        fused_logprob_entropy(h, w, targets.float())
    with pytest.raises(ValueError, match="share a float dtype"):
        fused_logprob_entropy(h, w.double(), targets)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton)")
def test_triton_on_cpu_without_interpreter_is_refused():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs Triton's interpreter; the refusal is for compiled Triton on CPU")
    h, w, targets, *_ = make(T=4, V=10)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_logprob_entropy(h, w, targets, impl="triton")


def test_config_builds_and_validates():
    assert undocumented_fields(LogprobKernelConfig) == []
    fn = LogprobKernelConfig(chunk_tokens=8, chunk_vocab=16).build()
    h, w, targets, *_ = make(T=10, V=40)
    torch.testing.assert_close(fn(h, w, targets)[0], naive(h, w, targets, 1.0)[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="logprob.impl='gpu'"):
        LogprobKernelConfig(impl="gpu").build()


def _interpreter_case(dtype, vocab_size, temperature, T=37, H=40, V=101) -> dict:
    """Max abs errors of the Triton backend vs fp64 naive, relative to each quantity's largest magnitude."""
    h, w, targets, mask, ca, cc = make(T=T, H=H, V=V, dtype=dtype, vocab_size=vocab_size)
    v = vocab_size or V
    got = values_and_grads(lambda h, w: fused_logprob_entropy(
        h, w, targets, temperature=temperature, chunk_vocab=32, impl="triton", vocab_size=vocab_size),
        h, w, ca.float(), cc.float())
    want = values_and_grads(lambda h, w: naive(h.double(), w[:v].double(), targets, temperature),
                            h, w, ca.double(), cc.double())
    errors = {k: float((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-6))
              for k, a, b in zip(("logprob", "entropy", "grad_h", "grad_w"), got, want)}
    errors["masked_grad_h"] = float(got[2][mask == 0].abs().max())
    errors["padding_grad_w"] = float(got[3][v:].abs().max()) if v < V else 0.0
    return errors


def _interpreter_errors() -> dict:
    """Run in a TRITON_INTERPRET=1 subprocess (the flag must be set before the kernels are defined)."""
    return {"fp32": _interpreter_case(torch.float32, 90, 0.7), "fp32_t1": _interpreter_case(torch.float32, None, 1.0),
            "bf16": _interpreter_case(torch.bfloat16, None, 1.3)}


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton); interpreter needs it")
def test_triton_kernels_match_naive_under_interpreter():
    code = "import json, tests.kernels.test_logprob_kernels as t; print(json.dumps(t._interpreter_errors()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, errs in errors.items():  # relative to the largest magnitude of each quantity
        tol = 2e-2 if name == "bf16" else 2e-5  # bf16: inputs exact, grads rounded to bf16 (2^-8)
        for key in ("logprob", "entropy", "grad_h", "grad_w"):
            assert errs[key] < tol, (name, key, errs)
        assert errs["masked_grad_h"] == 0 and errs["padding_grad_w"] == 0, (name, errs)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_logits_give_the_recomputed_values_and_grads_with_one_logits_matmul_less(temperature, monkeypatch):
    """keep_logits_bytes: within the budget the backward reuses the forward's logits chunks (bitwise the same
    values and gradients as recomputing them, one [T, H] x [H, V] product less); over it, it recomputes."""
    import megatron_rl.kernels.logprob.reference as ref

    h, w, targets, _, ca, cc = make(T=40, V=203)
    calls = []
    logits = ref._logits
    monkeypatch.setattr(ref, "_logits", lambda h_s, w_v: calls.append(1) or logits(h_s, w_v))
    runs = {}
    for budget in (0, 40 * 203 * 4, 40 * 203 * 4 - 1):
        calls.clear()
        runs[budget] = (values_and_grads(lambda h, w, budget=budget: fused_logprob_entropy(
            h, w, targets, temperature=temperature, chunk_tokens=16, chunk_vocab=64, impl="torch",
            keep_logits_bytes=budget), h, w, ca, cc), len(calls))
    (base, n_recompute), (kept, n_kept), (over, n_over) = runs.values()
    assert n_recompute == n_over == 2 * 3 * 4 and n_kept == 3 * 4  # 3 token x 4 vocab chunks, fwd (+ bwd)
    for a, b, c in zip(base, kept, over):
        assert torch.equal(a, b) and torch.equal(a, c)
    copies = []  # a pass without grad (the loop's log-prob passes) copies no logits: no backward will use them
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: copies.append(1) or t.new_empty(0))
    with torch.no_grad():
        fused_logprob_entropy(h, w, targets, chunk_tokens=16, chunk_vocab=64, impl="torch",
                              keep_logits_bytes=1 << 30)
    assert copies == []
