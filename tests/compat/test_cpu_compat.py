"""megatron_rl.compat.cpu: apply/revert/idempotence, the env var, reasons; testing.init_weights_by_name helpers.

Single process. Each patch is checked through the behaviour it changes (before, with, after revert);
tests/compat/test_cpu_compat_multiproc.py shows that each one is still needed for real training.
"""
import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rl.compat import cpu
from megatron_rl.compat.testing import _local_slice, global_param_names

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-compat patches apply only without CUDA")

LAYOUTS_SCRIPT = Path(__file__).parents[1] / "mp" / "compat_layouts.py"


@pytest.fixture(autouse=True)
def reverted(monkeypatch):
    """Every test starts and ends with no patch applied and no disable variable set; afterwards the patches
    that were applied before (by an earlier test of this process) are applied again."""
    before = [name for name, patch in cpu.PATCHES.items() if patch.applied]
    monkeypatch.delenv(cpu.ENV_DISABLE, raising=False)
    cpu.revert_all()
    yield
    cpu.revert_all()
    monkeypatch.undo()  # the test's env var and its fake torch.cuda.is_available must not block re-applying
    if before:
        cpu.apply(enable=before)


def _must(condition: bool) -> None:
    if not condition:
        raise AssertionError("probe condition false")


def _raises(fn) -> bool:
    try:
        fn()
    except Exception:
        return True
    return False


def _custom_backward_alloc() -> torch.Tensor:
    """Backward of a custom Function allocating on torch.cuda.current_device() (Megatron's comm ops do)."""

    class Alloc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2 + torch.zeros(1, device="cuda")

    x = torch.ones(2, requires_grad=True)
    Alloc.apply(x).sum().backward()
    return x.grad


def _sp_norm():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    config.sequence_parallel = True  # the validated config refuses SP at TP=1; the norm sees TP+SP here
    return WrappedTorchNorm(config, 8)


def _clip_grads():
    from megatron.core.optimizer import clip_grads

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=0.5)  # no scaling needed


def _tracker_add():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("x", 7)
    with tracker.fork("x"):
        return torch.rand(2)


def _split_sizes_as_numpy():
    from megatron.core.transformer.moe import token_dispatcher

    return isinstance(token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True), np.ndarray)


def _router_gemm_defined():
    from megatron.core.transformer.moe import moe_utils

    return "te_general_gemm" in vars(moe_utils)


def _mla_te_probe():
    """MLA's build-time check `HAVE_TE and isinstance(linear_proj, TELinear)` with TE absent."""
    from megatron.core.transformer import multi_latent_attention as mla

    return mla.HAVE_TE and isinstance(torch.nn.Linear(1, 1), mla.TELinear)


def _module_attr(module: str, *attrs: str):
    return lambda: functools.reduce(getattr, attrs, importlib.import_module(module))


# Observable effect of each patch: a callable that raises (or returns False) without it and works with it.
PROBES = {
    "cuda_runtime_stubs": lambda: (torch.cuda.current_device(), torch.cuda.synchronize(), torch.cuda.Stream()),
    "cuda_device_mode": lambda: _must(torch.zeros(1, device="cuda").device.type == "cpu"),
    "cpu_rng_tracker": _tracker_add,
    "moe_router_gemm": lambda: _must(_router_gemm_defined()),
    "moe_split_sizes_numpy": lambda: _must(_split_sizes_as_numpy()),
    "sequence_parallel_torch_norm": _sp_norm,
    "cuda_type_names_in_clip_grads": _clip_grads,
    "mla_te_probe": _mla_te_probe,
}
# Patches whose effect needs several ranks (or a DistributedOptimizer): checked by identity of the swapped
# function here, by behaviour in tests/compat/test_cpu_compat_multiproc.py.
SWAPPED = {
    "cuda_type_names_in_optimizers": _module_attr("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
                                                  "__init__"),
    "gloo_uneven_gather": _module_attr("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"),
    "gloo_p2p_tags": _module_attr("megatron.core.pipeline_parallel.p2p_communication", "_batched_p2p_ops"),
}


def test_every_patch_is_probed_here():
    assert set(PROBES) | set(SWAPPED) == set(cpu.PATCHES)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_patch_changes_behaviour_and_revert_restores_it(name):
    assert _raises(PROBES[name]), f"{name}: the probe works without the patch; is the patch still needed?"
    assert cpu.apply(enable=[name]) == [name]
    PROBES[name]()
    cpu.PATCHES[name].revert()
    assert _raises(PROBES[name])


@pytest.mark.parametrize("name", sorted(SWAPPED))
def test_collective_patch_swaps_and_restores(name):
    original = SWAPPED[name]()
    cpu.apply(enable=[name])
    assert SWAPPED[name]() is not original
    cpu.PATCHES[name].revert()
    assert SWAPPED[name]() is original


