"""Megatron-Core on CPU: a few named patches, applied only when CUDA is absent.

Megatron-Core assumes CUDA in places (buffers on ``torch.cuda.current_device()``, the CUDA RNG tracker,
``device="cuda"`` literals, ``Tensor.type() == 'torch.cuda.FloatTensor'`` checks) and assumes TE/Apex
or NCCL in a few more (the MoE router GEMM, sequence-parallel norms, uneven all-gathers). Each patch
below is one function named after what it fixes; its ``reason`` quotes the error seen without it, and
``is_needed`` names the scenario in ``tests/mp/compat_layouts.py`` that fails when it is switched off
(``tests/compat/test_cpu_compat_multiproc.py`` checks that each one is still needed after an upgrade).

Usage: ``megatron_rl.compat.cpu.apply()`` once per process, before building Megatron models. A test or
a run can switch patches off with ``MEGATRON_RL_CPU_COMPAT_DISABLE=name1,name2``. Patches act on the
calling thread's torch-function mode stack (``cuda_device_mode``) and on module attributes (the rest).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

ENV_DISABLE = "MEGATRON_RL_CPU_COMPAT_DISABLE"
"""Comma-separated patch names that apply() leaves off (and reverts if they are on)."""

_MISSING = object()
Undo = Callable[[], None]


@dataclass
class Patch:
    """One named monkeypatch; ``apply()``/``revert()`` are idempotent."""

    name: str
    """Identifier used in apply(enable/disable) and in MEGATRON_RL_CPU_COMPAT_DISABLE."""
    reason: str
    """One line: what fails without it, with the error message seen (megatron-core 0.16.1)."""
    is_needed: str
    """The scenario that fails with this patch off (tests/mp/compat_layouts.py)."""
    install: Callable[[], list[Undo]] = field(repr=False)
    """Applies the patch and returns the callables that undo it, in order."""
    _undo: list[Undo] | None = field(default=None, repr=False)

    @property
    def applied(self) -> bool:
        """Whether the patch is currently in effect."""
        return self._undo is not None

    def apply(self) -> None:
        """Install the patch (no-op if already installed)."""
        if self._undo is None:
            self._undo = self.install()

    def revert(self) -> None:
        """Undo the patch (no-op if not installed); if an undo step raises, the rest stay pending."""
        while self._undo:
            self._undo[-1]()
            self._undo.pop()
        self._undo = None


def _swap(owner: Any, attr: str, new: Any) -> Undo:
    """Set ``owner.attr = new`` and return a callable restoring the previous value (or absence)."""
    old = vars(owner).get(attr, _MISSING)
    setattr(owner, attr, new)

    def undo() -> None:
        if old is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, old)

    return undo


def _wrap_method(cls: type, attr: str, wrapper: Callable[[Callable], Callable]) -> Undo:
    """Wrap ``cls.attr`` with ``wrapper``, keeping a staticmethod/classmethod a descriptor of its kind."""
    raw = vars(cls)[attr]
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    new = wrapper(raw.__func__ if kind else raw)
    return _swap(cls, attr, kind(new) if kind else new)


# --------------------------------------------------------------------------------------------------
# cuda_runtime_stubs
# --------------------------------------------------------------------------------------------------
class _CpuEvent:
    """Stand-in for torch.cuda.Event: CPU work is synchronous, so every event has completed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _CpuStream:
    """Stand-in for torch.cuda.Stream: one in-order CPU stream, so waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event or _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _CpuStream()


def _patch_cuda_runtime_stubs() -> list[Undo]:
    """torch.cuda runtime calls -> CPU: current_device() is the CPU device; streams/events are no-ops.

    Returning ``torch.device("cpu")`` (not an index) keeps ``torch.empty(..., device=current_device())``
    on CPU without help from ``cuda_device_mode`` (e.g. in autograd hooks, which it does not cover).
    """
    stubs = {
        "current_device": lambda: torch.device("cpu"),
        "synchronize": lambda device=None: None,
        "Stream": _CpuStream,
        "Event": _CpuEvent,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(),
    }
    return [_swap(torch.cuda, name, fn) for name, fn in stubs.items()]


# --------------------------------------------------------------------------------------------------
# cuda_device_mode
# --------------------------------------------------------------------------------------------------
def _is_cuda_like(device: Any) -> bool:
    """Whether ``device`` names a CUDA device: 'cuda', 'cuda:1', torch.device('cuda', 0) or an index."""
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class CpuDeviceMode(TorchFunctionMode):
    """Maps CUDA placements to CPU: ``device="cuda"``/index kwargs, ``.cuda()``, ``.to("cuda")``,
    ``pin_memory`` (kwarg and method) and ``record_stream``."""

    _IDENTITY = (torch.Tensor.cuda, torch.Tensor.pin_memory)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._IDENTITY:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if _is_cuda_like(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_like(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _active_in_backward(mode: CpuDeviceMode) -> Callable[[Callable], Callable]:
    """Wrap BackwardCFunction.apply so custom autograd ``backward``s run under ``mode``.

    torch 2.13 dispatches ``Tensor.backward``/``torch.autograd.backward``/``grad`` through the mode
    hook, and a mode is popped while its handler runs: without this, autograd's engine (Megatron's
    communication Functions) would run with no remapping.
    """

    def wrapper(orig: Callable) -> Callable:
        @functools.wraps(orig)
        def apply(self, *args):
            if mode in torch.overrides._get_current_function_mode_stack():
                return orig(self, *args)
            with mode:
                return orig(self, *args)

        return apply

    return wrapper


def _patch_cuda_device_mode() -> list[Undo]:
    """Push a CpuDeviceMode on this thread's torch-function mode stack, active in backward too."""
    mode = CpuDeviceMode()
    backward_cls = torch.autograd.function.BackwardCFunction
    undo = [_wrap_method(backward_cls, attr, _active_in_backward(mode)) for attr in ("apply", "apply_boxed")]
    mode.__enter__()

    def pop() -> None:
        stack = torch.overrides._get_current_function_mode_stack()
        if not stack or stack[-1] is not mode:
            raise RuntimeError("cuda_device_mode: another TorchFunctionMode was entered after it and "
                               "is still active; exit that mode before reverting this patch")
        mode.__exit__(None, None, None)

    return [*undo, pop]


