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
    from tests.rollout.test_rollout_engine import _init_single

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


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------ trainer (one process)
TRAIN_MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                        max_seq_length=64, moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=32))


def _policy(ctx=None):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.convert.runtime import start
    from megatron_rl.trainer.policy import OptimConfig, Policy

    ctx = ctx or start()
    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3)
    return Policy(TRAIN_MOE, OptimConfig(lr=1e-3, distributed_optimizer=False), ctx, total_steps=2,
                  init=lambda m: init_weights_by_name(m, 3))


def _trainer(policy, mode: str, old: str = "behaviour"):
    from kernels.logprob import LogprobKernelConfig
    from megatron_rl.rl.config import LossConfig
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer

    return RLTrainer(policy, RLConfig(loss=LossConfig(name="grpo"), packing=PackingConfig(max_tokens=48),
                                      old_logprobs=old, logprob_kernel=LogprobKernelConfig(impl="torch"),
                                      routing_replay=mode))


def _rollouts(policy, engine_ctx=None, init=None):
    """The recording engine's samples of the policy as columns with routes (as loop.rollout builds them);
    `engine_ctx`: the engine's (ParallelConfig, pgs) when not the trainer's, `init`: its weights then (else the
    policy's)."""
    from megatron_rl.data.shards import Trajectory, TrajectoryColumns
    from megatron_rl.loop.rollout import Group, sample_routes

    par, pgs = engine_ctx or (policy.ctx.parallel, policy.ctx.pgs)
    engine = RolloutEngine.build(policy.cfg, EngineConfig(num_blocks=64, block_size=4), par, pgs, record_routes=True)
    if init is not None:
        init(engine.model)
    else:
        engine.update_weights(0, policy.named_parameters())
    gen = np.random.default_rng(1)
    prompts = [gen.integers(1, 64, int(gen.integers(3, 7))).tolist() for _ in range(3)]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=8, seed=i, n=3) for i in range(3)])
    trajs = []
    for gid, out in enumerate(outs):
        g = Group(gid, 0, None, out.prompt_token_ids)
        for i, s in enumerate(out.samples):
            g.routes[i] = (out.prompt_token_ids + s.token_ids, s.routed_experts)
            toks = np.asarray(out.prompt_token_ids + s.token_ids, np.int32)
            n = len(out.prompt_token_ids)
            trajs.append(Trajectory(
                tokens=toks, logprobs=np.concatenate([np.zeros(n), s.logprobs]).astype(np.float32),
                loss_mask=(np.arange(len(toks)) >= n).astype(np.uint8), prompt_len=n, reward=float(i % 2),
                group_id=gid, policy_version_first=0, policy_version_last=0, env="synthetic", task_id=str(gid),
                episode_id=f"e{gid}-{i}", routed_experts=sample_routes(g, i, toks)))
    return TrajectoryColumns.from_trajectories(trajs)


def _pass(trainer, cols) -> tuple[float, float, float]:
    """(loss, differing, compared (token, layer) pairs) of one forward+backward without an update."""
    trainer._routing_counts()
    loss, _ = trainer.compute_gradients(cols)
    differ, compared = trainer._routing_counts().tolist()
    return loss, differ, compared


def _corrupted_passes(policy, cols) -> dict:
    """Every 4th recorded token's first MoE layer moved to another expert: the counts of a compared pass (own
    routing) and the loss and counts of a replayed one (the multi-process scripts' second half)."""
    bad = cols.routed_experts.copy()
    rows = np.flatnonzero((bad[:, 0] >= 0).all(-1))[::4]
    bad[rows, 0] = (bad[rows, 0] + 1) % 4
    cols.routed_experts = bad
    _, differ_cmp, _ = _pass(_trainer(policy, "off"), cols)
    loss_bad, differ_bad, _ = _pass(_trainer(policy, "everywhere"), cols)
    return {"corrupted": len(rows), "differ_cmp": differ_cmp, "differ_bad": differ_bad, "loss_bad": loss_bad}


