"""One environment factory (`envs.mixture.EnvFactory`) for the in-process loop, eval and the rollout workers:
a judged domain (docqa with its LLM judge) scored on dispatched workers (submitit's local executor: separate
worker processes) gets the judge's verdict in its reward, because the worker spec carries the run's mixture
(`loop.job.worker_config`) and the worker builds its environments from it as the driver does."""
from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from megatron_rl import config as C
from megatron_rl.data.shards import read_shard
from megatron_rl.dispatch import DispatchConfig, Dispatcher, GeneratorConfig, episodes_from_tasks
from megatron_rl.envs.tasks import load_domain

GOOD = '{"value": 20.0, "unit": "%", "explanation": "Revenue FY2023 1488.0 / Revenue FY2022 1240.0 - 1"}'


class _Judge(BaseHTTPRequestHandler):
    """A judge model stand-in over real HTTP (/v1/completions): every criterion scores 9 of 10."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        data = json.dumps({"model": "judge-7b-2024-06", "choices": [
            {"index": i, "text": "The response cites the items.\nScore: 9"} for i in range(len(body["prompt"]))]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data.encode())

    def log_message(self, *args):
        pass


@pytest.fixture()
def judge_url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    srv.requests = []
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", srv.requests
    srv.shutdown()
    srv.server_close()


def run_config(tmp_path: Path, judge_url: str):
    from megatron_rl.run_config import RunConfig

    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({
        "name": "r", "output_dir": str(tmp_path / "out"), "curriculum": {"enabled": False},
        "episodes": {"runner": "dispatch"},
        "envs": {"judge_base_url": judge_url, "judge_model": "judge-7b", "domains": {"docqa": {}}}}))
    return C.load(RunConfig, str(run), [])


def docqa_episodes(n: int):
    """docqa tasks whose payload carries a right answer for the scripted TEST policy to give."""
    tasks = [t for t in load_domain("docqa", split="train") if t.id == "docqa-northwind-rev-growth"] * n
    tasks = [dataclasses.replace(t, id=f"{t.id}-{i}", payload={**t.payload, "solution": GOOD})
             for i, t in enumerate(tasks)]
    return episodes_from_tasks(tasks)


@pytest.mark.slow
def test_dispatched_workers_score_a_judged_domain_with_the_runs_judge(tmp_path, judge_url):
    from megatron_rl.loop.job import worker_config

    url, requests = judge_url
    cfg = run_config(tmp_path, url)
    worker = worker_config(cfg, tmp_path / "run")
    assert worker.envs.judge_base_url == url and worker.envs.judge_cache_dir == str(tmp_path / "run" / "judge_cache")
    worker = dataclasses.replace(worker, threads=1, vocab_size=384, tokenizer="", generator=GeneratorConfig())
    eps = docqa_episodes(2)
    report = Dispatcher(DispatchConfig(executor="local", folder=str(tmp_path / "sub"), episodes_per_task=1),
                        worker, tmp_path / "shards").run(eps)
    assert not report.missing, report
    trajs = [t for p in sorted((tmp_path / "shards").rglob("*.h5")) for t in read_shard(p)]
    assert sorted(t.episode_id for t in trajs) == sorted(e.episode_id for e in eps)
    for t in trajs:  # rules 0.8 (all checks pass) + judge 0.2 x its verdict 0.9; without the judge: 1.0
        assert t.reward_components == {"rules": 1.0, "judge": pytest.approx(0.9)}, t.reward_components
        assert t.reward == pytest.approx(0.8 + 0.2 * 0.9)
        assert json.loads(t.provenance["judge"])["judge_model"] == "judge-7b"
    assert requests and all(r["model"] == "judge-7b" for r in requests)  # the workers asked the run's judge
    assert any((tmp_path / "run" / "judge_cache").rglob("*.json"))  # into the run's shared cache


def test_the_driver_and_the_workers_build_the_same_environment(tmp_path, judge_url):
    """The in-process runner (`loop.job.episode_runner`) and a worker (`dispatch.worker.env_factory`) build a
    domain through one factory: same reward spec (judge included), budget and reward weights."""
    from megatron_rl.dispatch import WorkerSpec
    from megatron_rl.dispatch.worker import env_factory
    from megatron_rl.loop.job import episode_runner, worker_config
    from megatron_rl.tokenizer import from_path

    cfg = run_config(tmp_path, judge_url[0])
    cfg.envs.domains["docqa"] = dataclasses.replace(cfg.envs.domains["docqa"], max_turns=3, max_tokens=200)
    runner = episode_runner(cfg, tmp_path / "run")
    try:
        here = runner.make_env("docqa", runner.sandbox)
    finally:
        runner.close()
    spec = WorkerSpec(shard_dir=str(tmp_path / "shards"), worker=worker_config(cfg, tmp_path / "run"))
    there = env_factory(spec, from_path("", 384), 1)("docqa")
    for env in (here, there):
        assert [(c.name, c.weight) for c in env.spec.components] == [("rules", 0.8), ("judge", 0.2)]
        assert env.judge.config.cache_dir == str(tmp_path / "run" / "judge_cache")
    assert here.budget == there.budget and here.budget.max_turns == 3 and here.budget.max_tokens == 200


def test_one_worker_runner_is_reset_for_the_next_batch(tmp_path):
    """A fleet worker keeps one EpisodeRunner for its life: `reset(spec, publisher)` points it at the next lease
    (its episodes, its shard, a new generator when the lease's differs) and clears the last lease's stop and
    failures, keeping the sandbox pool and the environments."""
    from megatron_rl.dispatch import WorkerConfig, WorkerSpec
    from megatron_rl.dispatch.publisher import ShardPublisher
    from megatron_rl.dispatch.worker import EpisodeRunner

    eps = episodes_from_tasks(load_domain("countdown", split="train")[:4])
    first = WorkerSpec(episodes=eps[:2], shard_dir=str(tmp_path / "a"),
                       worker=WorkerConfig(threads=1, generator=GeneratorConfig(wrong_fraction=1.0)))
    runner = EpisodeRunner(first, ShardPublisher(tmp_path / "a", "one", 0))
    try:
        runner.run(iter(first.episodes))
        runner.publisher.flush()
        runner.stop.set()
        runner.failed["lost"] = "error: the last lease's"
        sandbox, make_env = runner.sandbox, runner.make_env
        second = dataclasses.replace(first, episodes=eps[2:], shard_dir=str(tmp_path / "b"),
                                     worker=dataclasses.replace(first.worker, generator=GeneratorConfig()))
        publisher = ShardPublisher(tmp_path / "b", "two", 0)
        runner.reset(second, publisher)
        assert runner.failed == {} and not runner.stop.is_set() and runner.publisher is publisher
        runner.run(iter(second.episodes))
        publisher.flush()
    finally:
        runner.close()
    assert runner.sandbox is sandbox and runner.make_env is make_env
    rewards = {t.episode_id: t.reward for d in "ab" for p in (tmp_path / d).glob("*.h5") for t in read_shard(p)}
    assert rewards == {**{e.episode_id: pytest.approx(0.1) for e in eps[:2]},   # wrong on purpose: format only
                       **{e.episode_id: pytest.approx(1.1) for e in eps[2:]}}   # the new generator: right
