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

REPO = Path(__file__).resolve().parents[1]
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


@pytest.mark.slow
@pytest.mark.multiproc
def test_train_with_the_shell_agent_through_the_gateway(tmp_path):
    from megatron_rl.data.shards import read_shard
    from megatron_rl.tokenizer import HFTokenizer

    folder = tmp_path / "hf"
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
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([EXE, "train", str(path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    run = tmp_path / "runs" / "agent"
    tok = HFTokenizer(folder)
    trajs = read_shard(run / "rl_shards" / "step-000000.h5")
    assert len(trajs) == 4 and {t.env for t in trajs} == {"harbor"}
    for t in trajs:
        # the prompt is the agent's first call: its task.json message and tool, rendered by the chat template
        text = tok.decode_raw(t.tokens[:t.prompt_len].tolist())
        assert "Create a file named" in text and '"name": "shell"' in text and text.endswith("assistant\n")
        mask = t.loss_mask.astype(bool)
        assert not mask[:t.prompt_len].any() and mask[t.prompt_len:].any()
        assert (t.logprobs[~mask] == 0).all() and (t.logprobs[mask] < 0).all()  # behaviour log-probs on the model's
        assert t.status in ("ok", "truncated") and 0.0 <= t.reward <= 1.0
        assert t.timings["agent.calls"] >= 1 and t.timings["agent.splits"] == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl" or '"rl"' in json.dumps(r)]
    assert rl and rl[-1].get("harbor/count") == 4 and np.isfinite(rl[-1]["loss"])
    assert rl[-1]["agent_calls_mean"] >= 1 and rl[-1]["agent_splits"] == 0 == rl[-1]["agent_untrained_tokens"]
