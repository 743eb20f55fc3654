"""Dispatch on the real dev Slurm cluster: job arrays, scancel of a task, time-limit checkpoint + requeue,
mpi4py work sharing under `srun --mpi=pmix`, and every sbatch script in slurm/ run as-is (small settings).

Time limits: Slurm's own warning signal fires on a coarse timer, so most tests send the same signal the
time limit would (`scancel --signal=USR2` for submitit tasks, `scancel --signal=USR1 --batch` for the sbatch
scripts' trap) instead of waiting for it; everything after the signal (checkpoint, requeue, resume, finish)
is the real path: the real `megatron-rl train` under train_multinode.sbatch (checkpoint, requeue, resume equal
to an unbroken run) and under rl_hetjob.sbatch (trainer + persistent fleet). One test waits for slurmctld's
own timer on a 2-minute limit with the real trainer: it is requeued until done, equal to an unbroken run."""
from __future__ import annotations

import json
import re
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.data.consume import FolderRead, read_folder
from megatron_rl.dispatch import (
    DispatchConfig,
    Dispatcher,
    FaultConfig,
    GeneratorConfig,
    WorkerConfig,
    WorkerSpec,
    episodes_from_tasks,
)
from megatron_rl.envs.tasks import load_domain

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

TASKS = load_domain("countdown", split="train")
PY = sys.executable


def worker(**faults) -> WorkerConfig:
    """Scripted TEST policy, 90% wrong answers (no sandbox run needed) -> trivial episodes."""
    return WorkerConfig(threads=1, generator=GeneratorConfig(wrong_fraction=0.9), faults=FaultConfig(**faults))


def slurm_cfg(tmp_path: Path, **kw) -> DispatchConfig:
    return DispatchConfig(executor="slurm", partition="cpu", folder=str(tmp_path / "submitit"), time_min=5,
                          mem_gb=0.5, poll_s=0.5, **kw)


def consume_all(shard_dir: Path) -> tuple[list[str], FolderRead]:
    got = read_folder(shard_dir)
    return [t.episode_id for t in got.trajectories], got