# --------------------------------------------------------------------------------------------------
# cpu_rng_tracker
# --------------------------------------------------------------------------------------------------
def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """megatron's _get_cuda_rng_state on the CPU generator."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """megatron's _set_cuda_rng_state on the CPU generator."""
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add creating the named state from the CPU generator."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    orig_state = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig_state)


def _drop_cpu_rng_warning(record: logging.LogRecord) -> bool:
    """Log filter: fork() warns when the CPU RNG changes inside it, which it now always does."""
    return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_cpu_rng_tracker() -> list[Undo]:
    """The model-parallel RNG tracker forks/sets the CPU generator instead of the CUDA one."""
    from megatron.core.tensor_parallel import random as mrandom

    logger = logging.getLogger(mrandom.__name__)
    logger.addFilter(_drop_cpu_rng_warning)
    return [
        lambda: logger.removeFilter(_drop_cpu_rng_warning),
        _swap(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state),
        _swap(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state),
        _swap(mrandom.CudaRNGStatesTracker, "add", _cpu_tracker_add),
    ]


# --------------------------------------------------------------------------------------------------
# moe_router_gemm
# --------------------------------------------------------------------------------------------------
def _patch_moe_router_gemm() -> list[Undo]:
    """Define moe_utils.te_general_gemm = None (0.16.1 tests it without importing it when TE is absent)."""
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" in vars(moe_utils):
        return []
    return [_swap(moe_utils, "te_general_gemm", None)]


