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

# a SIGTERM lands before the first periodic checkpoint, a kill -9 between two; the unbroken run is the session's
# shared warm-up (the `demo_warm` fixture), launched with the same overrides
from tests.demo_warmup import EVERY, STEPS, WARMUP

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")


def _raw(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]


def _sft_steps(run: Path) -> list[int]:
    """Warm-up steps logged so far (read while the job writes: a line still being written is left out)."""
    path, out = run / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        out += [r["step"]] if r["kind"] == "sft" else []
    return out


def _kill_tree(pid: int) -> None:
    """kill -9 of the driver and every rank (and whatever they started)."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        p.kill()
    _, alive = psutil.wait_procs(procs[1:], timeout=30)  # the driver itself is reaped by Popen.wait
    assert not alive, alive


def _launch(out: Path, sig: int, tree: bool, due) -> tuple[int, str]:
    """Start the job; once `due()`, send `sig` to the driver (or kill its whole process tree); (exit, output)."""
    log = out.parent / f"launch-{time.monotonic_ns()}.log"
    with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the job while we poll
        proc = subprocess.Popen([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={out}", *WARMUP], cwd=REPO,
                                stdout=f, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            if due():
                _kill_tree(proc.pid) if tree else os.kill(proc.pid, sig)
                break
            time.sleep(0.1)
        proc.wait(timeout=300)
    return proc.returncode, log.read_text()


def _ckpt_step(run: Path) -> int:
    f = run / "checkpoints" / "latest"  # names warmup/step-N during the warm-up (trainer/latest.py)
    return int(f.read_text().strip().split("-")[1]) if f.exists() else 0


@pytest.mark.slow
@pytest.mark.multiproc
def test_warmup_resumes_after_sigterm_and_kill_and_equals_the_unbroken_run(tmp_path, demo_warm):
    from megatron_rl.commands.report import read_metrics

    unbroken = demo_warm[0]  # `megatron-rl train configs/demo_cpu.yaml *WARMUP`, never interrupted
    run = tmp_path / "b" / "demo"
    # 1. SIGTERM during the warm-up: a checkpoint right after the last logged step, exit 3, a true message
    rc, out = _launch(tmp_path / "b", signal.SIGTERM, False, lambda: max(_sft_steps(run), default=-1) >= 2)
    assert rc == 3, out[-4000:]
    done = max(_sft_steps(run)) + 1
    assert done < EVERY and _ckpt_step(run) == done, out[-3000:]
    assert "checkpoint saved in" in out and "(saved by this launch); the same command resumes" in out
    rows_1 = _raw(run)
    # 2. kill -9 of the driver and every rank, steps after a periodic checkpoint (no chance to save)
    rc, out = _launch(tmp_path / "b", signal.SIGKILL, True,
                      lambda: _ckpt_step(run) >= EVERY and max(_sft_steps(run)) >= _ckpt_step(run) + 1)
    assert rc == -signal.SIGKILL, out[-4000:]
    assert f"resuming the warm-up from {run / 'checkpoints' / 'warmup' / f'step-{done:06d}'}" in out
    ckpt = _ckpt_step(run)
    assert ckpt % EVERY == 0 and EVERY <= ckpt < STEPS and max(_sft_steps(run)) >= ckpt + 1, out[-3000:]
    assert sorted(p.name for p in (run / "checkpoints" / "warmup").glob("step-*")) == [f"step-{ckpt:06d}"]
    rows_2 = _raw(run)
    assert rows_2[:len(rows_1)] == rows_1  # appended, never truncated
    # 3. the rerun finishes from that checkpoint; the log keeps every row of the three launches
    b = subprocess.run([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path / 'b'}", *WARMUP], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-5000:]
    assert "resuming the warm-up from" in b.stdout and "a fresh run in an existing run folder" not in b.stdout
    rows_3 = _raw(run)
    assert rows_3[:len(rows_2)] == rows_2
    resumes = [r for r in rows_3 if r["kind"] == "resume"]
    assert [(r["phase"], r["step"]) for r in resumes] == [("warmup", done), ("warmup", ckpt)]
    assert len([r for r in rows_3 if r["kind"] == "sft"]) > STEPS  # the steps after `ckpt` ran twice, both kept
    # as the run now stands (the last row of each step), the warm-up is the unbroken one, step for step
    keys = ("loss", "grad_norm", "lr", "tokens")
    for kind in ("sft", "sft_eval"):
        ra = [r for r in read_metrics(unbroken) if r["kind"] == kind]
        rb = [r for r in read_metrics(run) if r["kind"] == kind]
        assert [r["step"] for r in rb] == [r["step"] for r in ra]
        assert [{k: r.get(k) for k in keys} for r in rb] == [{k: r.get(k) for k in keys} for r in ra], kind
    assert json.loads((run / "summary.json").read_text())["warmup_steps"] == STEPS
