"""MoE routing replay over HTTP: the rollout server returns each token's experts (compact, only when asked),
a rollout worker stores them in its shard, the loop reads them back for the trainer.

The product path (`megatron-rl train` with episodes.runner=dispatch | fleet) is
tests/dispatch/test_routing_replay_dispatch_multiproc.py; here one CPU process with a real server on 127.0.0.1.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from envs.tasks import load_domain
from megatron_rl.data.routes import decode_routes, encode_routes
from megatron_rl.dispatch import GeneratorConfig, WorkerConfig, WorkerSpec, episodes_from_tasks
from megatron_rl.dispatch.generators import GenerationError, HttpGenerator
from megatron_rl.dispatch.worker import run_episode_batch
from megatron_rl.rollout import EngineConfig, RolloutEngine
from megatron_rl.rollout.server import ServerThread
from megatron_rl.tokenizer import ByteTokenizer
from tests.rollout.test_routing_replay import MOE, _model, _own_routes

SAMPLING = {"temperature": 1.0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def pgs():
    from tests.rollout.test_rollout_engine import _init_single

    return _init_single()


@pytest.fixture(scope="module")
def served(pgs):
    """(model, a server whose engine records routes, a server whose engine does not) on the same weights; the
    job's token in the environment, where the servers and the workers' clients read it."""
    import os

    from megatron_rl.rollout.client import TOKEN_ENV

    before = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = "routing-replay-test-token"
    model = _model(pgs, dataclasses.replace(MOE, max_seq_length=512))  # room for countdown's prompts
    cfg = EngineConfig(num_blocks=128, block_size=4)
    srv = [ServerThread(RolloutEngine(model, cfg, pgs.tp, pgs.cp, moe_layers=moe)).start() for moe in ([0, 2], None)]
    yield model, *srv
    for s in srv:
        s.stop()
    if before is None:
        del os.environ[TOKEN_ENV]
    else:
        os.environ[TOKEN_ENV] = before


def test_routes_wire_format_round_trips_and_rejects_malformed():
    rng = np.random.default_rng(0)
    small = rng.integers(-1, 8, (7, 3, 2)).astype(np.int16)
    wire = encode_routes(small)
    assert wire["dtype"] == "uint8" and wire["shape"] == [7, 3, 2] and len(wire["data"]) == 4 * 42 // 3  # base64
    np.testing.assert_array_equal(decode_routes(wire), small)
    big = np.array([[[300, -1]], [[255, 0]]], np.int16)  # an id >= 255: uint16 (65535 = not recorded)
    assert encode_routes(big)["dtype"] == "uint16"
    np.testing.assert_array_equal(decode_routes(encode_routes(big)), big)
    for bad in ({"dtype": "int64", "shape": [1, 1, 1], "data": ""}, {**wire, "shape": [7, 3, 3]},
                {**wire, "data": "not base64!"}, {"shape": [7, 3, 2]}):
        with pytest.raises(ValueError, match="malformed routed_experts"):
            decode_routes(bad)


@pytest.mark.slow
def test_a_worker_runs_episodes_and_stores_routes_without_importing_torch(repo_root, tmp_path):
    """A rollout worker's episode path (and its route decoding) runs with numpy only: importing torch and
    Megatron-Core there cost seconds per task start, enough to turn every task of a dispatch round into a
    straggler."""
    code = f"""
