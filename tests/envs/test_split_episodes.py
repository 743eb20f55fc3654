"""A black-box agent episode split where the agent edited its history (`envs.agents`) is published as several
rows, each an exact segment (`<episode>~seg<j>`, then `<episode>`), and trained as ONE sample: one reward and
one advantage in its group, one sequence under seq-mean aggregation; the rows travel together through the
loop's shards and the dispatched workers' shards."""
from __future__ import annotations

import numpy as np
import pytest

from megatron_rl.data.shards import Trajectory, TrajectoryColumns, episode_of, segment_id, segment_rows
from megatron_rl.rl.config import AdvantageConfig, LossConfig
from megatron_rl.rl.losses import normaliser
from megatron_rl.trainer.packing import PackingConfig, check_samples, pack
from megatron_rl.trainer.rl_step import token_advantages

VOCAB = 64


def _row(eid: str, length: int, prompt: int, reward: float, seed: int) -> Trajectory:
    gen = np.random.default_rng(seed)
    mask = (np.arange(length) >= prompt).astype(np.uint8)
    return Trajectory(tokens=gen.integers(0, VOCAB, length).astype(np.int32),
                      logprobs=np.where(mask, -0.5, 0).astype(np.float32), loss_mask=mask, prompt_len=prompt,
                      reward=reward, group_id=0, policy_version_first=0, policy_version_last=0, env="harbor",
                      task_id="t", episode_id=eid)


def _segment(length: int, prompt: int, seed: int) -> dict:
    t = _row("x", length, prompt, 0.0, seed)
    return {"tokens": t.tokens.tolist(), "logprobs": t.logprobs.tolist(), "loss_mask": t.loss_mask.tolist(),
            "versions": [3] * length, "prompt_len": prompt}


def _batch(split: bool) -> tuple[TrajectoryColumns, list[int]]:
    """A group of three episodes (rewards 1, 0, 0.5); with `split`, the first is two segments and its last row."""
    a = _row("a", 9, 3, 1.0, 0)
    rows = [*segment_rows(a, [_segment(7, 2, 1)] if split else []), a, _row("b", 8, 3, 0.0, 2),
            _row("c", 6, 2, 0.5, 3)]
    return TrajectoryColumns.from_trajectories(rows), [len(r.tokens) for r in rows]


def test_segment_ids_name_their_episode():
    assert episode_of(segment_id("s3-g7-s1", 0)) == "s3-g7-s1" == episode_of("s3-g7-s1")
    rows = segment_rows(_row("e", 5, 2, 0.25, 0), [_segment(4, 1, 1), _segment(6, 2, 2)])
    assert [r.episode_id for r in rows] == ["e~seg0", "e~seg1"]
    assert all(r.reward == 0.25 and r.group_id == 0 and r.policy_version_first == 3 for r in rows)


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_a_split_episode_is_one_sample_of_its_group(name):
    """Its rows share its advantage, and the group's statistics count it once: the other episodes' advantages are
    those of the unsplit batch (counting its two rows as two samples changes them)."""
    cfg = AdvantageConfig(name=name)
    (split, n_split), (whole, n_whole) = _batch(True), _batch(False)
    adv_split, adv_whole = token_advantages(split, cfg), token_advantages(whole, cfg)  # [T]
    starts_s, starts_w = np.cumsum([0, *n_split]), np.cumsum([0, *n_whole])

    def sample(adv, starts, mask, i):  # the advantage on sample i's loss tokens (one value)
        a = adv[starts[i]:starts[i + 1]][mask[starts[i]:starts[i + 1]].astype(bool)]
        assert np.allclose(a, a[0])
        return float(a[0])

    seg, a_s = sample(adv_split, starts_s, split.loss_mask, 0), sample(adv_split, starts_s, split.loss_mask, 1)
    assert seg == a_s == pytest.approx(sample(adv_whole, starts_w, whole.loss_mask, 0)) and a_s > 0
    for i in (1, 2):  # b and c
        assert sample(adv_split, starts_s, split.loss_mask, i + 1) == pytest.approx(
            sample(adv_whole, starts_w, whole.loss_mask, i))


def test_seq_mean_counts_a_split_episode_once():
    """seq-mean aggregation: the normaliser counts episodes (3), not rows (4), and each token of the split episode
    weighs 1 / (its loss tokens over both segments)."""
    cols, _ = _batch(True)
    pcfg = PackingConfig(max_tokens=16)
    keep, stats = check_samples(cols, VOCAB, pcfg)
    mbs, _ = pack(cols, keep, pcfg, 0, 1, {"advantages": token_advantages(cols, AdvantageConfig())}, stats)
    cfg = LossConfig(name="grpo", aggregation="seq-mean-token-mean")
    z = sum(float(normaliser(cfg, mb["loss_mask"].view(-1), mb["sample_index"].view(-1),
                             mb["sample_num_tokens"].view(-1))) for mb in mbs)
    assert z == pytest.approx(3.0)
    s, e = cols.offsets[:3], cols.offsets[1:3]
    both = sum(int(cols.loss_mask[a + 1:b].sum()) for a, b in zip(s, e))  # label-side loss tokens of rows 0 and 1
    assert both == 5 + 6
    for mb in mbs:
        idx, n = mb["sample_index"].view(-1), mb["sample_num_tokens"].view(-1)
        for i in (0, 1):
            if (idx == i).any():
                assert float(n[idx == i][0]) == both


def test_the_rows_of_a_split_episode_travel_through_the_dispatched_shards(tmp_path, hf_tok):
    """A worker's rows (`episode_rows`: segments, then the episode) read back by the loop (`read_episodes` ->
    Group) give the same rows again, in order, with the episode's reward on each."""
    from envs.base import Task
    from megatron_rl.data.shards import read_shard, write_shard
    from megatron_rl.loop.config import EpisodesConfig, RLLoopConfig
    from megatron_rl.loop.dispatched import DispatchRollouts, episode_id
    from megatron_rl.loop.rollout import Group

    prompt = [1, 2, 3]
    task = Task(id="t", domain="harbor", prompt="p", payload={})
    mains = [_row(episode_id(0, i), 9, 3, float(i), 10 + i) for i in range(2)]
    for m in mains:
        m.tokens[:3] = prompt
    segs = [_segment(6 + j, 2, 20 + j) for j in range(11)]  # 11: ~seg10 sorts after ~seg9
    rows = [*segment_rows(mains[0], segs), mains[0], mains[1]]
    write_shard(tmp_path / "w.h5", rows)
    rollouts = DispatchRollouts(None, None, hf_tok, lambda t: prompt, RLLoopConfig(group_size=2), 1,
                                EpisodesConfig(), None, tmp_path, None)
    out = rollouts._dispatch([Group(0, 0, task, prompt)], tmp_path, url="http://unused")
    g = Group(0, 0, task, prompt)
    rollouts._fill([g], out["episodes"])
    assert len(g.segments[0]) == 11 and g.segments[1] == []
    again = rollouts.trajectories([g], "s0")
    assert [t.episode_id for t in again] == [*(f"s0-g0-s0~seg{j}" for j in range(11)), "s0-g0-s0", "s0-g0-s1"]
    for a, b in zip(again, rows):
        assert a.tokens.tolist() == b.tokens.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
        assert a.reward == b.reward
    write_shard(tmp_path / "loop.h5", again)
    cols = TrajectoryColumns.from_trajectories(read_shard(tmp_path / "loop.h5"))
    assert cols.episode_index().tolist() == [0] * 12 + [1]
