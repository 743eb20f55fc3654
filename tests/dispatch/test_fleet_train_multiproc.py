"""`megatron-rl train` with `episodes.runner: fleet`: the RL loop's episodes run on one persistent fleet of
rollout workers (submitit local processes) for the whole run -- submitted once, warm across steps, pulling
leases from rank 0's queue and calling the engine's HTTP server -- and every episode is trained exactly once."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")
SHORT = ("train.steps=30", "train.eval_every=15", "data.train_tasks=64", "data.heldout_tasks=8", "eval.k=2",
         "eval.every=0", "rl.prompts_per_step=4", "rl.group_size=4", "monitor.tensorboard=false",
         "rl.reward_weights.format=0.1", "rl.trainer.epochs=1", "rl.max_oversample=2.0", "export.enabled=false")
FLEET = ("episodes.runner=fleet", "episodes.fleet.executor=local", "episodes.fleet.size=2",
         "episodes.fleet.episodes_per_lease=4", "episodes.worker_threads=2")


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_on_a_persistent_fleet(tmp_path):
    from megatron_rl.data.shards import read_shard

    proc = subprocess.run([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}", *SHORT, *FLEET,
                           "rl.steps=2"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "demo"
    rl = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        assert r["episodes_dispatched"] >= 16 and r["episodes_missing"] == 0 and r["sandbox_error_rate"] == 0.0
        assert r["fleet_leases"] >= 4 and r["fleet_episodes_given_up"] == 0
        assert r["fleet_submissions"] == 0  # submitted once, before step 0's batch: warm for every step
        assert abs(r["mismatch_kl"]) < 1e-3  # the workers' behaviour log-probs are the trainer's
    assert max(r["fleet_first_lease_s"] for r in rl[1:]) < 0.5  # a warm worker takes the next step's episodes
    eps = [t for p in sorted((run / "rl_episodes").glob("*/*.h5")) for t in read_shard(p)]
    assert len(eps) == sum(r["episodes_dispatched"] for r in rl) == len({t.episode_id for t in eps})
    assert {int(t.token_versions[-1]) for t in eps} == {0, 1}  # each step's episodes from that step's weights
    assert all("correct" in t.reward_components for t in eps)  # scored in the worker's sandbox
    log = "\n".join(p.read_text() for p in (run / "fleet" / "submitit").rglob("*_log.err"))
    assert log.count("exits (run over)") == 2, log[-3000:]  # both workers were told to stop at the end
    assert not (run / "fleet" / "jobs.json").exists()