# --------------------------------------------------------------------------------------------------
# moe_split_sizes_numpy
# --------------------------------------------------------------------------------------------------
def _move_to_cpu_numpy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """maybe_move_tensor_to_cpu that also converts CPU tensors to numpy when asked."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor.cpu() if torch.is_tensor(tensor) else tensor


def _patch_moe_split_sizes_numpy() -> list[Undo]:
    """The alltoall dispatcher gets its split sizes as numpy arrays (it converts only CUDA tensors)."""
    from megatron.core.transformer.moe import token_dispatcher

    return [_swap(token_dispatcher, "maybe_move_tensor_to_cpu", _move_to_cpu_numpy)]


# --------------------------------------------------------------------------------------------------
# sequence_parallel_torch_norm
# --------------------------------------------------------------------------------------------------
def _sp_norm_new(orig_new: Callable) -> Callable:
    """WrappedTorchNorm.__new__ accepting sequence_parallel: the norm is built without it and its
    parameters are marked ``sequence_parallel`` so finalize_model_grads all-reduces their grads over TP."""

    @functools.wraps(orig_new)
    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return orig_new(cls, config, hidden_size, eps, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = orig_new(cls, plain, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new


def _patch_sequence_parallel_torch_norm() -> list[Undo]:
    """Torch LayerNorm/RMSNorm usable with sequence parallelism (no Apex/TE norm here)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return [_wrap_method(WrappedTorchNorm, "__new__", _sp_norm_new)]


# --------------------------------------------------------------------------------------------------
# cuda_type_names_in_clip_grads, cuda_type_names_in_optimizers
# --------------------------------------------------------------------------------------------------
class _CudaTypeNameMode(TorchFunctionMode):
    """``Tensor.type()`` of a CPU tensor reports the CUDA name ('torch.FloatTensor' ->
    'torch.cuda.FloatTensor'); active only inside the wrapped Megatron functions."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return result if result.startswith("torch.cuda.") else result.replace("torch.", "torch.cuda.", 1)
        return result


def _with_cuda_type_names(fn: Callable) -> Callable:
    """Run ``fn`` with _CudaTypeNameMode active."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _CudaTypeNameMode():
            return fn(*args, **kwargs)

    return wrapped


def _patch_cuda_type_names_in_clip_grads() -> list[Undo]:
    """clip_grad_by_total_norm_fp32 (also imported by name into optimizer.py) sees CUDA type names."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    return [
        _swap(clip_grads, "clip_grad_by_total_norm_fp32", clip),
        _swap(moptimizer, "clip_grad_by_total_norm_fp32", clip),
    ]


def _patch_cuda_type_names_in_optimizers() -> list[Undo]:
    """Optimizer set-up (DistributedOptimizer; Float16Optimizer for bf16/fp16) sees CUDA type names.

    Without it a bf16 parameter ('torch.BFloat16Tensor') would fall through to the fp32 branch's TypeError.
    """
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer import optimizer as moptimizer

    dist_opt = distrib_optimizer.DistributedOptimizer
    return [
        _wrap_method(dist_opt, "_build_model_and_main_param_groups", _with_cuda_type_names),
        _wrap_method(dist_opt, "__init__", _with_cuda_type_names),
        _wrap_method(moptimizer.Float16OptimizerWithFloat16Params, "__init__", _with_cuda_type_names),
    ]


# --------------------------------------------------------------------------------------------------
# gloo_uneven_gather
# --------------------------------------------------------------------------------------------------
def _gather_first_dim_uneven(orig: Callable) -> Callable:
    """_gather_along_first_dim with output_split_sizes done as a padded all_gather_into_tensor."""

    @functools.wraps(orig)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        rest, longest = list(input_.shape[1:]), max(output_split_sizes)
        padded = input_.new_zeros([longest, *rest])  # [max_r n_r, ...]
        padded[: input_.shape[0]] = input_
        out = input_.new_empty([group.size() * longest, *rest])  # [world * max_r n_r, ...]
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        blocks = out.view(group.size(), longest, *rest)  # [world, max_r n_r, ...]
        return torch.cat([blocks[r, :n] for r, n in enumerate(output_split_sizes)])  # [sum_r n_r, ...]

    return gather


def _patch_gloo_uneven_gather() -> list[Undo]:
    """Uneven first-dim all-gather (MoE with expert TP and EP) as a padded even one; gloo's list
    all_gather wants equal sizes (its list reduce_scatter accepts uneven ones: left alone)."""
    from megatron.core.tensor_parallel import mappings

    gather = _gather_first_dim_uneven(mappings._gather_along_first_dim)
    return [_swap(mappings, "_gather_along_first_dim", gather)]


# --------------------------------------------------------------------------------------------------
# gloo_p2p_tags
# --------------------------------------------------------------------------------------------------
_FORWARD_TAG, _BACKWARD_TAG = 1, 2
"""P2P tags by direction of flow: activations (send_next -> recv_prev), gradients (send_prev -> recv_next)."""


def _tagged_batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                            group, prev_pipeline_rank, next_pipeline_rank):
    """_batched_p2p_ops with one tag per direction, so gloo matches each message to its own receive. The ops
    are torch's own isend/irecv (P2POp accepts no other; the device check wraps `torch.distributed.isend`, and
    leaves Megatron-Core's pipeline p2p unchecked anyway)."""
    from torch.distributed import distributed_c10d as c10d

    dist = torch.distributed
    plan = [
        (c10d.isend, tensor_send_prev, prev_pipeline_rank, _BACKWARD_TAG),
        (c10d.irecv, tensor_recv_prev, prev_pipeline_rank, _FORWARD_TAG),
        (c10d.isend, tensor_send_next, next_pipeline_rank, _FORWARD_TAG),
        (c10d.irecv, tensor_recv_next, next_pipeline_rank, _BACKWARD_TAG),
    ]
    ops = [dist.P2POp(op, t, peer, group, tag) for op, t, peer, tag in plan if t is not None]
    return dist.batch_isend_irecv(ops) if ops else []


