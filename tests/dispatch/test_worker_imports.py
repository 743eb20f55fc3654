"""A rollout worker (dispatched task or fleet worker) calls the engine over HTTP, runs episodes in sandboxes and
writes shards: it has no use for torch, whose import was ~3 CPU-s of every worker's start-up (18 workers in one
two-step dispatched run of the main job). `megatron_rl.rollout`'s names load lazily for that reason; this test
fails when a worker-side import pulls torch (or Megatron) in again."""
from __future__ import annotations

import subprocess
import sys

WORKER_SIDE = ("megatron_rl.dispatch.worker", "megatron_rl.dispatch.fleet_worker", "megatron_rl.dispatch.generators",
               "megatron_rl.rollout.client", "megatron_rl.envs.mixture", "megatron_rl.envs.countdown",
               "megatron_rl.envs.episode", "megatron_rl.envs.sandbox", "megatron_rl.data.shards")


def test_worker_side_modules_do_not_import_torch():
    code = ("import sys\n"
            f"for m in {WORKER_SIDE!r}: __import__(m)\n"
            "print(sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"a worker-side import pulls in {out.stdout.strip()}"


def test_the_lazy_package_names_still_resolve():
    import megatron_rl.rollout as rollout

    assert rollout.SamplingParams.__module__ == "megatron_rl.rollout.sampling"
    assert rollout.RolloutEngine.__module__ == "megatron_rl.rollout.engine"
    try:
        rollout.NoSuchName  # noqa: B018
    except AttributeError as e:
        assert "NoSuchName" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
