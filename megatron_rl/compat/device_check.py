"""A CPU debug mode that catches what NCCL would reject: a host (CPU) tensor reaching a collective.

On CPU the loop runs on gloo, which takes CPU tensors, and `compat.cpu` maps every `device="cuda"` to the CPU:
a collective fed a tensor that was never put on the rank's device passes in CI and fails on the first GPU
job ("Tensors must be CUDA and dense"). With `MEGATRON_RL_DEVICE_CHECK=nccl` (read here only; the tests set
it), `init_distributed` simulates NCCL's placement rule on CPU:

- the rank's device (`DistContext.device`) becomes `cuda:0`, which `compat.cpu` still maps to the CPU, so
  the same code runs; `DeviceTagMode` (a TorchFunctionMode above `compat.cpu`'s) tags every tensor created
  for a CUDA device (`device=` kwarg, `.to(...)`, `.cuda()`) and every result of an op with a tagged input
  (custom autograd Functions' outputs too); parameters count as device tensors (Megatron builds them on the
  current device); `.cpu()` / `.to("cpu")` results are host tensors;
- `torch.distributed`'s tensor collectives check their tensors: an untagged one raises `DeviceCheckError`
  naming the collective, the tensor and the call site (file:line, function), and the fix;
- threads started after that (the rollout server's engine thread of a dispatched loop, episode threads) run
  under the same modes: torch-function modes are per thread.

An idiom it cannot follow: `device=t.device` reads the CPU here even when `t` is tagged; write
`device=ctx.device`, or write device data into it (an in-place op or `x[i] = v` with a tagged `v` tags `x`).

Scope: collectives called from this repository's code (megatron_rl/, tools/, envs/, kernels/, benchmarks/);
Megatron-Core's own collectives run on NCCL in production and are not re-checked, nor are those in a
backward pass (gradients live where autograd put them) or inside a custom autograd Function's forward (the
fused log-prob kernels: torch pops every mode there, so placements cannot be followed; their GPU tests cover
them). `*_object` collectives move pickles and are left to
torch (they place their buffers on the current device themselves).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ENV = "MEGATRON_RL_DEVICE_CHECK"
"""Set to 'nccl' to simulate NCCL's device rule on CPU (tests); unset or '' = off."""

CHECKED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
           "reduce_scatter", "reduce", "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv",
           "gather", "scatter")
"""torch.distributed functions whose tensor arguments are checked."""

_REPO = Path(__file__).resolve().parents[2]
_OURS = tuple(str(_REPO / d) + os.sep for d in ("megatron_rl", "tools", "envs", "kernels", "benchmarks"))
_SELF = str(Path(__file__).resolve())
_TAG = "_megatron_rl_on_device"
_state: dict[str, Any] = {"mode": None, "undo": []}



class DeviceCheckError(RuntimeError):
    """A collective got a tensor that is not on the rank's device (NCCL would reject it)."""


def requested() -> str:
    """The simulated backend asked for by MEGATRON_RL_DEVICE_CHECK ('' = off)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value not in ("", "nccl"):
        raise ValueError(f"{ENV}={value!r}: use 'nccl' (simulate NCCL's device rule on CPU) or leave it unset")
    return value


def enabled() -> bool:
    """The check is installed in this process."""
    return _state["mode"] is not None


def _cuda_like(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def on_device(t: torch.Tensor) -> bool:
    """Whether `t` would be on the rank's GPU in a real NCCL run."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return True  # a library's tensor subclass (ShardedTensor, DTensor, ...): it places its own data
    tag = getattr(t, _TAG, None)
    if tag is not None:
        return tag
    if t.is_cuda or isinstance(t, torch.nn.Parameter):
        return True
    base = getattr(t, "_base", None)
    return base is not None and on_device(base)


def _tag(out: Any, value: bool = True) -> None:
    if isinstance(out, (tuple, list)):  # also torch.return_types (max, topk, sort ...), which pytree keeps whole
        for x in out:
            _tag(x, value)
    elif isinstance(out, dict):
        for x in out.values():
            _tag(x, value)
    elif isinstance(out, torch.Tensor):
        try:
            setattr(out, _TAG, value)
        except (AttributeError, RuntimeError):  # some C++-owned tensors refuse attributes
            pass