def _patch_gloo_p2p_tags() -> list[Undo]:
    """Pipeline p2p batches tag activations and gradients differently."""
    from megatron.core.pipeline_parallel import p2p_communication

    return [_swap(p2p_communication, "_batched_p2p_ops", _tagged_batched_p2p_ops)]


# --------------------------------------------------------------------------------------------------
# mla_te_probe
# --------------------------------------------------------------------------------------------------
def _patch_mla_te_probe() -> list[Undo]:
    """multi_latent_attention.HAVE_TE = False when TE is absent (0.16.1 sets it True: its TE extension module
    imports without TE and hands out MagicMock stand-ins, so `isinstance(linear_proj, TELinear)` raises)."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is not None or not mla.HAVE_TE:
        return []
    return [_swap(mla, "HAVE_TE", False)]


# --------------------------------------------------------------------------------------------------
# Registry and entry point
# --------------------------------------------------------------------------------------------------
PATCHES: dict[str, Patch] = {
    p.name: p
    for p in [
        Patch(
            "cuda_runtime_stubs",
            "torch.cuda.current_device()/synchronize()/Stream()/current_stream() (GlobalMemoryBuffer, "
            "layers, p2p, DDP buffers, MoE dtoh stream): 'AssertionError: Torch not compiled with CUDA "
            "enabled'",
            "dense_tp2: TP=2 GPT build and train",
            _patch_cuda_runtime_stubs,
        ),
        Patch(
            "cuda_device_mode",
            "device='cuda' literals and .cuda() (optimizer loss-scale tensor, causal mask, schedules' token "
            "counter, clip-grad buffers): 'AssertionError: Torch not compiled with CUDA enabled'",
            "dense_dp2: DP=2 GPT train steps",
            _patch_cuda_device_mode,
        ),
        Patch(
            "cpu_rng_tracker",
            "model_parallel_cuda_manual_seed -> CudaRNGStatesTracker.add calls torch.cuda.get_rng_state(): "
            "'AssertionError: Torch not compiled with CUDA enabled'",
            "dense_dp2: model_parallel_cuda_manual_seed",
            _patch_cpu_rng_tracker,
        ),
        Patch(
            "moe_router_gemm",
            "MoE router forward without TE (0.16.1): \"NameError: name 'te_general_gemm' is not defined\"",
            "moe_ep2_alltoall: first MoE forward",
            _patch_moe_router_gemm,
        ),
        Patch(
            "moe_split_sizes_numpy",
            "MoE alltoall dispatcher with EP>1 keeps its split sizes as CPU tensors (it converts only CUDA "
            "ones to numpy): 'TypeError: all_to_all_single(): incompatible function arguments'",
            "moe_ep2_alltoall: EP=2 alltoall MoE train step",
            _patch_moe_split_sizes_numpy,
        ),
        Patch(
            "sequence_parallel_torch_norm",
            "TP+SP with the local spec (no Apex/TE norm): "
            "'AssertionError: sequence parallel not supported by torch LayerNorm'",
            "dense_tp2_sp: TP=2 + sequence parallel GPT build",
            _patch_sequence_parallel_torch_norm,
        ),
        Patch(
            "cuda_type_names_in_clip_grads",
            "clip_grad_by_total_norm_fp32 asserts param.grad.type() == 'torch.cuda.FloatTensor': bare "
            "'AssertionError' at clip_grads.py:167",
            "dense_dp2: clipped optimizer step",
            _patch_cuda_type_names_in_clip_grads,
        ),
        Patch(
            "cuda_type_names_in_optimizers",
            "DistributedOptimizer set-up checks param.type(): 'TypeError: Wrapped parameters must be one of "
            "torch.cuda.FloatTensor, torch.cuda.HalfTensor, or torch.cuda.BFloat16Tensor. Received "
            "torch.FloatTensor'",
            "distopt_dp2: DistributedOptimizer build",
            _patch_cuda_type_names_in_optimizers,
        ),
        Patch(
            "gloo_uneven_gather",
            "MoE alltoall dispatcher with expert-TP>1 and EP>1 gathers uneven token counts over TP: "
            "'RuntimeError: ProcessGroupGloo::allgather: invalid tensor size at index 1'",
            "moe_tp2_ep2_sp: TP=2 x EP=2 + SP MoE train steps (4 ranks)",
            _patch_gloo_uneven_gather,
        ),
        Patch(
            "gloo_p2p_tags",
            "PP=2 with virtual pipeline: gloo matches a batch's isend/irecv to the same peer in posting "
            "order, so activations and gradients swap: no error, wrong losses (4.9287 vs 4.8978 at step 0)",
            "pp2_vpp2: PP=2 x VPP=2 train steps",
            _patch_gloo_p2p_tags,
        ),
        Patch(
            "mla_te_probe",
            "multi-latent attention build without TE (0.16.1): 'TypeError: isinstance() arg 2 must be a type, "
            "a tuple of types, or a union' (TELinear is a MagicMock stand-in)",
            "mla_tp2: TP=2 MLA (DeepSeek-V3 attention) build and train",
            _patch_mla_te_probe,
        ),
    ]
}


def _names(names: Iterable[str], what: str) -> list[str]:
    """Validate patch names, raising a ValueError that names the bad one and the valid ones."""
    names = [names] if isinstance(names, str) else names
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in PATCHES]
    if unknown:
        raise ValueError(f"unknown CPU-compat patch {unknown[0]!r} in {what}; valid: {sorted(PATCHES)}")
    return names


def apply(enable: Iterable[str] | None = None, disable: Iterable[str] = ()) -> list[str]:
    """Apply the CPU patches when CUDA is unavailable; return the names applied after the call.

    ``enable``: names to apply (default: all). ``disable`` and the comma-separated names in
    ``$MEGATRON_RL_CPU_COMPAT_DISABLE`` are left off, and reverted if an earlier call applied them.
    Idempotent. A no-op returning [] when ``torch.cuda.is_available()``.
    """
    if torch.cuda.is_available():
        return []
    wanted = set(_names(PATCHES if enable is None else enable, "enable"))
    off = set(_names(disable, "disable")) | set(_names(os.environ.get(ENV_DISABLE, "").split(","), ENV_DISABLE))
    for name, patch in PATCHES.items():
        if name in off:
            patch.revert()
        elif name in wanted:
            patch.apply()
    applied = [name for name, patch in PATCHES.items() if patch.applied]
    logging.getLogger(__name__).debug("Megatron-Core CPU compat patches applied: %s", applied)
    return applied


def revert_all() -> None:
    """Revert every applied patch (tests)."""
    for patch in reversed(list(PATCHES.values())):
        patch.revert()