import sys, numpy as np
from envs.tasks import load_domain
from megatron_rl.data.routes import context_routes, decode_routes, encode_routes
from megatron_rl.dispatch import GeneratorConfig, WorkerConfig, WorkerSpec, episodes_from_tasks
from megatron_rl.dispatch.worker import run_episode_batch
eps = episodes_from_tasks(load_domain("countdown", split="train")[:3])
worker = WorkerConfig(threads=1, generator=GeneratorConfig(wrong_fraction=0.9))
res = run_episode_batch(WorkerSpec(episodes=eps, shard_dir={str(tmp_path)!r}, worker=worker))
assert len(res.finished) == 3, res
r = decode_routes(encode_routes(np.zeros((3, 2, 1), np.int16)))
assert context_routes([1, 2, 3, 4], r, [1, 2, 3]).shape == (3, 2, 1)
print(sorted(m for m in ("torch", "megatron") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_server_returns_the_experts_of_every_token_it_ran_only_when_asked(served):
    model, recording, plain = served
    tok = ByteTokenizer(384)
    gen = HttpGenerator(GeneratorConfig(kind="http", url=recording.url, routed_experts=True), tok)
    prompt = [257, *range(20, 31)]
    ids, lps, versions, (seen, routes) = gen.generate(prompt, {**SAMPLING, "seed": 3})
    assert seen == prompt + ids and routes.dtype == np.int16 and routes.shape == (len(seen) - 1, 2, 2)
    want = _own_routes(model, seen)[:-1]  # a plain full forward of the same tokens: the same experts, token for token
    assert torch.equal(torch.from_numpy(routes).sort(-1).values, want.sort(-1).values)
    # not asked: no routes in the answer (and the generator returns the 3-tuple it always did)
    assert len(HttpGenerator(GeneratorConfig(kind="http", url=recording.url), tok).generate(prompt, SAMPLING)) == 3
    # asked of an engine that does not record them: refused with the reason, not silently empty
    with pytest.raises(GenerationError, match="does not record MoE routes") as e:
        HttpGenerator(GeneratorConfig(kind="http", url=plain.url, routed_experts=True), tok).generate(prompt, SAMPLING)
    assert not e.value.retryable


def test_http_worker_stores_the_servers_routes_and_the_loop_reads_them_back(served, tmp_path):
    from megatron_rl.data.shards import read_arrays, read_shard
    from megatron_rl.loop.dispatched import read_episodes

    model, recording, _ = served
    eps = episodes_from_tasks(load_domain("countdown", split="train")[:3], sampling=SAMPLING, seed=5)
    worker = WorkerConfig(threads=2, generator=GeneratorConfig(kind="http", url=recording.url, routed_experts=True))
    res = run_episode_batch(WorkerSpec(episodes=eps, shard_dir=str(tmp_path), worker=worker))
    assert sorted(res.finished) == sorted(e.episode_id for e in eps) and not res.failed
    (name,) = res.shards
    trajs = read_shard(tmp_path / name)
    for t in trajs:
        assert t.status != "error", t.provenance
        r = t.routed_experts  # [L, 2 MoE layers, top-2]; the last token is sampled, never run
        assert r.shape == (len(t.tokens), 2, 2) and (r[-1] == -1).all() and (r[:-1] >= 0).all()
        want = _own_routes(model, t.tokens.tolist())[:-1]
        assert torch.equal(torch.from_numpy(r[:-1]).sort(-1).values, want.sort(-1).values), t.episode_id
    assert read_arrays(tmp_path / name).routed_experts.shape == (sum(len(t.tokens) for t in trajs), 2, 2)
    back = read_episodes(tmp_path, {e.episode_id for e in eps})
    for t in trajs:
        np.testing.assert_array_equal(back[t.episode_id]["routes"], t.routed_experts)


def test_multi_turn_episode_keeps_the_latest_requests_routes_when_they_cover_it(tmp_path):
    """The worker's latest turn ran the whole context (prompt, earlier turns, observations): its routes are the
    row's; a latest request that saw another context (here: a compressed one) stores none (own routing)."""
    from envs.base import Budget, make_env
    from envs.sandbox import SandboxConfig
    from megatron_rl.dispatch import EpisodeSpec
    from megatron_rl.dispatch.episode_rows import run_episode

    task = next(t for t in load_domain("tool_use", split="train") if t.id == "tool-calc-mod-0")
    tok = ByteTokenizer(384)

    class Recording:  # two model turns (a tool call, the answer), routes [len(seen) - 1, 1, 2] made of positions
        def __init__(self, drop_first: bool):
            self.drop_first, self.turns = drop_first, iter(
                ['<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
                 f"<answer>{task.payload['answer']}</answer>"])

        def generate(self, prompt_ids, sampling, episode=None, turn=0):
            ids = tok.encode(next(self.turns)) + [tok.eos_id]
            seen = [*prompt_ids[self.drop_first:], *ids]  # drop_first: the server compressed the context
            routes = np.stack([np.arange(len(seen) - 1) % 7, np.arange(len(seen) - 1) % 5 + turn], -1)[:, None]
            return ids, [-0.5] * len(ids), 0, (seen, routes.astype(np.int16))

    sandbox = SandboxConfig(backend="subprocess").build()
    try:
        env = make_env("tool_use", sandbox=sandbox, budget=Budget(max_turns=4))
        ep = EpisodeSpec(episode_id="g0-s0", env="tool_use", task=task.to_dict())
        exact, compressed = (run_episode(ep, env, Recording(drop), tok) for drop in (False, True))
    finally:
        sandbox.close()
    assert exact.timings["turns"] == 2 and exact.loss_mask.sum() < len(exact.tokens) - exact.prompt_len  # obs
    n = len(exact.tokens) - 1
    want = np.stack([np.arange(n) % 7, np.arange(n) % 5 + 1], -1)[:, None]  # the second turn's routes
    np.testing.assert_array_equal(exact.routed_experts[:-1], want)
    assert (exact.routed_experts[-1] == -1).all()
    assert compressed.routed_experts is None