def wait_for(cond, timeout: float, what: str, every: float = 0.2) -> None:
    """Poll `cond` every `every` s (1 s where it runs sacct: each call is a process and an RPC, which a loaded
    machine takes from the jobs)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run_in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # surfaced by the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def test_200_episodes_as_a_job_array(slurm_cluster, monkeypatch, tmp_path):
    slurm_cluster.patch_env(monkeypatch)
    eps = episodes_from_tasks(TASKS[:200])
    report = Dispatcher(slurm_cfg(tmp_path, episodes_per_task=25), worker(), tmp_path / "shards").run(eps)
    assert report.ok and report.duplicates == 0 and not report.failures, report.failures
    assert report.rounds[0]["tasks"] == 8 and len(report.shards) == 8
    assert all("_" in s.split("-j")[1].split("-q")[0] for s in report.shards)   # array ids: <job>_<index>
    ids, reader = consume_all(tmp_path / "shards")
    assert sorted(ids) == report.finished == sorted(e.episode_id for e in eps)
    assert reader.duplicates == 0 and not reader.quarantined


def test_scancel_of_one_array_task_loses_and_duplicates_nothing(slurm_cluster, monkeypatch, tmp_path):
    slurm_cluster.patch_env(monkeypatch)
    eps = episodes_from_tasks(TASKS[:24])
    w = worker(delay_s=1.5, delay_in_rounds=[0])
    w.episodes_per_shard = 2
    d = Dispatcher(slurm_cfg(tmp_path, episodes_per_task=8), w, tmp_path / "shards")
    t, out = run_in_thread(lambda: d.run(eps))
    wait_for(lambda: len(d.jobs) == 3, 60, "the array to be submitted")
    victim = d.jobs[1].job_id
    wait_for(lambda: list((tmp_path / "shards").glob(f"*-j{victim}-*.h5")), 90, "the victim's first shard")
    slurm_cluster.run(["scancel", victim])  # submitit's worker ignores SIGTERM; SIGKILL follows KillWait (3 s)
    t.join(180)
    assert "error" not in out, out.get("error")
    report = out["value"]
    assert report.ok and report.duplicates == 0, report.rounds
    assert any(f["job_id"] == victim for f in report.failures), (victim, report.failures, report.rounds)
    assert report.rounds[1]["episodes"] < 8                 # only the cancelled task's unfinished episodes
    ids, reader = consume_all(tmp_path / "shards")
    assert sorted(ids) == sorted(e.episode_id for e in eps) and reader.duplicates == 0


def test_time_limit_signal_checkpoints_requeues_and_finishes(slurm_cluster, monkeypatch, tmp_path):
    """submitit Checkpointable path: USR2 (what Slurm sends signal_delay_s before the limit) -> the task
    publishes what it finished, requeues itself with the rest, and the requeued run finishes them."""
    slurm_cluster.patch_env(monkeypatch)
    eps = episodes_from_tasks(TASKS[:10])
    w = worker(delay_s=0.5)
    w.episodes_per_shard = 1
    d = Dispatcher(slurm_cfg(tmp_path, episodes_per_task=10, max_num_timeout=2), w, tmp_path / "shards")
    t, out = run_in_thread(lambda: d.run(eps))
    wait_for(lambda: len(list((tmp_path / "shards").glob("*.h5"))) >= 3, 90, "first shards")
    slurm_cluster.run(["scancel", "--signal=USR2", d.jobs[0].job_id])
    t.join(180)
    assert "error" not in out, out.get("error")
    report = out["value"]
    assert report.ok and report.duplicates == 0 and not report.failures, report.failures
    assert len(report.rounds) == 1                           # no dispatcher retry: the task requeued itself
    attempts = {s.split("-q")[1].split("-")[0] for s in report.shards}
    assert attempts == {"0", "1"}, report.shards            # shards from before and after the requeue
    log = Path(d.jobs[0].paths.stderr).read_text()
    assert "checkpoint:" in log and "requeue" in log.lower()
    ids, _ = consume_all(tmp_path / "shards")
    assert sorted(ids) == sorted(e.episode_id for e in eps)


def test_two_task_worker_job_shares_work_through_mpi(slurm_cluster, tmp_path):
    eps = episodes_from_tasks(TASKS[:12])
    spec = WorkerSpec(episodes=eps, shard_dir=str(tmp_path / "shards"), worker=worker(delay_s=0.3)).dump(
        tmp_path / "spec.json")
    res = slurm_cluster.run(["srun", "--mpi=pmix", "-p", "cpu", "-n", "2", "--time=3", PY, "-m",
                             "megatron_rl.dispatch.worker", "--spec", str(spec), "--mpi", "--report",
                             str(tmp_path / "r.json")], timeout=180)
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["ranks"] == 2, res.stdout
    per_rank = {r["rank"]: r["episodes"] for r in summary["per_rank"]}
    assert per_rank[0] > 0 and per_rank[1] > 0 and sum(per_rank.values()) == 12, summary
    ids, _ = consume_all(tmp_path / "shards")
    assert sorted(ids) == sorted(e.episode_id for e in eps)


# ------------------------------------------------------------------------------------------ sbatch scripts
def sbatch(cluster, args: list[str], env: str = "", wait: bool = True, timeout: float = 180) -> str:
    cmd = f"MRL_PYTHON={shlex.quote(PY)} {env} sbatch --parsable {'-W ' if wait else ''}{shlex.join(args)}"
    return cluster.run(cmd, timeout=timeout).stdout.strip().split(";")[0]


def sacct(cluster, job: str) -> list[str]:
    """The job's state(s). A poll: a client killed by a signal (once seen: SIGPIPE, slurmdbd dropping the
    connection under load) is asked again, up to 3 times; any other failure fails at once."""
    for _ in range(3):
        res = cluster.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], check=False)
        if res.returncode >= 0:
            break
        time.sleep(1)
    assert res.returncode == 0, f"sacct -j {job}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout.split()


def test_train_multinode_sbatch_runs_probe(slurm_cluster, tmp_path):
    log = tmp_path / "train.out"
    sbatch(slurm_cluster, ["-o", str(log), "slurm/train_multinode.sbatch"],
           env=f"MRL_TRAIN_CMD={shlex.quote(f'{PY} -m megatron_rl.distributed probe')}")
    probes = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert sorted(p["rank"] for p in probes) == [0, 1]
    assert all(p["world_size"] == 2 and p["source"] == "slurm" and p["allreduce"] == 3.0 for p in probes)


# The real `megatron-rl train` on one rank (the gpu partition's fake GPU; gloo on CPU): a short warm-up, then
# 4 synchronous GRPO steps with real optimizer updates (the format bonus gives the groups reward variance).
TRAIN = ("launch.nproc_per_node=1", "parallel.tp=1", "train.steps=30", "train.eval_every=15",
         "data.train_tasks=64", "data.heldout_tasks=8", "eval.k=2", "eval.every=0", "rl.prompts_per_step=4",
         "rl.group_size=4", "monitor.tensorboard=false", "monitor.prometheus_port=-1",
         "rl.reward_weights.format=0.1", "rl.trainer.epochs=1", "rl.max_oversample=2.0", "rl.steps=4",
         "rl.checkpoint_every=0")
NO_EXPORT = ("export.enabled=false",)  # where a test reads no HF export (test_post_train_multiproc.py reads one)
RL_KEYS = ("loss", "reward_mean", "grad_norm", "entropy_mean", "trained_samples", "response_len_mean",
           "mismatch_kl", "lr", "sandbox_error_rate")


def _rl_rows(run: Path) -> list[dict]:
    """RL rows of metrics.jsonl as the run now stands (the last row of each step; a line being written is
    left out)."""
    rows: dict[int, dict] = {}
    path = run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("kind") == "rl":
            rows[r["step"]] = r
    return [rows[k] for k in sorted(rows)]


TL_STEPS = 80
"""RL steps of the unbroken reference run and of the time-limit test's run: ~47 s of work after the first warm-up
step on an idle machine (7 s of warm-up, 0.5 s per RL step), past the latest signal of the time-limit test (30 s
after its limit is set)."""
TRAIN_TL = (*(o for o in TRAIN if not o.startswith("rl.steps")), f"rl.steps={TL_STEPS}", *NO_EXPORT)


def train_job(cluster, tmp: Path, name: str, train: tuple[str, ...], limit: tuple[str, ...] = ()) -> str:
    """Submit `megatron-rl train configs/demo_cpu.yaml` (one rank, the fake GPU) under train_multinode.sbatch."""
    return sbatch(cluster, ["-o", str(tmp / f"{name}.out"), "--ntasks-per-node=1", "--gres=gpu:1", *limit,
                            "slurm/train_multinode.sbatch", "configs/demo_cpu.yaml", f"output_dir={tmp / name}",
                            *train], wait=False)


@pytest.fixture(scope="module")
def unbroken(slurm_cluster, tmp_path_factory):
    """One unbroken job (TRAIN_TL: TL_STEPS RL steps), the reference of the USR1 and the time-limit tests (one
    launch of the trainer fewer than a reference each): submitted at the first of them, it runs alongside their
    jobs. The USR1 test's run has 4 RL steps on the same LR schedule (rl.optim.decay_steps=TL_STEPS) and compares
    them with this run's first 4. Returns (job id, run folder); cancelled at the module's end if still running."""
    tmp = tmp_path_factory.mktemp("ref")
    job = train_job(slurm_cluster, tmp, "unbroken", TRAIN_TL)
    yield job, tmp / "unbroken" / "demo"
    slurm_cluster.run(["scancel", job], check=False)


USR1_STEPS = 6  # RL steps of the USR1 test's job (compared step for step with the unbroken job's first ones)


def test_usr1_checkpoints_requeues_and_resumes_the_real_trainer_equal_to_the_unbroken_run(slurm_cluster,
                                                                                         unbroken, tmp_path):
    """slurm/train_multinode.sbatch runs `megatron-rl train configs/demo_cpu.yaml` (tiny overrides). USR1 to
    the batch shell (what --signal=B:USR1@... sends before the time limit) mid-RL: the trainer finishes its
    step, checkpoints, exits 3; the job requeues itself, resumes from that checkpoint and finishes. Its RL
    metrics, step for step, equal an unbroken job's (same script and settings but the number of RL steps, on
    the same LR schedule; the `unbroken` fixture's job, run alongside)."""
    # USR1_STEPS RL steps, the signal sent once step 0 is logged: it must land before the last step ends (a loaded
    # machine delays `scancel --signal` by seconds; with 4 steps and the signal after step 1 it once came too late)
    job = train_job(slurm_cluster, tmp_path, "broken", (*(o for o in TRAIN if not o.startswith("rl.steps")),
                                                        f"rl.steps={USR1_STEPS}", f"rl.optim.decay_steps={TL_STEPS}",
                                                        *NO_EXPORT))
    broken, (ref_job, ref) = tmp_path / "broken" / "demo", unbroken
    wait_for(lambda: any(r["step"] >= 0 for r in _rl_rows(broken)), 600, "RL step 0 of the job to be logged")
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job])
    done = lambda j: sacct(slurm_cluster, j) in (["COMPLETED"], ["FAILED"], ["CANCELLED"])  # noqa: E731
    wait_for(lambda: done(job), 600, "the job to finish", every=1)
    # the reference's step USR1_STEPS - 1 is final once step USR1_STEPS is logged
    wait_for(lambda: any(r["step"] >= USR1_STEPS for r in _rl_rows(ref)) or done(ref_job), 600,
             f"the reference's RL step {USR1_STEPS}", every=1)
    text = (tmp_path / "broken.out").read_text()
    assert sacct(slurm_cluster, job) == ["COMPLETED"], text[-4000:]
    assert sacct(slurm_cluster, ref_job) in (["RUNNING"], ["COMPLETED"]), \
        (ref.parent.parent / "unbroken.out").read_text()[-4000:]
    assert "USR1: checkpoint requested (restart 0)" in text and "scontrol requeue" in text, text[-4000:]
    assert "restart 1 on" in text and "resuming from" in text, text[-4000:]
    rows = [json.loads(line) for line in (broken / "metrics.jsonl").read_text().splitlines()]
    resume = [r for r in rows if r["kind"] == "resume"]
    assert [r["phase"] for r in resume] == ["rl"] and 1 <= resume[0]["step"] < USR1_STEPS, resume  # mid-run
    a, b = _rl_rows(ref)[:USR1_STEPS], _rl_rows(broken)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(USR1_STEPS))
    assert sum(not r["update_skipped"] for r in a) >= 2, "the comparison must cover real optimizer updates"
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in RL_KEYS} == {k: rb.get(k) for k in RL_KEYS}, (ra["step"], ra, rb)
    assert (broken / "checkpoints" / "latest").read_text().strip() == f"step-{USR1_STEPS:06d}"


