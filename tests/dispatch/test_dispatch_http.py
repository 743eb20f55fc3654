"""Rollout workers talking to a REAL rollout server over HTTP (aiohttp on 127.0.0.1, a tiny random-weight
policy, the real engine): token layout, the server's log-probs and policy versions in the shards, rewards
from the real sandboxed countdown environment, exactly-once through the local-executor Dispatcher, and
server failures (down, 4xx, timeouts) turning into failed episodes, never a crashed worker."""
from __future__ import annotations

import json
import math
import socket
import urllib.request

import numpy as np
import pytest
import torch

from megatron_rl.data.consume import read_folder
from megatron_rl.data.shards import STATUSES, read_shard
from megatron_rl.dispatch import (
    DispatchConfig,
    Dispatcher,
    GeneratorConfig,
    WorkerConfig,
    WorkerSpec,
    episodes_from_tasks,
)
from megatron_rl.dispatch.worker import run_episode_batch
from megatron_rl.envs.tasks import load_domain
from megatron_rl.models.gpt import ModelConfig, build_gpt
from megatron_rl.parallel import ParallelConfig
from megatron_rl.rollout import EngineConfig, RolloutEngine
from megatron_rl.rollout.server import ServerThread
from tests.rollout.test_rollout_engine import _init_single

pytestmark = pytest.mark.slow
MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=384, max_seq_length=1024)
VERSION = 5                      # the server's policy version after a weight update (the scripted default is 0)
MAX_NEW = 32
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": MAX_NEW}
TASKS = load_domain("countdown", split="train")


def start_server() -> ServerThread:
    """A real rollout server on 127.0.0.1 (free port): tiny random policy, weights updated to VERSION; its token
    (which every endpoint but /health needs) in `srv.token_file`, as the driver hands it to the workers."""
    from megatron_rl.compat.testing import init_weights_by_name

    pgs = _init_single()
    model = build_gpt(MODEL, ParallelConfig(), pgs)
    init_weights_by_name(model, seed=11)
    engine = RolloutEngine(model.eval(), EngineConfig(num_blocks=512, block_size=16), pgs.tp, pgs.cp)
    engine.update_weights(VERSION, [(n, p.detach().clone()) for n, p in model.named_parameters()])
    return ServerThread(engine).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from megatron_rl.http_auth import write_token_file

    srv = start_server()
    srv.token_file = tmp_path_factory.mktemp("token") / "rollout_token"
    write_token_file(srv.token_file, srv.token)
    _TOKENS[srv.url] = str(srv.token_file)
    yield srv
    srv.stop()


_TOKENS: dict[str, str] = {}
"""Server URL -> its token file."""


def http_worker(url: str, **gen) -> WorkerConfig:
    gen.setdefault("token_file", _TOKENS.get(url, ""))
    return WorkerConfig(threads=2, generator=GeneratorConfig(kind="http", url=url, **gen))


