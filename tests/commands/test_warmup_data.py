"""The warm-up's data (`commands.warmup.prepare_data`) does not depend on the machine's load: a reference solution
that fails its check (under load, a sandbox's wall-clock limit can fail a correct one) is checked again, alone;
one that fails every check is left out, counted and named, never dropped in silence."""
import logging
from concurrent.futures import Future

from megatron_rl import config as C
from megatron_rl.commands import warmup
from megatron_rl.data.shards import read_shard
from megatron_rl.envs.base import RewardResult
from megatron_rl.run_config import RunConfig


class _Flaky:
    """The run's real episode runner, except that the reference answers of `tasks` fail their first `fails[id]`
    checks as a timed-out sandbox run does (a valid 0: the sandbox said the program ran too long)."""

    def __init__(self, runner, fails: dict[str, int]):
        self.runner, self.fails, self.calls = runner, dict(fails), {}

    def submit(self, task, response):
        from megatron_rl.prompts import environment

        if response == environment(task.domain).reference_response(task):
            self.calls[task.id] = self.calls.get(task.id, 0) + 1
            if self.fails.get(task.id, 0) >= self.calls[task.id]:
                fut = Future()
                fut.set_result(RewardResult(0.0, components={"correct": 0.0}, reasons={"correct": "timed out"}))
                return fut
        return self.runner.submit(task, response)

    def close(self):
        self.runner.close()


def test_a_reference_solution_that_fails_is_rechecked_and_one_that_always_fails_is_named(tmp_path, monkeypatch,
                                                                                            caplog):
    from megatron_rl.loop import job

    cfg = C.load(RunConfig, "configs/demo_cpu.yaml",
                 [f"output_dir={tmp_path}", "data.train_tasks=6", "data.heldout_tasks=2"])
    train = job.task_lists(cfg)["train"][:6]
    flaky_once, flaky_twice, broken = train[0].id, train[3].id, train[5].id
    fails = {flaky_once: 1, flaky_twice: 2, broken: 1 + warmup.RECHECKS}
    real, made = job.episode_runner, []

    def episode_runner(cfg, run_dir):
        made.append(_Flaky(real(cfg, run_dir), fails))
        return made[-1]

    monkeypatch.setattr(job, "episode_runner", episode_runner)
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        stats = warmup.prepare_data(cfg, tmp_path)
    assert made[0].calls[flaky_once] == 2 and made[0].calls[flaky_twice] == 3
    assert made[0].calls[broken] == 1 + warmup.RECHECKS
    assert stats["checked"] == 8 and stats["verified"] == 7 and stats["unverified"] == 1
    assert stats["rechecked"] == 1 + 2 + warmup.RECHECKS
    kept = [t.task_id for t in read_shard(tmp_path / "shards" / warmup.TRAIN_SHARD)]
    assert kept == [t.id for t in train if t.id != broken]
    assert len(read_shard(tmp_path / "shards" / warmup.HELDOUT_SHARD)) == 2
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"{broken} (ok: correct: timed out)" in said and flaky_once not in said
    assert stats["unverified_tasks"] == [f"{broken} (ok: correct: timed out)"]


def test_train_says_which_reference_solutions_were_left_out(tmp_path, monkeypatch, capsys):
    from megatron_rl.commands import train

    stats = {"checked": 8, "verified": 7, "rejected": 8, "rechecked": 2, "unverified": 1, "train_samples": 5,
             "heldout_samples": 2, "shard_dir": str(tmp_path), "unverified_tasks": ["countdown-5 (ok: timed out)"]}
    monkeypatch.setattr(warmup, "prepare_data", lambda cfg, run_dir: stats)
    train._prepare(C.load(RunConfig, "configs/demo_cpu.yaml"), tmp_path)
    out = capsys.readouterr().out
    assert "7/8 correct" in out
    assert f"1 reference solutions failed {1 + warmup.RECHECKS} checks each and are left out" in out
    assert "countdown-5 (ok: timed out)" in out
