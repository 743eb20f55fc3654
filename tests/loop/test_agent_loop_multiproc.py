"""The product path of black-box agent episodes: `megatron-rl train` on a tiny HF model with the harbor domain
played by the shell agent (`envs.domains.harbor.agent: shell`). Each episode's agent runs in the bubblewrap
sandbox and calls the in-process engine through its gateway socket; the shards hold its exact trajectories (the
agent's first call is the group's shared prompt; the model's tokens trained, the rest masked) with the
behaviour log-probs the engine sampled, the Harbor tests score them, and the loop trains on them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.hf_tiny import tiny_llama, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")


def _tasks(root: Path) -> Path:
    """Two train tasks and one held-out: create /app/<name>; the tests check for it."""
    for name, split in (("alpha", "train"), ("beta", "train"), ("gamma", "heldout")):
        d = root / f"make-{name}"
        (d / "environment").mkdir(parents=True)
        (d / "tests").mkdir()
        (d / "instruction.md").write_text(f"Create a file named {name} in /app.\n")
        (d / "task.toml").write_text(f'version = "1.0"\n[metadata]\nsplit = "{split}"\n[agent]\ntimeout_sec = 60.0\n')
        (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\n")
        (d / "tests" / "test.sh").write_text(f"#!/bin/bash\nif [ -f /app/{name} ]; then echo 1; else echo 0; fi "
                                             "> /logs/verifier/reward.txt\n")
    return root


def _config(tmp_path: Path, folder: Path, **episodes) -> Path:
    """The post-training job on a tiny HF model, the harbor domain played by the shell agent; 1 RL step."""
    tiny_llama(folder, tiny_tokenizer(folder), max_positions=2048)
    cfg = yaml.safe_load((REPO / "configs" / "post_train_cpu.yaml").read_text())
    cfg.update(output_dir=str(tmp_path / "runs"), name="agent")
    cfg["model"] = {"init": f"hf:{folder}", "max_seq_length": 1536}
    cfg["envs"] = {"domains": {"harbor": {"agent": "shell", "max_turns": 3, "task_files": [str(_tasks(tmp_path / "t"))],
                                          "agent_args": "--history head-tail --max-output-chars 300"}}}
    cfg["rl"].update(steps=1, prompts_per_step=2, group_size=2, max_new_tokens=12, dynamic_sampling=False)
    cfg["rl"]["trainer"]["packing"]["max_tokens"] = 2048
    cfg["eval"] = {"every": 0, "tasks": 1, "k": 1}
    cfg["engine"] = {"num_blocks": 512}
    cfg["export"] = {"enabled": False}
    cfg["monitor"] = {"prometheus_port": -1, "tensorboard": False}
    if episodes:
        cfg["episodes"] = episodes
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _check_agent_trajectories(trajs, tok) -> None:
    for t in trajs:
        # the prompt is the agent's first call: its task.json message and tool, rendered by the chat template
        text = tok.decode_raw(t.tokens[:t.prompt_len].tolist())
        assert "Create a file named" in text and '"name": "shell"' in text and text.endswith("assistant\n")
        mask = t.loss_mask.astype(bool)
        assert not mask[:t.prompt_len].any() and mask[t.prompt_len:].any()
        assert (t.logprobs[~mask] == 0).all() and (t.logprobs[mask] < 0).all()  # behaviour log-probs on the model's
        assert t.status in ("ok", "truncated") and 0.0 <= t.reward <= 1.0
        assert t.timings["agent.calls"] >= 1 and t.timings["agent.splits"] == 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_with_the_shell_agent_through_the_gateway(tmp_path):
    from megatron_rl.data.shards import read_shard
    from megatron_rl.tokenizer import HFTokenizer

    folder = tmp_path / "hf"
    path = _config(tmp_path, folder)
    proc = subprocess.run([EXE, "train", str(path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    run = tmp_path / "runs" / "agent"
    trajs = read_shard(run / "rl_shards" / "step-000000.h5")
    assert len(trajs) == 4 and {t.env for t in trajs} == {"harbor"}
    _check_agent_trajectories(trajs, HFTokenizer(folder))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl" or '"rl"' in json.dumps(r)]
    assert rl and rl[-1].get("harbor/count") == 4 and np.isfinite(rl[-1]["loss"])
    assert rl[-1]["agent_calls_mean"] >= 1 and rl[-1]["agent_splits"] == 0 == rl[-1]["agent_segment_rows"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_agent_episodes_and_evaluation_run_on_the_persistent_fleet(tmp_path):
    """The same job with `episodes.runner: fleet`: each worker plays the agent episodes it leases (the agent
    settings travel in the worker config), training and the in-loop evaluation alike; then `megatron-rl eval`
    dispatches the held-out task to a fleet of its own. The loop's rows keep each episode's own prompt and
    agent counters."""
    from megatron_rl.data.shards import read_shard
    from megatron_rl.tokenizer import HFTokenizer

    folder = tmp_path / "hf"
    fleet = {"runner": "fleet", "worker_threads": 2, "fleet": {"executor": "local", "size": 1}}
    path = _config(tmp_path, folder, **fleet)
    proc = subprocess.run([EXE, "train", str(path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run, tok = tmp_path / "runs" / "agent", HFTokenizer(folder)
    worked = [t for p in sorted((run / "rl_episodes").glob("*/*.h5")) for t in read_shard(p)]
    assert len(worked) == 4  # published by the fleet's worker, which ran the agent in its sandbox
    _check_agent_trajectories(worked, tok)
    trained = read_shard(run / "rl_shards" / "step-000000.h5")
    assert sorted(t.tokens.tolist() for t in trained) == sorted(t.tokens.tolist() for t in worked)
    assert all(t.timings["agent.calls"] >= 1 for t in trained)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["kind"] == "rl"]
    assert rl[-1]["episodes_dispatched"] == 4 and rl[-1]["episodes_missing"] == 0 and rl[-1]["agent_calls_mean"] >= 1
    # the in-loop evaluations (before the first step and after the last): greedy + k=1 of the held-out task
    evals = sorted((run / "eval_episodes").iterdir())
    assert len(evals) == 2 and [r["kind"] for r in rows].count("eval") == 2
    for d in evals:
        ev = [t for p in sorted(d.glob("*.h5")) for t in read_shard(p)]
        assert len(ev) == 2 and {t.task_id for t in ev} == {"make-gamma"}
        _check_agent_trajectories(ev, tok)

    out = tmp_path / "eval.json"
    proc = subprocess.run([EXE, "eval", str(path), "--hf", str(folder), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())["domains"]["harbor"]
    assert result["tasks"] == 1 and result["infra_error_frac"] == 0.0
    assert len(sorted((run / "eval_episodes").iterdir())) == 3  # the command's own, dispatched to its fleet
