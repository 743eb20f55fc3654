"""The README's main job (`megatron-rl train configs/demo_cpu.yaml`) end to end, shortened: sandboxed
verification of the data, supervised warm-up, then the RL loop (sync and async) with the in-process rollout
engine at TP=2, real bubblewrap rewards, shards, checkpoints, SIGTERM + exact resume, and bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.demo_warmup import SHORT

REPO = Path(__file__).resolve().parents[2]
EXE = str(Path(sys.executable).parent / "megatron-rl")


def _train(*overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "train", "configs/demo_cpu.yaml", *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def warm(demo_warm) -> tuple[Path, str]:
    """The session's shared warm-up (tests/demo_warmup.py: data verified in the sandbox, 30 supervised steps, its
    checkpoint at the end): each RL test here copies the run folder and its `train` resumes there, at the end of
    the warm-up, into the RL phase. (The fresh start that goes from the warm-up to RL in one launch is
    test_main_job_async_with_a_separate_rollout_server's; resuming the warm-up mid-way, test_restart_multiproc.py.)
    Returns (the run folder, the launch's output)."""
    return demo_warm


def _from_warm(warm: tuple[Path, str], out: Path) -> Path:
    """A copy of the shared warm-up's run folder in `out` (the output_dir of the test's own launches)."""
    import shutil

    shutil.copytree(warm[0], out / "demo")
    return out


def _rows(run: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _check_sync_run(run: Path, warm_out: str, out: Path) -> None:
    """The README's main job, synchronous, resumed from the shared warm-up: 3 RL steps and what they leave."""
    sft, rl, ev = _rows(run, "sft"), _rows(run, "rl"), _rows(run, "eval")
    assert [r["step"] for r in sft] == list(range(30)) and sft[-1]["loss"] < sft[0]["loss"] - 1.0
    assert [r["step"] for r in rl] == [0, 1, 2] and [r["step"] for r in ev] == [0, 3]
    assert "verified in the 'bwrap' sandbox: 72/72 correct, corrupted answers rejected: 72/72" in warm_out
    for r in rl:
        assert r["policy_lag_max"] == 0 and r["mixed_version_samples"] == 0  # synchronous
        assert r["countdown/count"] >= 16 and r["sandbox_error_rate"] == 0.0
        assert abs(r["mismatch_kl"]) < 1e-3  # engine and trainer compute the same log-probs
        assert r["groups_seen"] - r["groups_filtered"] >= 0 and r["trained_samples"] <= 16
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["domains_heldout.png", "lengths.png", "rewards.png",
                                                                  "time.png"]  # + the per-domain heat map
    from megatron_rl.data.shards import read_shard

    shard = read_shard(run / "rl_shards" / "step-000001.h5")
    assert all(t.policy_version_first == 1 and (t.token_versions[t.prompt_len:] == 1).all() for t in shard)
    assert len({t.episode_id for t in shard}) == len(shard)
    # `megatron-rl eval` on the final checkpoint measures what the loop's last in-loop evaluation measured
    ev_proc = subprocess.run([EXE, "eval", str(run / "config.yaml"), "--out", str(out / "eval.json")], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert ev_proc.returncode == 0, ev_proc.stdout[-3000:] + ev_proc.stderr[-5000:]
    got = json.loads((out / "eval.json").read_text())
    assert got["trainer_step"] == 3 and got["checkpoint"].endswith("step-000003")
    assert {k: got["domains"]["countdown"][k] for k in ("success_greedy", "pass@1", "pass@2", "tasks")} == \
        {k: ev[-1][k] for k in ("success_greedy", "pass@1", "pass@2", "tasks")}


@pytest.mark.slow
@pytest.mark.multiproc
def test_main_job_async_staleness_2(tmp_path, warm):
    proc = _train(f"output_dir={_from_warm(warm, tmp_path)}", *SHORT, "rl.steps=4", "rl.max_staleness=2",
                  "rl.dynamic_sampling=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rl = _rows(tmp_path / "demo", "rl")
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    assert max(r["policy_lag_max"] for r in rl) >= 1 and all(r["policy_lag_max"] <= 2 for r in rl)
    assert all("is_weight_mean" in r and "behaviour_kl" in r for r in rl if not r["update_skipped"])
    from megatron_rl.data.shards import read_shard

    shards = sorted((tmp_path / "demo" / "rl_shards").glob("*.h5"))
    trajs = [t for s in shards for t in read_shard(s)]
    assert len({t.episode_id for t in trajs}) == len(trajs)
    # partial rollouts: some samples were generated across a weight update, token versions recorded
    assert any(t.policy_version_last > t.policy_version_first for t in trajs)


def _run_until(tmp_path: Path, overrides: tuple, stop_after_step: int) -> int:
    """Start the job, SIGTERM the driver once RL step `stop_after_step` is logged; returns its exit code."""
    proc = subprocess.Popen([EXE, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}", *overrides],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "demo" / "metrics.jsonl"
    deadline = time.time() + 500
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(r["step"] >= stop_after_step for r in _rows(tmp_path / "demo", "rl")):
            os.kill(proc.pid, signal.SIGTERM)
            break
        time.sleep(0.2)
    return proc.wait(timeout=300)


@pytest.mark.slow
@pytest.mark.multiproc
def test_main_job_sync_and_sigterm_and_resume_reproduce_the_unbroken_run(tmp_path, warm):
    """The synchronous main job (3 RL steps from the shared warm-up; `_check_sync_run`), with a KL penalty against
    the frozen reference (the warm-up's result), is also the unbroken run that a SIGTERM'd and resumed run must
    reproduce: the checkpoint carries the reference, so the resumed run's KL term, losses and metrics equal the
    unbroken run's (the reference used to be rebuilt from the fresh initialisation on resume)."""
    overrides = (*SHORT, "rl.steps=3", "rl.checkpoint_every=0", "rl.trainer.loss.kl_coef=0.05",
                 "rl.trainer.reference=true")
    unbroken = _train(f"output_dir={_from_warm(warm, tmp_path / 'a')}", *overrides)
    assert unbroken.returncode == 0, unbroken.stdout[-3000:] + unbroken.stderr[-5000:]
    assert "resuming the warm-up from" in unbroken.stdout  # the shared warm-up, at its end: straight to RL
    _check_sync_run(tmp_path / "a" / "demo", warm[1], tmp_path)
    # SIGTERM once step 0 is logged: the stop lands after step 0 or 1, before the last step (2)
    assert _run_until(_from_warm(warm, tmp_path / "b"), overrides, stop_after_step=0) == 3
    stopped = _rows(tmp_path / "b" / "demo", "rl")
    assert len(stopped) < 3 and (tmp_path / "b" / "demo" / "checkpoints" / "latest").exists()
    resumed = _train(f"output_dir={tmp_path / 'b'}", *overrides)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert "resuming from" in resumed.stdout
    a, b = _rows(tmp_path / "a" / "demo", "rl"), _rows(tmp_path / "b" / "demo", "rl")
    assert [r["step"] for r in b] == [0, 1, 2]
    assert not any(r["update_skipped"] for r in a), "the comparison must cover real optimizer updates"
    assert all(r["ref_kl"] > 0 for r in a[1:]), [r["ref_kl"] for r in a]  # the KL term is live after step 0
    keys = ("loss", "reward_mean", "grad_norm", "entropy_mean", "trained_samples", "response_len_mean", "ref_kl",
            "mismatch_kl", "lr")
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in keys} == {k: rb.get(k) for k in keys}, (ra["step"], ra, rb)


@pytest.mark.slow
@pytest.mark.multiproc
def test_checkpoint_before_the_first_update_saves_and_resumes_exactly(tmp_path):
    """Every RL step skipped so far (all groups filtered): Adam has no state yet; the save used to fail."""
    from tests.mp.launch import torchrun

    (rec,) = torchrun(REPO / "tests" / "mp" / "driver_ckpt_before_update.py", 2, ["--dir", str(tmp_path)],
                      timeout=400)
    assert rec["resumed"] == rec["unbroken"] and rec["weights_bitwise"], rec
    assert rec["adam_steps"] == [[2.0], [2.0]], rec  # one counter per parameter, each advanced once per update
    assert rec["refused"] and "holds no KL reference model" in rec["refused"] and "step0" in rec["refused"], rec


def _cli(capsys, monkeypatch, *argv: str) -> tuple[int, str]:
    """`megatron-rl ARGV` in this process (the console script's `main`): these commands fail before any work, so a
    process of their own would only add its start-up (torch and the registry imports, ~3 CPU-s each)."""
    from megatron_rl.cli import main

    monkeypatch.chdir(REPO)
    capsys.readouterr()
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.mark.slow  # imports the eval command's modules (megatron.core)
def test_eval_without_a_checkpoint_says_how_to_get_one(tmp_path, capsys, monkeypatch):
    rc, err = _cli(capsys, monkeypatch, "eval", "configs/demo_cpu.yaml", f"output_dir={tmp_path}")
    assert rc == 2
    assert f"no checkpoint in {tmp_path / 'demo' / 'checkpoints'}; train first or pass --checkpoint DIR" in err


@pytest.mark.slow  # imports every registered environment (reasoning_gym's ~100) to name them
def test_unknown_environment_fails_before_any_work(tmp_path, capsys, monkeypatch):
    rc, err = _cli(capsys, monkeypatch, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}", "data.domain=chess",
                   "curriculum.enabled=false")
    assert rc == 2
    assert "data.domain 'chess' is not a registered environment" in err
    assert not (tmp_path / "demo").exists()


def test_impossible_layout_fails_before_any_work(tmp_path, capsys, monkeypatch):
    rc, err = _cli(capsys, monkeypatch, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}", "parallel.tp=3")
    assert rc == 2
    assert "model.num_attention_heads=4 is not divisible by parallel.tp=3" in err
    assert not (tmp_path / "demo").exists()


def test_rl_generation_too_long_for_the_model_fails(tmp_path, capsys, monkeypatch):
    rc, err = _cli(capsys, monkeypatch, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}",
                   "rl.max_new_tokens=60")
    assert rc == 2 and "rl.max_new_tokens=60 leaves no room for a prompt" in err


def test_unknown_key_names_it(tmp_path, capsys, monkeypatch):
    rc, err = _cli(capsys, monkeypatch, "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}", "train.stepz=3")
    assert rc == 2 and "unknown config key 'train.stepz' (did you mean 'steps'?)" in err


DISPATCH = ("episodes.runner=dispatch", "episodes.dispatch.episodes_per_task=8", "episodes.worker_threads=2")


def _episodes(run: Path) -> list:
    from megatron_rl.data.shards import read_shard

    return [t for p in sorted((run / "rl_episodes").glob("*/*.h5")) for t in read_shard(p)]


@pytest.mark.slow
@pytest.mark.multiproc
def test_main_job_dispatched_episodes_and_recovery_from_published_shards(tmp_path, warm):
    """Episodes run by rollout workers (submitit local processes) that call the engine's HTTP server on rank 0
    and publish shards; then a crash after step 1's episodes were published but before its checkpoint: the
    rerun dispatches nothing for step 1 (all recovered from the shards) and reproduces step 1 exactly."""
    from megatron_rl.tokenizer import ByteTokenizer

    overrides = (*SHORT, *DISPATCH, "episodes.dispatch.executor=local", "rl.steps=2", "rl.checkpoint_every=1")
    proc = _train(f"output_dir={_from_warm(warm, tmp_path)}", *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "demo"
    rl = _rows(run, "rl")
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        assert r["episodes_dispatched"] >= 16 and r["episodes_recovered"] == 0 and r["episodes_missing"] == 0
        assert r["dispatch_failed_tasks"] == 0 and r["sandbox_error_rate"] == 0.0
        assert abs(r["mismatch_kl"]) < 1e-3  # the workers' behaviour log-probs are the trainer's
    eps = _episodes(run)
    assert len(eps) == sum(r["episodes_dispatched"] for r in rl) == len({t.episode_id for t in eps})
    assert {int(t.token_versions[-1]) for t in eps} == {0, 1}  # step 1's episodes came from the updated weights
    # the driver's prompt format (<bos> + compact prompt), scored by the countdown reward in the worker's sandbox
    assert all(t.tokens[0] == ByteTokenizer(384).bos_id and "correct" in t.reward_components for t in eps)
    # crash after step 1's episodes were published, before its checkpoint: resume at step 1
    ckpt = run / "checkpoints"
    import shutil

    shutil.rmtree(ckpt / "step-000002")
    (ckpt / "latest").write_text("step-000001\n")
    again = _train(f"output_dir={tmp_path}", *overrides)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-5000:]
    first, redo = rl[1], _rows(run, "rl")[-1]
    assert redo["step"] == 1 and redo["episodes_dispatched"] == 0
    assert redo["episodes_recovered"] == first["episodes_dispatched"]
    keys = ("loss", "reward_mean", "grad_norm", "trained_samples", "groups_seen", "response_len_mean")
    assert {k: redo.get(k) for k in keys} == {k: first.get(k) for k in keys}
    assert len(_episodes(run)) == len(eps)  # nothing dispatched twice


@pytest.mark.slow
@pytest.mark.multiproc
def test_main_job_async_with_a_separate_rollout_server(tmp_path):
    """Staleness 2 with the engine in a rollout server process of its own: the next steps' episodes run while
    the trainer trains, weights are pushed after every update, the server is gone after the run."""
    overrides = (*SHORT, *DISPATCH, "episodes.dispatch.executor=local", "episodes.server=separate", "parallel.tp=1",
                 "launch.nproc_per_node=1", "rl.steps=4", "rl.max_staleness=2", "rl.dynamic_sampling=false")
    proc = _train(f"output_dir={tmp_path}", *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = tmp_path / "demo"
    rl = _rows(run, "rl")
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    assert max(r["policy_lag_max"] for r in rl) >= 1 and all(r["policy_lag_max"] <= 2 for r in rl)
    assert all(r["episodes_missing"] == 0 for r in rl)
    assert all("is_weight_mean" in r for r in rl if not r["update_skipped"])  # TIS on: staleness > 0
    eps = _episodes(run)
    assert len(eps) == 4 * 16 == len({t.episode_id for t in eps})
    # the server received the trainer's updates: later episodes were generated by later policy versions
    versions = {int(v) for t in eps for v in t.token_versions[t.prompt_len:]}
    assert 0 in versions and max(versions) >= 1, versions
    log = (run / "rollout_server" / "server.log").read_text()
    assert [f"policy version {v}," in log for v in (1, 2, 3, 4)] == [True] * 4, log[-2000:]
    import socket

    port = int((run / "rollout_server" / "port").read_text())
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the rollout server outlived the run"