def _rows(run: Path, kind: str) -> list[dict]:
    """The last row of each step of `kind` in metrics.jsonl (a resumed run appends)."""
    rows = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == kind:
            rows[r["step"]] = r
    return [rows[k] for k in sorted(rows)]


WARN_S = 170  # --signal=B:USR1@WARN_S of the time-limit test


def signal_now_limit_min(elapsed_s: float) -> int:
    """Whole minutes of time limit for a job that has run at most `elapsed_s` (and at least elapsed_s - 49 s):
    slurmctld's next 30-s check signals it (the limit minus WARN_S + 30 s is behind it) and the limit itself
    is >= 91 s ahead, time for the test to see the signal and raise the limit."""
    return max(2, -(-int(elapsed_s + 91) // 60))


def _rows_now(run: Path, kind: str) -> list[dict]:
    """Rows of `kind` in metrics.jsonl as the run now stands (none yet, or a line being written, left out)."""
    path = run / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("kind") == kind:
            rows.append(r)
    return rows


def test_slurms_own_time_limit_requeues_the_real_trainer_until_done_equal_to_the_unbroken_run(slurm_cluster,
                                                                                            unbroken, tmp_path):
    """No scancel: the real `megatron-rl train` under slurm/train_multinode.sbatch with a time limit and
    --signal=B:USR1@170, so slurmctld's own timer sends USR1 (it checks every 30 s and signals when the
    limit is at most 170 + 30 s away). The limit is set once the trainer logs its first warm-up step (its
    stop flag is in place: a USR1 earlier would kill the start-up, which the sbatch trap requeues without a
    checkpoint) to the shortest whole minutes that put that point inside the signal window, so the signal
    lands 0-30 s later, whatever the machine's load made of the start-up. Each run checkpoints the phase it
    is in (warm-up or RL) on the signal and the job requeues itself until the run is done; its warm-up and
    RL metrics, step for step, equal an unbroken job's (same script and settings, run alongside). Once the
    first signal is logged the test raises the limit to 15 minutes, so the resumed run is not signalled."""
    jobs, steps = {"unbroken": unbroken[0]}, TL_STEPS  # the reference: the `unbroken` fixture's job
    submitted = time.monotonic()
    jobs["limited"] = train_job(slurm_cluster, tmp_path, "limited", TRAIN_TL,
                                limit=("--time=00:15:00", f"--signal=B:USR1@{WARN_S}"))
    limited = tmp_path / "limited" / "demo"
    wait_for(lambda: _rows_now(limited, "sft"), 600, "the limited job's first warm-up step", every=0.5)
    slurm_cluster.run(["scontrol", "update", f"JobId={jobs['limited']}",
                       f"TimeLimit={signal_now_limit_min(time.monotonic() - submitted)}"])
    done = lambda j: sacct(slurm_cluster, j) in (["COMPLETED"], ["FAILED"], ["CANCELLED"], ["TIMEOUT"])  # noqa: E731
    out = tmp_path / "limited.out"
    wait_for(lambda: (out.exists() and "USR1: checkpoint requested" in out.read_text()) or done(jobs["limited"]),
             600, "Slurm's timer to signal the limited job", every=1)
    slurm_cluster.run(["scontrol", "update", f"JobId={jobs['limited']}", "TimeLimit=00:15:00"], check=False)
    wait_for(lambda: all(done(j) for j in jobs.values()), 900, "both jobs to finish (the limited one requeued)",
             every=1)
    text = out.read_text()
    assert all(sacct(slurm_cluster, j) == ["COMPLETED"] for j in jobs.values()), text[-4000:]
    signalled = text.count("USR1: checkpoint requested")
    assert signalled >= 1 and "restart 1 on" in text, text[-4000:]  # Slurm's own timer signalled, it requeued
    assert text.count("scontrol requeue") + text.count("not requeued") == signalled, text  # one answer per signal
    # each stopped launch names the checkpoint it leaves; the next launch resumes from exactly that one
    stops = list(re.finditer(r"the run stopped early \(signal or alert\); checkpoint (\S+) \((saved by this)?",
                             text))
    assert any(m[2] for m in stops), text[-4000:]  # at least one launch saved a checkpoint on the signal
    for m in stops:
        nxt = re.search(r"resuming (?:the warm-up )?from (\S+) ", text[m.end():])
        assert nxt and nxt[1] == m[1], (m[0], nxt and nxt[0])
    resumes = _rows(limited, "resume")
    assert resumes and {r["phase"] for r in resumes} <= {"warmup", "rl"}, resumes
    unbroken = unbroken[1]
    sft_a, sft_b = _rows(unbroken, "sft"), _rows(limited, "sft")
    assert [r["step"] for r in sft_a] == [r["step"] for r in sft_b] == list(range(30))
    for ra, rb in zip(sft_a, sft_b):
        assert {k: ra[k] for k in ("loss", "grad_norm", "lr")} == {k: rb[k] for k in ("loss", "grad_norm", "lr")}
    a, b = _rl_rows(unbroken), _rl_rows(limited)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(steps))
    for ra, rb in zip(a, b):
        assert {k: ra.get(k) for k in RL_KEYS} == {k: rb.get(k) for k in RL_KEYS}, (ra["step"], ra, rb)
    print(json.dumps({"signals": signalled, "resumes": [(r["phase"], r["step"]) for r in resumes]}))


def test_rl_hetjob_sbatch_trains_on_component_0_with_a_persistent_fleet_on_component_1(slurm_cluster, tmp_path):
    """slurm/rl_hetjob.sbatch: the real `megatron-rl train` on the gpu component, its rollout fleet (2 workers,
    started by the script) on the cpu component; nothing submitted, the evaluations' episodes run there too.
    USR1 to the batch shell mid-RL (what --signal=B:USR1@... sends): the trainer checkpoints and stops its
    workers, the job requeues itself, the new driver resumes with new workers, and every episode is trained
    exactly once."""
    from megatron_rl.data.shards import read_shard

    out = tmp_path / "het"
    job = sbatch(slurm_cluster, ["-o", str(tmp_path / "het.out"), "slurm/rl_hetjob.sbatch", "configs/demo_cpu.yaml",
                                 str(out), *[o for o in TRAIN if not o.startswith("rl.steps")], "rl.steps=3",
                                 "episodes.fleet.episodes_per_lease=4", "episodes.worker_threads=1", *NO_EXPORT],
                 wait=False)
    run = out / "demo"
    wait_for(lambda: _rl_rows(run), 600, "RL step 0 of the hetjob to be logged")
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job])
    ended = lambda: set(sacct(slurm_cluster, job)) in ({"COMPLETED"}, {"FAILED"}, {"CANCELLED"})  # noqa: E731
    wait_for(ended, 600, "the hetjob (both components) to finish through its requeue", every=1)
    text = (tmp_path / "het.out").read_text() + (out / "trainer.out").read_text() + (out / "workers.out").read_text()
    assert sacct(slurm_cluster, job) == ["COMPLETED", "COMPLETED"], text[-4000:]  # one row per component
    assert "USR1: checkpoint requested (restart 0)" in text and "scontrol requeue" in text, text[-4000:]
    assert "restart 1:" in text, text[-4000:]
    resume = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"resume"' in x]
    assert [r["phase"] for r in resume] == ["rl"] and 1 <= resume[0]["step"] < 3, resume  # stopped mid-run
    rl = _rl_rows(run)
    assert [r["step"] for r in rl] == [0, 1, 2], text[-4000:]
    for r in rl:
        assert r["episodes_missing"] == 0 and r["sandbox_error_rate"] == 0.0 and r["trained_samples"] > 0
        assert r["fleet_submissions"] == 0  # the script started the workers
        assert abs(r["mismatch_kl"]) < 1e-3  # the workers' behaviour log-probs are the trainer's
    eps = [t for p in sorted((run / "rl_episodes").glob("*/*.h5")) for t in read_shard(p)]
    trained = sum(r["episodes_dispatched"] + r.get("episodes_recovered", 0) for r in rl)
    assert len(eps) == trained == len({t.episode_id for t in eps}), (len(eps), trained)  # each episode once
    workers = [json.loads(line) for line in (out / "workers.out").read_text().splitlines() if line.startswith("{")]
    assert len(workers) == 4 and all(w["partition"] == "cpu" for w in workers), text  # 2 per life of the job
    assert all(w["reason"] == "run over" for w in workers[2:]), workers
    evals = [t for p in sorted((run / "eval_episodes").glob("*/*.h5")) for t in read_shard(p)]
    assert len(evals) % 24 == 0 and len(evals) >= 2 * 24  # the in-loop evaluations (8 tasks greedy + k=2) too
    assert sum(w["episodes"] for w in workers) == len(eps) + len(evals), workers  # every episode ran on the fleet
    # each life's fleet served; one of its two workers may get no lease when the other starts first and the
    # remaining work is small (a resume at the last step), so the count is per life, not per worker
    assert sum(w["episodes"] for w in workers[:2]) > 0 and sum(w["episodes"] for w in workers[2:]) > 0, workers
    print(json.dumps({"resumed_at": resume[0]["step"], "episodes": len(eps), "evals": len(evals),
                      "workers": [(w["reason"], w["episodes"]) for w in workers]}))


