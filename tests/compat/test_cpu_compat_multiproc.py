"""Megatron-Core trains on CPU/gloo under megatron_rl.compat.cpu, equal to the one-process run; and every
patch is still needed (switched off, its scenario fails or diverges).

Two launches of tests/mp/compat_layouts.py (world 2 and world 4) cycle all layouts and still-needed
scenarios; each writes one JSON with the losses of 3 Adam steps, a held-out loss, and the one-process
references computed by rank 0 afterwards.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.compat import cpu

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

SCRIPT = Path(__file__).parents[1] / "mp" / "compat_layouts.py"
LAUNCHES = {
    2: ["dense_dp2", "dense_tp2", "dense_tp2_sp", "pp2", "pp2_vpp2", "moe_ep2_alltoall", "moe_ep2_allgather",
        "distopt_dp2", "mla_tp2"],
    4: ["tp2_pp2", "moe_tp2_ep2_sp"],
}
ATOL = 1e-5
"""Parallel and one-process losses must agree to this (fp32, 3 Adam steps)."""
LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
"""One thread per rank (the ranks share the cores: more threads spin and cost CPU for these tiny matrices), and
Megatron's torch.compile-decorated functions (the MoE router's) run eagerly: compiling them cost ~12 CPU-s in every
rank that routes, for the same result (the deferred compile is tested in test_deferred_compile.py)."""
DIVERGED = 1e-4
"""A still-needed scenario that runs must be further than this from the reference."""


def _load_layouts():
    spec = importlib.util.spec_from_file_location("tests_mp_compat_layouts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


layouts = _load_layouts()


def _world_of(layout: str) -> int:
    return next(world for world, names in LAUNCHES.items() if layout in names)


def _launch(world: int, out_dir: Path) -> dict:
    """Run one launch (all its layouts, still-needed scenarios, checkpoint for world 2); return its JSON."""
    out = out_dir / f"world{world}.json"
    cmd = [sys.executable, str(SCRIPT), "--world", str(world), "--layouts", ",".join(LAUNCHES[world]),
           "--needed", "--out", str(out)]
    if world == 2:
        cmd += ["--ckpt", str(out_dir / "ckpt_tp2")]
    env = {k: v for k, v in os.environ.items() if k not in (cpu.ENV_DISABLE, "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(LAUNCH_ENV)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and out.exists(), f"launch world={world} failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """world -> that launch's results, each launch run at most once per module."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = _launch(world, tmp_path_factory.mktemp(f"compat{world}"))
        return cache[world]

    return get


def _assert_close(got: dict, ref: dict, what: str) -> None:
    assert got["ok"], f"{what}: {got.get('error')} at {got.get('where')}"
    assert ref["ok"], f"{what} reference: {ref.get('error')} at {ref.get('where')}"
    pairs = list(zip(got["losses"] + [got["eval"]], ref["losses"] + [ref["eval"]], strict=True))
    worst = max(abs(a - b) for a, b in pairs)
    assert worst <= ATOL, f"{what}: losses {got['losses']} + eval {got['eval']} vs one-process {ref}"


def _reference(results: dict, layout: str) -> dict:
    return results["references"][layouts.LAYOUTS[layout].model_key()]


@pytest.mark.parametrize("layout", [name for names in LAUNCHES.values() for name in names])
def test_layout_matches_single_process(launch, layout):
    results = launch(_world_of(layout))
    ref = _reference(results, layout)
    _assert_close(results["layouts"][layout], ref, layout)
    assert len(set(ref["losses"])) == len(ref["losses"]), "Adam steps did not change the loss"


def test_checkpoint_saved_at_tp2_loads_at_tp1(launch):
    results = launch(2)
    loaded, trained = results["ckpt_tp1_eval"], results["layouts"]["dense_tp2"]
    assert loaded["ok"], f"{loaded.get('error')} at {loaded.get('where')}"
    assert trained["ok"]
    assert abs(loaded["eval"] - trained["eval"]) <= ATOL
    assert abs(loaded["eval"] - _reference(results, "dense_tp2")["eval"]) <= ATOL


def test_every_patch_has_a_still_needed_scenario_in_a_launch():
    for name, patch in cpu.PATCHES.items():
        assert any(layouts.needed_layout(patch) in names for names in LAUNCHES.values()), name


@pytest.mark.parametrize("name", list(cpu.PATCHES))
def test_patch_is_still_needed(launch, name):
    layout = layouts.needed_layout(cpu.PATCHES[name])
    results = launch(_world_of(layout))
    off, ref = results["needed"][name], _reference(results, layout)
    assert name not in off["active"] and len(off["active"]) == len(cpu.PATCHES) - 1
    _assert_close(results["layouts"][layout], ref, f"{layout} with every patch")
    if not off["ok"]:  # it fails, and for the reason the patch documents
        kind, _, message = off["error"].partition(": ")
        assert kind in cpu.PATCHES[name].reason and message[:30] in cpu.PATCHES[name].reason, (
            f"{name} off: {layout} failed differently than its reason says: {off['error']} at {off['where']}")
        return
    got = off["losses"] + [off["eval"]]
    worst = max(abs(a - b) for a, b in zip(got, ref["losses"] + [ref["eval"]], strict=True))
    assert worst > DIVERGED, (f"{layout} still matches the one-process run with {name} switched off: "
                              f"the patch looks unnecessary now (megatron-core upgrade?)")