@pytest.mark.slow
def test_trainer_routes_like_the_engine_token_for_token_and_replays_what_it_is_given():
    policy = _policy()
    cols = _rollouts(policy)
    inputs = int((cols.lengths - 1).sum())  # tokens the trainer runs; 2 MoE layers each
    assert (cols.routed_experts >= 0).all(-1).sum() == 2 * inputs  # every input token recorded, last ones not
    loss_own, differ, compared = _pass(_trainer(policy, "off"), cols)
    assert compared == 2 * inputs and differ == 0  # the trainer's own routing IS the engine's, token for token
    loss_replay, differ, compared = _pass(_trainer(policy, "everywhere"), cols)
    assert (differ, compared) == (0, 2 * inputs) and loss_replay == loss_own  # replaying its own choice: no-op

    # the engine "chose" other experts for a quarter of the tokens in MoE layer 0
    bad = cols.routed_experts.copy()
    rows = np.flatnonzero((bad[:, 0] >= 0).all(-1))[::4]
    bad[rows, 0] = (bad[rows, 0] + 1) % 4  # a shifted expert set always differs
    cols.routed_experts = bad
    loss_cmp, differ, _ = _pass(_trainer(policy, "off"), cols)
    assert differ == len(rows) and loss_cmp == loss_own  # counted, not replayed
    loss_bad, differ, _ = _pass(_trainer(policy, "everywhere"), cols)
    # replayed: the loss sees those experts (and layer 1, fed by them, may now disagree with the engine too)
    assert differ >= len(rows) and abs(loss_bad - loss_own) > 1e-6

    # logprobs: the forward-only log-prob pass replays (recomputed old log-probs change), the training one not
    old = {}
    for mode in ("off", "logprobs"):
        trainer = _trainer(policy, mode, old="recompute")
        mbs, _ = trainer.prepare(cols)
        trainer._set_old_and_ref(mbs)
        old[mode] = torch.cat([mb["old_logprobs"].reshape(-1) for mb in mbs])
    assert (old["off"] - old["logprobs"]).abs().max() > 1e-4
    assert _pass(_trainer(policy, "logprobs"), cols)[0] == loss_cmp


def test_routing_replay_config_is_checked_by_name():
    from megatron_rl.config import ConfigError, from_dict
    from megatron_rl.run_config import RunConfig
    from megatron_rl.trainer.rl_step import RLConfig

    with pytest.raises(ConfigError, match="routing_replay='sometimes' is not one of off, logprobs, everywhere"):
        RLConfig(routing_replay="sometimes").validate()
    assert from_dict(RLConfig, {"routing_replay": False}).routing_replay == "off"  # YAML 1.1 reads `off` as false
    base = {"curriculum": {"enabled": False}, "train": {"steps": 0}, "data": {"domain": "countdown"}}
    with pytest.raises(ConfigError, match="the model is dense"):
        from_dict(RunConfig, {**base, "rl": {"trainer": {"routing_replay": "everywhere"}}}).validate()
    moe = {"moe": {"num_experts": 4, "topk": 2}}
    for runner in ("dispatch", "fleet"):  # the workers get the experts over HTTP (test_routing_replay_http*)
        from_dict(RunConfig, {**base, "model": moe, "episodes": {"runner": runner},
                              "rl": {"trainer": {"routing_replay": "everywhere"}}}).validate()
    agent = from_dict(RunConfig, {**base, "model": moe, "rl": {"trainer": {"routing_replay": "everywhere"}}})
    (domain,) = agent.envs.domains.values()
    domain.agent = "shell"  # (from_dict would first ask the shell agent for a chat-template tokenizer)
    with pytest.raises(ConfigError, match=r"agent episodes \(envs.domains \['countdown'\] have an agent\): the"):
        agent._check_routing_replay()
    for par in ({"pp": 2}, {"cp": 2}):  # the engine records every layer whatever the trainer's split (*_multiproc)
        from_dict(RunConfig, {**base, "model": {**moe, "num_layers": 2}, "launch": {"nproc_per_node": 2},
                              "parallel": par, "rl": {"trainer": {"routing_replay": "everywhere"}}}).validate()
    with pytest.raises(ConfigError, match="routing_replay=logprobs replays the forward-only log-prob passes"):
        from_dict(RunConfig, {**base, "model": moe, "rl": {"trainer": {"routing_replay": "logprobs"}}}).validate()
    from_dict(RunConfig, {**base, "model": moe, "rl": {"trainer": {"routing_replay": "logprobs",
                                                                   "old_logprobs": "recompute"}}}).validate()