def test_rl_submitit_sbatch_runs_every_step_through_one_fleet_submission(slurm_cluster, tmp_path):
    from tests.dispatch.test_fleet import published_counts

    out = tmp_path / "fleet"
    sbatch(slurm_cluster, ["-o", str(tmp_path / "drv.out"), "slurm/rl_submitit.sbatch", str(out), "--steps", "3",
                           "--per-step", "8", "--size", "2", "--episodes-per-lease", "4", "--wrong-fraction", "0.9",
                           "--threads", "1", "--time-min", "5", "--mem-gb", "0.5", "--poll-s", "1",
                           "--heartbeat-s", "1", "--lease-s", "10", "--wait-s", "2"])
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["given_up"] == 0 for r in rows), rows
    assert rows[-1]["submissions"] == 1 and rows[-1]["workers_submitted"] == 2  # one array for the whole run
    assert max(r["first_lease_s"] for r in rows[1:]) < 1.0  # warm workers took the later steps' episodes
    counts = published_counts(out / "shards")
    assert len(counts) == 24 and set(counts.values()) == {1}, counts  # every episode exactly once


def test_eval_array_sbatch(slurm_cluster, tmp_path):
    out = tmp_path / "eval"
    sbatch(slurm_cluster, ["-o", str(tmp_path / "eval-%a.out"), "slurm/eval_array.sbatch", str(out), "--num", "8"])
    shards = sorted(p.name for p in (out / "shards").glob("*.h5"))
    assert [s.split("-")[1] for s in shards] == ["s0", "s1", "s2", "s3"]
    ids, _ = consume_all(out / "shards")
    assert len(ids) == len(set(ids)) == 8


