"""One shortened warm-up of the README's main job (`megatron-rl train configs/demo_cpu.yaml`), built once per
test session and shared by the files that only read it or copy it (tests/commands/test_main_job_multiproc.py
resumes copies of it into the RL phase; tests/loop/test_restart_multiproc.py compares a broken warm-up with it).

Under `pytest -n N` (scripts/test.sh) the workers are separate processes: the run is built in the session's
base temporary folder (the parent of each worker's own), under a file lock, by whichever worker asks first;
the others wait for it. A failed build leaves no marker, so the next caller builds it again (and fails with
its output)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXE = str(Path(sys.executable).parent / "megatron-rl")
# the RL settings of test_main_job_multiproc.py (its RL launches resume this run): a 30-step warm-up has not
# learnt the <answer> format yet: the format bonus (0 in the demo) gives its rollouts reward variance, so the
# short RL phases really update the policy; one PPO epoch, so the reported KL is the engine-vs-trainer mismatch of
# the behaviour log-probs; no end-of-run HF export (tested in test_post_train_multiproc.py and
# test_critic_multiproc.py)
SHORT = ("train.steps=30", "train.eval_every=15", "data.train_tasks=64", "data.heldout_tasks=8", "eval.k=2",
         "eval.every=0", "rl.prompts_per_step=4", "rl.group_size=4", "monitor.tensorboard=false",
         "rl.reward_weights.format=0.1", "rl.trainer.epochs=1", "rl.max_oversample=2.0", "export.enabled=false")
STEPS, EVERY = 30, 15  # warm-up steps and its periodic checkpoints (test_restart_multiproc.py's kill lands between)
# the warm-up alone: the launch ends after it (rl.steps=0); no Prometheus endpoint (nothing reads it)
WARMUP = (*SHORT, f"train.checkpoint_every={EVERY}", "monitor.prometheus_port=-1", "rl.steps=0")


def shared_root(tmp_path_factory) -> Path:
    """A folder of this test session seen by every pytest-xdist worker (each has a basetemp of its own below the
    session's); without xdist, the session's basetemp. Removed with it by pytest's own clean-up."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def demo_warmup(tmp_path_factory) -> tuple[Path, str]:
    """The shared warm-up: (its run folder, the launch's output). Read it or copy it; never write into it."""
    from filelock import FileLock

    root = shared_root(tmp_path_factory) / "demo-warmup"
    done = root / "launch.out"  # written last: the run is complete
    with FileLock(str(root) + ".lock"):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a failed earlier build
            proc = subprocess.run([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={root}", *WARMUP], cwd=REPO,
                                  capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
            done.write_text(proc.stdout)
    return root / "demo", done.read_text()