def test_custom_backward_runs_under_the_device_mode():
    """torch 2.13 runs autograd's engine outside the mode's handler; backward allocations still map to CPU."""
    assert _raises(_custom_backward_alloc)
    cpu.apply(enable=["cuda_device_mode"])
    assert torch.equal(_custom_backward_alloc(), torch.full((2,), 2.0))


def test_apply_all_is_idempotent():
    first = cpu.apply()
    assert first == list(cpu.PATCHES)
    assert cpu.apply() == first
    modes = [m for m in torch.overrides._get_current_function_mode_stack() if isinstance(m, cpu.CpuDeviceMode)]
    assert len(modes) == 1


def test_revert_all_leaves_nothing_applied():
    cpu.apply()
    cpu.revert_all()
    assert not any(p.applied for p in cpu.PATCHES.values())
    assert torch.overrides._get_current_function_mode_stack() == []
    assert _raises(torch.cuda.current_device)


def test_env_var_switches_patches_off(monkeypatch):
    monkeypatch.setenv(cpu.ENV_DISABLE, "cuda_device_mode, cpu_rng_tracker")
    applied = cpu.apply()
    assert "cuda_device_mode" not in applied and "cpu_rng_tracker" not in applied
    assert "cuda_runtime_stubs" in applied
    assert _raises(PROBES["cuda_device_mode"])


def test_env_var_reverts_a_patch_applied_earlier(monkeypatch):
    cpu.apply()
    monkeypatch.setenv(cpu.ENV_DISABLE, "cuda_type_names_in_clip_grads")
    assert "cuda_type_names_in_clip_grads" not in cpu.apply()
    assert _raises(_clip_grads)
    monkeypatch.delenv(cpu.ENV_DISABLE)
    assert "cuda_type_names_in_clip_grads" in cpu.apply()


def test_disable_argument_wins_over_enable():
    assert cpu.apply(enable=["moe_router_gemm", "cpu_rng_tracker"], disable=["cpu_rng_tracker"]) == [
        "moe_router_gemm"
    ]


@pytest.mark.parametrize("how", ["enable", "disable", "env"])
def test_unknown_patch_name_is_rejected_with_the_valid_ones(how, monkeypatch):
    kwargs = {"enable": ["no_such_patch"]} if how == "enable" else {}
    if how == "disable":
        kwargs = {"disable": ["no_such_patch"]}
    if how == "env":
        monkeypatch.setenv(cpu.ENV_DISABLE, "no_such_patch")
    with pytest.raises(ValueError, match="no_such_patch.*cuda_device_mode"):
        cpu.apply(**kwargs)


def test_noop_when_cuda_is_available(monkeypatch):
    # A mock of a GPU (none here): apply() must then leave Megatron and torch untouched.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu.apply() == []
    assert not any(p.applied for p in cpu.PATCHES.values())


def test_revert_refuses_to_pop_someone_elses_mode():
    cpu.apply(enable=["cuda_device_mode"])
    with torch.overrides.TorchFunctionMode():
        with pytest.raises(RuntimeError, match="another TorchFunctionMode"):
            cpu.PATCHES["cuda_device_mode"].revert()
    cpu.PATCHES["cuda_device_mode"].revert()
    assert torch.overrides._get_current_function_mode_stack() == []


def test_every_patch_has_a_one_line_reason_and_a_known_scenario(monkeypatch):
    spec = importlib.util.spec_from_file_location("tests_mp_compat_layouts_fast", LAYOUTS_SCRIPT)
    layouts = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, layouts)  # its dataclasses look themselves up there
    spec.loader.exec_module(layouts)
    for name, patch in cpu.PATCHES.items():
        assert patch.name == name
        assert "\n" not in patch.reason and len(patch.reason) > 40, name
        assert "'" in patch.reason or '"' in patch.reason, f"{name}: reason should quote the error seen"
        assert layouts.needed_layout(patch) in layouts.LAYOUTS, f"{name}: is_needed names an unknown layout"


def test_local_slice_keeps_glu_halves_together():
    full = torch.arange(8.0)[:, None].expand(8, 3)  # [8, 3]: rows 0-3 gate, 4-7 up
    param = torch.nn.Parameter(torch.empty(4, 3))
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 2
    assert _local_slice(full, param, 0, 2)[:, 0].tolist() == [0, 1, 4, 5]
    assert _local_slice(full, param, 1, 2)[:, 0].tolist() == [2, 3, 6, 7]


def test_global_names_undo_layer_offsets_and_wrappers():
    class Layer(torch.nn.Module):
        def __init__(self, number):
            super().__init__()
            self.layer_number = number
            self.w = torch.nn.Parameter(torch.zeros(1))

    stage = torch.nn.Module()
    stage.decoder = torch.nn.Module()
    stage.decoder.layers = torch.nn.ModuleList([Layer(3), Layer(4)])  # second pipeline stage: layers 2, 3
    wrapped = torch.nn.Module()
    wrapped.module = stage
    names = global_param_names(wrapped)
    assert names == {"module.decoder.layers.0.w": "decoder.layers.2.w",
                     "module.decoder.layers.1.w": "decoder.layers.3.w"}
