"""Megatron-Core imported through megatron_rl defers its torch.compile decorations to their first call
(megatron_rl/compat/deferred_compile.py): no TorchDynamo/Inductor import, the same compiled function later."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron_rl.compat.deferred_compile import deferred

PROBE = """
import json, sys
import torch
real = torch.compile
import megatron_rl
from megatron_rl.models.gpt import build_gpt  # the product's way in (Megatron's GPT, layers, fusions)
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
                  "restored": torch.compile is real, "fuser_deferred": jit.jit_fuser is not real,
                  "name": fused_bias_swiglu.bias_swiglu.__name__}))
"""


@pytest.mark.slow  # a fresh interpreter importing torch and Megatron: 4-17 s on 2 shared cores
def test_megatron_imports_without_dynamo_and_torch_compile_is_restored(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"dynamo": False, "inductor": False, "restored": True, "fuser_deferred": True,
                   "name": "bias_swiglu"}, got


@pytest.mark.slow  # the same fresh interpreter, Megatron imported first (the patch not installed)
def test_the_patch_is_still_needed_megatron_alone_imports_dynamo(tmp_path):
    """Megatron imported before megatron_rl keeps its own behaviour: its import pulls in TorchDynamo. When a
    Megatron release stops doing so, this fails and the patch can go (as each patch of compat/cpu.py)."""
    probe = "import sys, json, megatron.core.fusions.fused_bias_swiglu\nimport megatron_rl\n" \
            "print(json.dumps('torch._dynamo' in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) is True


def test_the_real_compile_runs_once_at_the_first_call_with_the_same_options():
    calls = []

    def fake_compile(model=None, **options):
        calls.append((model, options))
        return lambda *a, **k: ("compiled", model(*a, **k))

    compile_later = deferred(fake_compile)

    def double(x):
        return 2 * x

    plain = compile_later(double)
    with_options = compile_later(fullgraph=True, dynamic=False)(double)  # the @torch.compile(...) form
    assert calls == [] and plain.__name__ == "double"  # nothing compiled (nor imported) at decoration
    assert plain(3) == ("compiled", 6) and plain(4) == ("compiled", 8)
    assert calls == [(double, {})]  # compiled once, at the first call
    assert with_options(5) == ("compiled", 10) and calls[1] == (double, {"fullgraph": True, "dynamic": False})
    module = torch.nn.Linear(2, 2)
    assert compile_later(module, mode="default")(torch.ones(2))[0] == "compiled"  # not a function: compiled now
    assert calls[2] == (module, {"mode": "default"}) and len(calls) == 3