def dead_url() -> str:
    """A 127.0.0.1 port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def replay(url: str, prompt: list[int], seed: int) -> dict:
    """The same request again, by hand (urllib, not the worker's client): the engine's seeded sampler gives
    the same draws, so this is what the server answered the worker."""
    body = {"prompt_token_ids": prompt, "max_tokens": MAX_NEW, "temperature": 1.0, "top_p": 0.95, "seed": seed,
            "stop_token_ids": [258], "logprobs": True, "return_token_ids": True}
    token = open(_TOKENS[url]).read()
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        (choice,) = json.loads(r.read())["choices"]
    return choice


def consume_all(shard_dir) -> list:
    """The trainer-side reader's rows (no shard quarantined, no duplicate)."""
    got = read_folder(shard_dir)
    assert not got.quarantined and got.duplicates == 0
    return got.trajectories


def check_trajectory(t, ep, url: str) -> None:
    p = t.prompt_len
    assert t.tokens[0] == 257 and p > 10 and t.status in STATUSES and t.status != "error"
    assert not t.loss_mask[:p].any() and t.loss_mask[p:].all() and np.all(t.logprobs[:p] == 0)
    n = len(t) - p
    assert 1 <= n <= MAX_NEW and (n == MAX_NEW or t.tokens[-1] == 258)          # budget, or stopped at EOS
    assert t.policy_version_first == t.policy_version_last == VERSION
    assert t.token_versions is not None and np.all(t.token_versions == VERSION)
    choice = replay(url, [int(x) for x in t.tokens[:p]], ep.seed)
    assert choice["token_ids"] == [int(x) for x in t.tokens[p:]]
    assert choice["policy_versions"] == [VERSION] * n
    torch.testing.assert_close(t.logprobs[p:].tolist(), choice["logprobs"]["token_logprobs"], atol=1e-4, rtol=0)
    # Rewards from the real countdown env (sandboxed evaluation): a random policy scores ~0, so check that the
    # components are there and sane, not their value.
    assert t.reward_components and all(math.isfinite(v) and 0 <= v <= 1 for v in t.reward_components.values())
    assert math.isfinite(t.reward) and 0 <= t.reward <= 1.1 and "policy" not in t.provenance


def test_http_worker_publishes_the_servers_tokens_logprobs_and_versions(server, tmp_path):
    eps = episodes_from_tasks(TASKS[:6], sampling=SAMPLING, seed=3)
    spec = WorkerSpec(episodes=eps, shard_dir=str(tmp_path), worker=http_worker(server.url))
    res = run_episode_batch(spec)
    assert sorted(res.finished) == sorted(e.episode_id for e in eps) and not res.failed
    trajs = {t.episode_id: t for name in res.shards for t in read_shard(tmp_path / name)}
    for ep in eps:
        check_trajectory(trajs[ep.episode_id], ep, server.url)
    assert len({tuple(t.tokens[t.prompt_len:]) for t in trajs.values()}) > 1          # sampled, not constant
    rows = consume_all(tmp_path)
    assert sorted(t.episode_id for t in rows) == sorted(trajs) and {t.policy_version_first for t in rows} == {VERSION}


def test_local_executor_dispatch_through_the_server_exactly_once(server, tmp_path):
    eps = episodes_from_tasks(TASKS[:8], sampling=SAMPLING, seed=4, prefix="http")
    d = Dispatcher(DispatchConfig(executor="local", folder=str(tmp_path / "sub"), episodes_per_task=4),
                   http_worker(server.url), tmp_path / "shards")
    report = d.run(eps)
    assert report.ok and report.duplicates == 0 and not report.failures and not report.episode_failures
    assert report.finished == sorted(e.episode_id for e in eps) and len(report.shards) == 2
    rows = consume_all(tmp_path / "shards")
    assert sorted(t.episode_id for t in rows) == report.finished
    by_id = {t.episode_id: t for name in report.shards for t in read_shard(tmp_path / "shards" / name)}
    for ep in eps[:3]:
        check_trajectory(by_id[ep.episode_id], ep, server.url)
    assert all(set(t.token_versions.tolist()) == {VERSION} for t in rows)


def test_server_down_fails_episodes_with_a_reason_and_the_dispatcher_retries(tmp_path):
    url = dead_url()
    eps = episodes_from_tasks(TASKS[:3], sampling=SAMPLING, prefix="down")
    worker = http_worker(url, retries=1, backoff_s=0.05, timeout_s=5)
    res = run_episode_batch(WorkerSpec(episodes=eps, shard_dir=str(tmp_path / "a"), worker=worker))
    assert res.finished == [] and res.shards == []                                 # the worker survived
    assert sorted(res.failed) == sorted(e.episode_id for e in eps)
    for reason in res.failed.values():
        assert url in reason and "failed after 2 attempts" in reason and "refused" in reason.lower()

    d = Dispatcher(DispatchConfig(executor="local", folder=str(tmp_path / "sub"), max_retries=1), worker,
                   tmp_path / "shards")
    report = d.run(eps)
    assert report.missing == sorted(e.episode_id for e in eps) and not report.finished
    assert not report.failures                                                      # no task crashed
    assert [r["episodes"] for r in report.rounds] == [3, 3]                         # re-dispatched once
    assert [r["episodes_failed"] for r in report.rounds] == [3, 3]
    assert all(v.startswith("round 1: error: ") and url in v for v in report.episode_failures.values())


def test_rejected_and_timed_out_requests_fail_the_episode_not_the_worker(server, tmp_path):
    tasks = TASKS[:3]
    eps = [*episodes_from_tasks(tasks[:1], sampling={"max_new_tokens": 2000}, prefix="long"),    # > context
           *episodes_from_tasks(tasks[1:2], sampling={"temperature": -1.0}, prefix="temp"),      # bad param
           *episodes_from_tasks(tasks[2:3], sampling={"n": 4}, prefix="n")]                      # not allowed
    res = run_episode_batch(WorkerSpec(episodes=eps, shard_dir=str(tmp_path / "a"), worker=http_worker(server.url)))
    assert sorted(res.finished) == sorted(e.episode_id for e in eps) and not res.failed
    trajs = {t.episode_id: t for name in res.shards for t in read_shard(tmp_path / "a" / name)}
    reasons = {eid.split("-")[0]: t.provenance["error"] for eid, t in trajs.items()}
    assert all(t.status == "error" and t.reward == 0 and not t.loss_mask.any() and len(t) == t.prompt_len
               for t in trajs.values())
    assert "400" in reasons["long"] and "exceeds" in reasons["long"]
    assert "400" in reasons["temp"] and "temperature" in reasons["temp"]
    assert "unknown keys ['n']" in reasons["n"]

    slow = episodes_from_tasks(tasks[:1], sampling={"max_new_tokens": 600, "temperature": 1.0}, prefix="slow")
    worker = http_worker(server.url, timeout_s=0.05, retries=1, backoff_s=0.01)
    res = run_episode_batch(WorkerSpec(episodes=slow, shard_dir=str(tmp_path / "b"), worker=worker))
    assert res.finished == [] and list(res.failed) == [slow[0].episode_id]
    assert res.failed[slow[0].episode_id].startswith("timeout: ") and "timed out" in res.failed[slow[0].episode_id]


def test_a_worker_without_the_token_is_refused_and_the_episode_fails_with_the_reason(server, tmp_path):
    """Generation needs the job's token: a worker given none (or a wrong one) gets 401, never tokens."""
    eps = episodes_from_tasks(TASKS[:1], sampling=SAMPLING, prefix="anon")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    for token_file in ("", str(wrong)):
        res = run_episode_batch(WorkerSpec(episodes=eps, shard_dir=str(tmp_path / f"s{len(token_file)}"),
                                           worker=http_worker(server.url, token_file=token_file)))
        (t,) = [t for name in res.shards for t in read_shard(tmp_path / f"s{len(token_file)}" / name)]
        assert t.status == "error" and "401" in t.provenance["error"] and not t.loss_mask.any()
    missing = http_worker(server.url, token_file=str(tmp_path / "absent"))
    with pytest.raises(Exception, match="token_file .*absent.*cannot read"):
        run_episode_batch(WorkerSpec(episodes=eps, shard_dir=str(tmp_path / "m"), worker=missing))
