"""MoE routing replay with dispatched and fleet rollout workers, through the product path: `megatron-rl train
configs/moe_replay_cpu.yaml episodes.runner=dispatch|fleet` (local executor, one trainer rank serving its bf16
engine over HTTP to the workers).

Three runs side by side from the same seed, so the workers' samples are the same in all three (the sampling
seeds are the episodes'): dispatch with routing_replay=off, dispatch with =everywhere, fleet with =everywhere
(its engine a separate server process, `--record-routes`).
The workers ask the server for each token's experts (`return_routed_experts`), store them in their shards, the
loop reads them back and the trainer replays them. seed=3 draws samples where the bf16 engine flips many
experts; measured here: mismatch_kl 0.0799 (off) vs 0.0096 (everywhere, colocated and separate server alike),
routing_mismatch_frac 0.037. About 3 min (shared 2-core machine).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.commands.test_routing_replay_multiproc import _start, _step0

RUNNERS = {"dispatch": ("episodes.runner=dispatch", "episodes.dispatch.executor=local"),
           "fleet": ("episodes.runner=fleet", "episodes.fleet.executor=local", "episodes.fleet.size=1",
                     "episodes.server=separate")}  # the fleet calls a rollout server process of its own


def _start_on(out: Path, runner: str, mode: str) -> subprocess.Popen:
    return _start(out, mode, "seed=3", "export.enabled=false", "episodes.worker_threads=2", *RUNNERS[runner])


@pytest.mark.slow
@pytest.mark.multiproc
def test_dispatched_and_fleet_workers_carry_the_engines_routes_to_the_trainer(tmp_path):
    from megatron_rl.data.shards import read_arrays

    runs = {"off": ("dispatch", "off"), "dispatch": ("dispatch", "everywhere"), "fleet": ("fleet", "everywhere")}
    procs = {k: _start_on(tmp_path / k, *v) for k, v in runs.items()}
    for k, p in procs.items():
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, f"{k}: {out[-4000:]}"
    dirs = {k: tmp_path / k / "moe_replay" for k in runs}
    m = {k: _step0(d) for k, d in dirs.items()}
    trained = {k: read_arrays(d / "rl_shards" / "step-000000.h5") for k, d in dirs.items()}
    for k in ("dispatch", "fleet"):
        assert m[k]["episodes_dispatched"] == 8 and m[k]["episodes_missing"] == 0, m[k]
        # the worker's own shards hold the routes (not only the loop's trained shard)
        (shard,) = (d for d in (dirs[k] / "rl_episodes").glob("*/*.h5"))
        worker = read_arrays(shard)
        routes = worker.routed_experts  # [T, 2 MoE layers, top-2]
        assert routes.shape == (len(worker.tokens), 2, 2) and routes.max() < 8
        last = worker.offsets[1:] - 1  # each sample's last token is sampled, never run: not recorded
        assert (routes[last] == -1).all() and (np.delete(routes, last, axis=0) >= 0).all()
        np.testing.assert_array_equal(trained[k].tokens, trained["off"].tokens)  # the same samples everywhere
        assert trained[k].routed_experts is not None and (trained[k].routed_experts >= 0).sum() == (routes >= 0).sum()
    assert trained["off"].routed_experts is None  # off: the workers asked for nothing, nothing stored
    assert m["fleet"]["fleet_leases"] >= 1
    np.testing.assert_array_equal(trained["fleet"].routed_experts, trained["dispatch"].routed_experts)
    # the engine (bf16) and the trainer (fp32) route some tokens differently ...
    assert m["dispatch"]["routing_mismatch_frac"] > 0 and m["off"].get("routing_mismatch_frac") is None
    assert m["fleet"]["routing_mismatch_frac"] == m["dispatch"]["routing_mismatch_frac"]
    # ... and replaying the engine's choice on the same samples lowers the train/rollout mismatch
    for k in ("dispatch", "fleet"):
        assert m["off"]["mismatch_kl"] > 1e-2 and m[k]["mismatch_kl"] < 0.5 * m["off"]["mismatch_kl"], (m["off"], m[k])