class DeviceTagMode(TorchFunctionMode):
    """Tags tensors placed on a CUDA device (before `compat.cpu` maps it to the CPU) and results of tagged inputs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _to_host(func, args, kwargs):
            if isinstance(out, torch.Tensor) and args and out is args[0]:
                out = out.view_as(out)  # on a GPU a new host tensor; here an alias tagged as host
            _tag(out, False)
        elif _wants_device(func, args, kwargs) or any(isinstance(x, torch.Tensor) and on_device(x)
                                                      for x in tree_flatten((args, kwargs))[0]):
            _tag(out)
            if args and isinstance(args[0], torch.Tensor) and _in_place(func):
                _tag(args[0])  # x[i] = v, x.copy_(v), x.add_(v): x holds device data
        return out


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))


def _to_host(func, args, kwargs) -> bool:
    if func is torch.Tensor.cpu:
        return True
    target = args[1] if func is torch.Tensor.to and len(args) > 1 else kwargs.get("device") \
        if func is torch.Tensor.to else None
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def _wants_device(func, args, kwargs) -> bool:
    if _cuda_like(kwargs.get("device")) or func is torch.Tensor.cuda:
        return True
    return func is torch.Tensor.to and len(args) > 1 and _cuda_like(args[1])


def _call_site() -> traceback.FrameSummary | None:
    """The innermost frame of this repository's code calling the collective (None: not ours)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename == _SELF:
            continue
        if frame.filename.startswith(_OURS):
            return frame
        if "torch" + os.sep + "distributed" in frame.filename:
            continue
        return None  # Megatron-Core or another library: trusted
    return None


def _followed() -> bool:
    """Placements can be followed here: not in a backward pass, and the tag mode is on the stack (it is not
    inside a custom autograd Function's forward or another torch-function handler, where modes are popped)."""
    return torch._C._current_graph_task_id() == -1 and \
        _state["mode"] in torch.overrides._get_current_function_mode_stack()


def _checked(name: str, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if _followed():
            site = _call_site()
            if site is not None:
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor) and not on_device(t):
                        raise DeviceCheckError(
                            f"device check ({ENV}=nccl): torch.distributed.{name} got a host tensor "
                            f"{tuple(t.shape)} {t.dtype} at {Path(site.filename).relative_to(_REPO)}:{site.lineno} "
                            f"in {site.name}(); NCCL needs it on the rank's GPU: create it on ctx.device "
                            "(DistContext.device) or move it with .to(ctx.device)")
        return orig(*args, **kwargs)
    return wrapper


def modes_off():
    """A context that turns torch-function modes off for a hot path (the rollout engine's step: the CPU compat
    layer's per-op hook is pure overhead there), except under the check, which follows placements through
    them (slower, debug only)."""
    return contextlib.nullcontext() if enabled() else torch._C.DisableTorchFunction()


def _tag_function_outputs():
    """Tag the outputs of custom autograd Functions (Megatron's tensor-parallel mappings, our kernels) when an
    input is on the device: torch runs `Function.apply` outside the torch-function modes. Returns the original."""
    orig = torch.autograd.Function.__dict__["apply"]
    func = orig.__func__

    def apply(cls, *args, **kwargs):
        out = func(cls, *args, **kwargs)
        if any(isinstance(x, torch.Tensor) and on_device(x) for x in tree_flatten((args, kwargs))[0]):
            _tag(out)
        return out

    torch.autograd.Function.apply = classmethod(apply)
    return orig


def _modes_in_new_threads() -> Callable:
    """Threads started from now on run under this thread's torch-function modes (`compat.cpu`'s CUDA mapping
    and the tag mode are per thread: the rollout server's engine thread would see neither, and fail on its
    first `device=ctx.device` tensor); returns the original `Thread._bootstrap_inner`."""
    modes = list(torch.overrides._get_current_function_mode_stack())  # bottom first
    orig = threading.Thread._bootstrap_inner

    def bootstrap(self):
        with contextlib.ExitStack() as stack:
            for m in modes:
                stack.enter_context(m)
            orig(self)

    threading.Thread._bootstrap_inner = bootstrap
    return orig


def install() -> bool:
    """Install the check if MEGATRON_RL_DEVICE_CHECK asks for it (call after `compat.cpu.apply()`, so the tag
    mode sees CUDA placements before they are mapped); returns whether it is on. Idempotent."""
    if enabled():
        return True
    if not requested():
        return False
    mode = DeviceTagMode()
    mode.__enter__()
    undo = [("Function.apply", _tag_function_outputs()), ("Thread._bootstrap_inner", _modes_in_new_threads())]
    for name in CHECKED:
        orig = getattr(dist, name, None)
        if orig is not None:
            setattr(dist, name, _checked(name, orig))
            undo.append((name, orig))
    _state.update(mode=mode, undo=undo)
    print(f"[megatron-rl] {ENV}=nccl: collectives check that their tensors are on the rank's device",
          file=sys.stderr, flush=True)
    return True


def uninstall() -> None:
    """Remove the check (tests)."""
    mode = _state["mode"]
    if mode is None:
        return
    for name, orig in _state["undo"]:
        if name == "Function.apply":
            torch.autograd.Function.apply = orig
        elif name == "Thread._bootstrap_inner":
            threading.Thread._bootstrap_inner = orig
        else:
            setattr(dist, name, orig)
    mode.__exit__(None, None, None)
    _state.update(mode=None, undo=[])
