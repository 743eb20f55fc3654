"""Logs survive reruns: a fresh start in an existing run folder keeps the earlier logs (rotated to <name>.N),
and the metrics readers see an append-only file as the run now stands (last row of each kind and step)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_rl import config as C
from megatron_rl.commands.report import read_metrics
from megatron_rl.commands.train import _resume_or_start, _stopped_message, rotate_logs
from megatron_rl.run_config import RunConfig


def _write(path, rows):
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_rotate_logs_keeps_every_earlier_file(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"kind": "sft", "step": 0, "loss": 1.0}])
    (tmp_path / "alerts.jsonl").write_text("")  # empty: nothing to keep
    assert rotate_logs(tmp_path) == [(tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.1")]
    _write(tmp_path / "metrics.jsonl", [{"kind": "sft", "step": 0, "loss": 2.0}])
    assert rotate_logs(tmp_path) == [(tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.2")]
    assert json.loads((tmp_path / "metrics.jsonl.1").read_text())["loss"] == 1.0
    assert json.loads((tmp_path / "metrics.jsonl.2").read_text())["loss"] == 2.0
    assert not (tmp_path / "metrics.jsonl").exists() and rotate_logs(tmp_path) == []


def test_a_fresh_run_in_an_existing_folder_says_so_and_keeps_the_old_rows(tmp_path, capsys):
    cfg = C.load(RunConfig, "configs/demo_cpu.yaml", [f"output_dir={tmp_path}", "train.steps=0"])
    run = tmp_path / "demo"
    run.mkdir()
    _write(run / "metrics.jsonl", [{"kind": "rl", "step": 0, "reward_mean": 0.5}])
    assert _resume_or_start(cfg, run) is None
    said = capsys.readouterr().out
    assert "a fresh run in an existing run folder: the earlier metrics.jsonl is kept as metrics.jsonl.1" in said
    assert json.loads((run / "metrics.jsonl.1").read_text())["reward_mean"] == 0.5
    assert _stopped_message(run, None).startswith("the run stopped (signal or alert) before any checkpoint")


def test_resume_with_a_warmup_checkpoint_rotates_nothing(tmp_path, capsys):
    cfg = C.load(RunConfig, "configs/demo_cpu.yaml", [f"output_dir={tmp_path}", "train.steps=0"])
    run = tmp_path / "demo"
    (run / "checkpoints" / "warmup" / "step-000010").mkdir(parents=True)
    (run / "checkpoints" / "warmup" / "latest").write_text("step-000010\n")
    _write(run / "metrics.jsonl", [{"kind": "sft", "step": 0, "loss": 1.0}])
    assert _resume_or_start(cfg, run) == run / "checkpoints" / "warmup" / "step-000010"
    assert "resuming the warm-up from" in capsys.readouterr().out
    assert (run / "metrics.jsonl").exists() and not (run / "metrics.jsonl.1").exists()
    msg = _stopped_message(run, run / "checkpoints" / "warmup" / "step-000010")
    assert "step-000010 (from an earlier launch: nothing newer was saved)" in msg


def test_read_metrics_takes_the_last_row_of_each_step(tmp_path):
    _write(tmp_path / "metrics.jsonl", [{"kind": "sft", "step": 0, "loss": 3.0},
                                        {"kind": "sft", "step": 1, "loss": 2.0},
                                        {"kind": "resume", "step": 1, "phase": "warmup"},
                                        {"kind": "sft", "step": 1, "loss": 2.5},
                                        {"kind": "sft", "step": 2, "loss": 1.0}])
    rows = read_metrics(tmp_path)
    assert [(r["kind"], r["step"], r.get("loss")) for r in rows] == \
        [("sft", 0, 3.0), ("sft", 1, 2.5), ("resume", 1, None), ("sft", 2, 1.0)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5  # the file itself keeps every row


def test_periodic_checkpoints_by_default():
    cfg = C.load(RunConfig, "configs/demo_cpu.yaml", ["rl.checkpoint_every=10"])
    default = RunConfig()
    assert default.rl.checkpoint_every == 10 and default.train.checkpoint_every == 100
    assert cfg.rl.checkpoint_every == 10 and C.load(RunConfig, "configs/demo_cpu.yaml").rl.checkpoint_every == 15
    with pytest.raises(C.ConfigError, match=r"train.checkpoint_every must be >= 0, got -1"):
        C.load(RunConfig, "configs/demo_cpu.yaml", ["train.checkpoint_every=-1"])


def _burn_cpu(seconds: float) -> None:
    """A child process that spends `seconds` of CPU (waited for: it lands in this process's RUSAGE_CHILDREN)."""
    code = f"import time\nt = time.process_time()\nwhile time.process_time() - t < {seconds}:\n    pass\n"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_summary_counts_the_runs_own_cpu_not_what_ran_before_it(tmp_path, monkeypatch):
    """scripts/run.sh execs into `megatron-rl train` after its set-up, and rusage survives exec: the CPU that this
    process and its children spent before the run (pip, the model import; here a 1.5 s child and the test
    session itself) is not the run's. The ranks are a stand-in child spending 0.5 s (the real ranks cost
    a minute here; what is tested is the accounting)."""
    from megatron_rl.commands import train as T

    _burn_cpu(1.5)  # the set-up's CPU, before the run
    def ranks(cfg, run_dir, here=False) -> int:
        _burn_cpu(0.5)
        (run_dir / "metrics.jsonl").write_text("")  # (the ranks' log: empty for a run of no step)
        return 0

    monkeypatch.setattr(T, "launch_workers", ranks)
    cfg = C.load(RunConfig, "configs/demo_cpu.yaml", [f"output_dir={tmp_path}", "train.steps=0", "rl.steps=0"])
    assert T.drive(cfg, tmp_path / "demo") == 0
    cpu = json.loads((tmp_path / "demo" / "summary.json").read_text())["cpu_s"]
    assert 0.5 <= cpu < 1.4, cpu