def test_cpu_partition_workers_generate_through_a_rollout_server_on_localhost(slurm_cluster, monkeypatch, tmp_path):
    """Array tasks on the cpu partition ask a real rollout server (this process, 127.0.0.1) for their tokens."""
    from megatron_rl.data.shards import read_shard
    from megatron_rl.http_auth import write_token_file
    from tests.dispatch.test_dispatch_http import _TOKENS, SAMPLING, VERSION, check_trajectory, start_server

    slurm_cluster.patch_env(monkeypatch)
    srv = start_server()
    token_file = tmp_path / "rollout_token"  # the server's token, handed to the array tasks as the driver does
    write_token_file(token_file, srv.token)
    _TOKENS[srv.url] = str(token_file)
    try:
        eps = episodes_from_tasks(TASKS[:6], sampling=SAMPLING, seed=9, prefix="slurm-http")
        w = WorkerConfig(threads=1, generator=GeneratorConfig(kind="http", url=srv.url, retries=1,
                                                              token_file=str(token_file)))
        report = Dispatcher(slurm_cfg(tmp_path, episodes_per_task=3), w, tmp_path / "shards").run(eps)
        assert report.ok and report.duplicates == 0 and not report.failures, report.failures
        assert not report.episode_failures and report.rounds[0]["tasks"] == 2
        ids, reader = consume_all(tmp_path / "shards")
        assert sorted(ids) == report.finished == sorted(e.episode_id for e in eps)
        trajs = {t.episode_id: t for n in report.shards for t in read_shard(tmp_path / "shards" / n)}
        for ep in eps:
            check_trajectory(trajs[ep.episode_id], ep, srv.url)
            assert trajs[ep.episode_id].policy_version_last == VERSION
    finally:
        _TOKENS.pop(srv.url, None)
        srv.stop()
