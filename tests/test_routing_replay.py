"""MoE routing replay (R3): the engine records each token's experts, shards store them, the trainer replays them.

Engine and shard tests run in one CPU process on a tiny MoE; the product path (`megatron-rl train` with
`rl.trainer.routing_replay`) is `test_train_routing_replay_*` below.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.models.gpt import ModelConfig, MoEConfig, build_gpt
from megatron_rl.parallel import ParallelConfig
from megatron_rl.rollout import EngineConfig, RolloutEngine, SamplingParams

MOE = ModelConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=384, max_seq_length=96,
                  moe=MoEConfig(num_experts=8, topk=2, ffn_hidden_size=32, layer_pattern=[1, 0, 1]))


@pytest.fixture(scope="module")
def pgs():
    from tests.test_rollout_engine import _init_single

    return _init_single()


def _model(pgs, cfg=MOE, seed=5):
    from megatron_rl.compat.testing import init_weights_by_name

    model = build_gpt(cfg, ParallelConfig(), pgs)
    init_weights_by_name(model, seed=seed)
    return model.eval()


@torch.no_grad()
def _own_routes(model, tokens: list[int]) -> torch.Tensor:
    """[L, L_moe, k] experts of each token in a plain full forward (recorded by the same hooks)."""
    from megatron_rl.models.routing_replay import attach, clear, record, recorded

    replays = attach(model, [0, 2])
    record(replays)
    model(torch.tensor([tokens]), torch.arange(len(tokens))[None], attention_mask=None)
    out = recorded(replays)
    clear(replays)
    return out


def test_engine_records_every_tokens_experts_through_forks_prefix_hits_and_preemption(pgs):
    model = _model(pgs)
    # a small pool and step budget: prompts are prefilled in chunks, samples fork, the pool preempts
    eng = RolloutEngine(model, EngineConfig(num_blocks=14, block_size=4, max_tokens_per_step=12), pgs.tp, pgs.cp,
                        moe_layers=[0, 2])
    prompts = [[257, *range(10 + 5 * i, 10 + 5 * i + n)] for i, n in enumerate([3, 11, 6])]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=2)
    outs = eng.generate(prompts, params) + eng.generate(prompts[1:2], params)  # the last: a prefix-cache hit
    assert eng.scheduler.prefix_hit_tokens > 0 and eng.scheduler.num_preemptions > 0
    checked = 0
    for out in outs:
        for s in out.samples:
            tokens = out.prompt_token_ids + s.token_ids
            got = torch.from_numpy(s.routed_experts)  # [L-1, L_moe, k]
            assert got.shape == (len(tokens) - 1, 2, 2) and got.dtype == torch.int16
            want = _own_routes(model, tokens)[:-1]
            assert torch.equal(got.sort(-1).values, want.sort(-1).values), out.request_id
            checked += 1
    assert checked == 12


def test_engine_without_recording_reports_no_routes(pgs):
    eng = RolloutEngine(_model(pgs), EngineConfig(num_blocks=16, block_size=4), pgs.tp, pgs.cp)
    out = eng.generate([[257, 10, 11]], SamplingParams(max_new_tokens=3))[0]
    assert out.samples[0].routed_experts is None and eng.cache.routes is None


def _traj(i: int, n: int, routes):
    from megatron_rl.data.shards import Trajectory

    return Trajectory(tokens=np.arange(n, dtype=np.int32), logprobs=np.zeros(n, np.float32),
                      loss_mask=np.ones(n, np.uint8), prompt_len=1, reward=1.0, group_id=0, policy_version_first=0,
                      policy_version_last=0, env="countdown", task_id="t", episode_id=f"e{i}", routed_experts=routes)


@pytest.mark.parametrize("experts", [8, 300])  # uint8 on disk, uint16 past 254 experts
def test_shard_stores_routes_compressed_and_reads_them_back(tmp_path, experts):
    import h5py

    from megatron_rl.data.shards import ShardReader, read_arrays, write_shard

    rng = np.random.default_rng(0)
    routes = [rng.integers(0, experts, (n, 3, 2)).astype(np.int16) for n in (5, 7)]
    routes[0][-1] = -1  # the sampled last token: not recorded
    trajs = [_traj(0, 5, routes[0]), _traj(1, 4, None), _traj(2, 7, routes[1])]
    path = write_shard(tmp_path / "s.h5", trajs)
    with h5py.File(path, "r") as f:
        ds = f["routed_experts"]
        assert ds.shape == (16, 3, 2) and ds.dtype == (np.uint8 if experts < 255 else np.uint16)
        assert ds.compression == "gzip"
    cols = read_arrays(path)
    assert cols.routed_experts.dtype == np.int16 and cols.routed_experts.shape == (16, 3, 2)
    np.testing.assert_array_equal(cols.routed_experts[:5], routes[0])
    assert (cols.routed_experts[5:9] == -1).all()
    np.testing.assert_array_equal(cols.routed_experts[9:], routes[1])
    back = cols.to_trajectories()
    assert back[1].routed_experts is None
    np.testing.assert_array_equal(back[2].routed_experts, routes[1])
    np.testing.assert_array_equal(cols.select([2, 0]).routed_experts, np.concatenate([routes[1], routes[0]]))
    with ShardReader(path) as r:
        np.testing.assert_array_equal(r[2].routed_experts, routes[1])
    # a shard without routes has none (and costs nothing)
    assert read_arrays(write_shard(tmp_path / "plain.h5", [_traj(3, 4, None)])).routed_experts is None


def test_bad_routes_are_refused_naming_the_trajectory():
    from megatron_rl.data.shards import TrajectoryError

    with pytest.raises(TrajectoryError, match="'e0'.*routed_experts must be integer \\[5 tokens"):
        _traj(0, 5, np.zeros((4, 3, 2), np.int16))
