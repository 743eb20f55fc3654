"""Nothing lost on restart: the supervised warm-up of `megatron-rl train` checkpoints on SIGTERM and
periodically, a rerun resumes it at the right step with the same data order (equal to the unbroken run), and
metrics.jsonl is only ever appended to, across a SIGTERM and a kill -9."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).parent / "megatron-rl")
WARMUP = ("train.steps=30", "train.eval_every=8", "train.checkpoint_every=10", "data.train_tasks=32",
          "data.heldout_tasks=8", "rl.steps=0", "monitor.tensorboard=false", "monitor.prometheus_port=-1")


def _raw(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def _sft_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [r["step"] for r in _raw(run) if r["kind"] == "sft"] if path.exists() else []


def _start(out: Path) -> subprocess.Popen:
    return subprocess.Popen([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={out}", *WARMUP], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _signal_after(proc: subprocess.Popen, run: Path, step: int, sig: int, group: bool) -> tuple[int, str]:
    """Send `sig` to the driver (or its whole process group) once warm-up step `step` is logged."""
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if any(s >= step for s in _sft_steps(run)):
            os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
            break
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


def _ckpt_step(run: Path) -> int:
    return int((run / "checkpoints" / "warmup" / "latest").read_text().strip().split("-")[1])


@pytest.mark.slow
@pytest.mark.multiproc
def test_warmup_resumes_after_sigterm_and_kill_and_equals_the_unbroken_run(tmp_path):
    from megatron_rl.commands.report import read_metrics

    a = subprocess.run([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path / 'a'}", *WARMUP], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-5000:]
    run = tmp_path / "b" / "demo"
    # 1. SIGTERM during the warm-up: a checkpoint right after the last logged step, exit 3, a true message
    rc, out = _signal_after(_start(tmp_path / "b"), run, 2, signal.SIGTERM, group=False)
    assert rc == 3, out[-4000:]
    done = max(_sft_steps(run)) + 1
    assert done < 30 and _ckpt_step(run) == done, out[-3000:]
    assert "checkpoint saved in" in out and "(saved by this launch); the same command resumes" in out
    rows_1 = _raw(run)
    # 2. kill -9 of the driver and every rank after the periodic checkpoint of step 20 (no chance to save)
    rc, out = _signal_after(_start(tmp_path / "b"), run, 22, signal.SIGKILL, group=True)
    assert rc == -signal.SIGKILL, out[-4000:]
    assert f"resuming the warm-up from {run / 'checkpoints' / 'warmup' / f'step-{done:06d}'}" in out
    assert _ckpt_step(run) == 20 and max(_sft_steps(run)) >= 22
    assert sorted(p.name for p in (run / "checkpoints" / "warmup").glob("step-*")) == ["step-000020"]
    rows_2 = _raw(run)
    assert rows_2[:len(rows_1)] == rows_1  # appended, never truncated
    # 3. the rerun finishes from step 20; the log keeps every row of the three launches
    b = subprocess.run([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path / 'b'}", *WARMUP], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-5000:]
    assert "resuming the warm-up from" in b.stdout and "a fresh run in an existing run folder" not in b.stdout
    rows_3 = _raw(run)
    assert rows_3[:len(rows_2)] == rows_2
    resumes = [r for r in rows_3 if r["kind"] == "resume"]
    assert [(r["phase"], r["step"]) for r in resumes] == [("warmup", done), ("warmup", 20)]
    assert len([r for r in rows_3 if r["kind"] == "sft"]) > 30  # the steps after step 20 ran twice, both kept
    # as the run now stands (the last row of each step), the warm-up is the unbroken one, step for step
    keys = ("loss", "grad_norm", "lr", "tokens")
    for kind in ("sft", "sft_eval"):
        ra = [r for r in read_metrics(tmp_path / "a" / "demo") if r["kind"] == kind]
        rb = [r for r in read_metrics(run) if r["kind"] == kind]
        assert [r["step"] for r in rb] == [r["step"] for r in ra]
        assert [{k: r.get(k) for k in keys} for r in rb] == [{k: r.get(k) for k in keys} for r in ra], kind
    assert json.loads((run / "summary.json").read_text())["warmup_steps"] == 30
