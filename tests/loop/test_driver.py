"""Pieces of the RL loop that run without ranks: the curriculum, group filtering, trajectories, the config."""
from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.envs.countdown.curriculum import CurriculumConfig, generate
from megatron_rl.loop.config import RLLoopConfig
from megatron_rl.loop.rollout import Group, seed_of, trajectory
from megatron_rl.rollout import SampleOutput


def test_curriculum_is_deterministic_disjoint_and_solvable():
    cfg = CurriculumConfig()
    held, train = generate(32, cfg, 7, "heldout"), generate(64, cfg, 7, "train")
    assert [t.id for t in held] == [t.id for t in generate(32, cfg, 7, "heldout")]
    key = {(tuple(sorted(t.payload["numbers"])), t.payload["target"]) for t in held}
    assert not key & {(tuple(sorted(t.payload["numbers"])), t.payload["target"]) for t in train}
    for t in held + train:
        assert 2 <= len(t.payload["numbers"]) <= 3 and max(t.payload["numbers"]) <= 9
        assert eval(t.payload["solution"]) == t.payload["target"]  # trusted generator output, not model output


@pytest.mark.slow
def test_curriculum_too_many_tasks_is_an_error():
    with pytest.raises(ValueError, match="distinct rl tasks exist"):
        generate(5000, CurriculumConfig(max_value=3, max_numbers=2), 0, "rl")


def _group(rewards):
    samples = [SampleOutput(i, [65, 258], [-0.5, -0.1], [3, 4], "stop") for i in range(len(rewards))]
    return Group(5, 2, type("T", (), {"id": "t", "domain": "countdown"})(), [257, 49], samples, [], rewards)


def test_group_informative_only_with_differing_valid_rewards():
    assert _group([(1.0, {}, "ok"), (0.0, {}, "ok")]).informative()
    assert not _group([(1.0, {}, "ok"), (1.0, {}, "ok")]).informative()
    assert not _group([(1.0, {}, "ok"), (0.0, {}, "sandbox_error")]).informative()


def test_trajectory_carries_behaviour_logprobs_and_token_versions():
    t = trajectory(_group([(1.1, {"correct": 1.0}, "ok")]), 0, "e")
    assert t.tokens.tolist() == [257, 49, 65, 258] and t.loss_mask.tolist() == [0, 0, 1, 1]
    assert t.logprobs.tolist() == pytest.approx([0, 0, -0.5, -0.1])
    assert t.token_versions.tolist() == [3, 3, 3, 4] and (t.policy_version_first, t.policy_version_last) == (3, 4)


def test_seeds_differ_per_group():
    assert len({seed_of(1, g) for g in range(1000)}) == 1000


def test_loop_config_validation():
    with pytest.raises(ConfigError, match="dynamic_sampling needs rl.group_size >= 2"):
        RLLoopConfig(group_size=1).validate()
    assert RLLoopConfig(max_staleness=2).correction() == "tis" and RLLoopConfig().correction() == "none"


def test_trainer_fields_the_loop_sets_are_refused_when_they_would_be_overwritten(repo_root):
    """rl.trainer.temperature / valid_vocab are the loop's to set (from rl.temperature and the tokenizer): another
    value there is refused naming the setting to use, not overwritten silently; the loop's value passes on."""
    from megatron_rl import load_config
    from megatron_rl.loop.job import trainer_config

    demo = str(repo_root / "configs" / "demo_cpu.yaml")
    with pytest.raises(ConfigError, match=r"rl.trainer.temperature=0.7 is set by the loop from rl.temperature"):
        load_config(demo, ["rl.trainer.temperature=0.7"])
    with pytest.raises(ConfigError, match=r"rl.trainer.valid_vocab=100 is set by the loop"):
        load_config(demo, ["rl.trainer.valid_vocab=100"])
    cfg = load_config(demo, ["rl.temperature=0.7", "rl.trainer.temperature=0.7"])
    assert trainer_config(cfg, 259).temperature == 0.7
    assert trainer_config(load_config(demo, ["rl.temperature=0.5"]), 259).temperature == 0.5
