"""The CPU debug mode that simulates NCCL's device rule (MEGATRON_RL_DEVICE_CHECK=nccl, compat/device_check.py):
a host tensor reaching a collective from our code raises, naming the call site; tensors on the rank's device
(DistContext.device) pass; the stop-signal agreement and `distributed probe` use that device. The main loop
runs under the check in tests/commands/test_critic_multiproc.py (warm-up and RL steps through `megatron-rl train`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checked(monkeypatch):
    from megatron_rl.compat import device_check
    from megatron_rl.convert.runtime import start

    ctx = start()  # a gloo world of one, compat.cpu applied (reused when another test started it)
    monkeypatch.setenv(device_check.ENV, "nccl")
    assert device_check.install()
    try:
        yield ctx
    finally:
        device_check.uninstall()


def test_host_tensor_into_a_collective_raises_naming_the_call_site(checked):
    from megatron_rl.compat.device_check import DeviceCheckError
    from megatron_rl.driver import StopFlag

    ctx = checked
    assert ctx.device == torch.device("cuda", 0)  # compat.cpu maps it to the CPU: the same code runs
    flag = StopFlag()
    with pytest.raises(DeviceCheckError, match=r"torch.distributed.all_reduce got a host tensor \(2,\) "
                                               r"torch.float32 at megatron_rl/driver.py:\d+ in agreed\(\)"):
        flag.agreed(None, torch.device("cpu"))  # what the stop-signal agreement used to send
    assert flag.agreed(None, ctx.device) is None
    flag.signal = "SIGTERM"
    assert flag.agreed(None, ctx.device) == "signal SIGTERM"


def test_threads_started_under_the_check_map_and_tag_device_tensors(checked):
    """A dispatched loop's engine serves from a thread: torch-function modes are per thread, so without the
    check's thread hook a `device=ctx.device` tensor there hit torch.cuda ("Torch not compiled with CUDA")."""
    import threading

    from megatron_rl.compat.device_check import on_device

    ctx, out = checked, {}

    def work():
        try:
            dev = torch.arange(4, device=ctx.device)
            out["tagged"], out["host"] = on_device(dev * 2), on_device(torch.ones(2))
        except Exception as e:  # noqa: BLE001 - reported below
            out["error"] = repr(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out == {"tagged": True, "host": False}


def test_device_tags_follow_placement_and_ops(checked):
    from megatron_rl.compat.device_check import on_device

    ctx = checked
    host = torch.ones(3)
    dev = torch.ones(3, device=ctx.device)
    assert not on_device(host) and on_device(dev) and on_device(dev * 2)
    assert on_device(dev[1:]) and on_device(torch.stack([dev, dev])) and not on_device(host + 1)
    assert on_device(torch.zeros(2).to(ctx.device)) and on_device(torch.zeros_like(dev))
    assert on_device(torch.nn.Parameter(torch.zeros(2)))  # Megatron builds parameters on the current device
    assert not on_device(dev.cpu())


def test_library_collectives_are_trusted_and_our_call_sites_checked(checked):
    """Megatron-Core's collectives are not re-checked; the trainer's reductions use the rank's device."""
    from megatron_rl.commands.warmup import _from_last_stage
    from megatron_rl.compat.device_check import DeviceCheckError

    pgs = checked.pgs
    m = _from_last_stage({"loss_sum": 2.0, "tokens": 4.0}, ("loss_sum", "tokens"), pgs.pp, pgs.dp, checked.device)
    assert m == {"loss_sum": 2.0, "tokens": 4.0}
    with pytest.raises(DeviceCheckError, match="megatron_rl/commands/warmup.py"):
        _from_last_stage({"loss_sum": 2.0}, ("loss_sum",), pgs.pp, pgs.dp, torch.device("cpu"))


def test_bad_setting_is_refused(monkeypatch):
    from megatron_rl.compat import device_check

    monkeypatch.setenv(device_check.ENV, "gloo")
    with pytest.raises(ValueError, match="MEGATRON_RL_DEVICE_CHECK='gloo': use 'nccl'"):
        device_check.requested()


@pytest.mark.slow
def test_distributed_probe_under_the_check():
    env = {**os.environ, "MEGATRON_RL_DEVICE_CHECK": "nccl", "PYTHONPATH": str(REPO)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.distributed", "probe", "--source", "single"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["allreduce"] == 1.0 and out["backend"] == "gloo"
    assert "collectives check that their tensors are on the rank's device" in proc.stderr
