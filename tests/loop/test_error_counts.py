"""Errors never vanish: every dropped sample, unreadable shard and broken plugin is logged with its reason and
counted (the step metrics carry `dropped_samples[/status]`, `unreadable_shards`, `plugins_failed`)."""
from __future__ import annotations

import gc
import logging

import pytest

from megatron_rl.envs.base import Task
from megatron_rl.envs.sandbox import SandboxConfig

GOOD = Task(id="ok-1", domain="countdown", prompt="Use 1 2 to make 3.", payload={"numbers": [1, 2], "target": 3})
NO_PAYLOAD = Task(id="broken-1", domain="countdown", prompt="x", payload={})  # its reward function raises
NO_ENV = Task(id="lost-1", domain="no_such_env", prompt="x", payload={})  # the environment cannot be built


@pytest.fixture()
def runner():
    from megatron_rl.loop.episodes import ThreadEpisodeRunner

    r = ThreadEpisodeRunner(SandboxConfig(backend="subprocess"), 2)  # trusted answers only (written here)
    yield r
    r.close()


def test_the_in_process_runner_logs_each_dropped_sample_with_its_reason(runner, caplog):
    caplog.set_level(logging.WARNING, logger="megatron_rl.loop.episodes")
    results = [runner.submit(t, "<answer>1+2</answer>").result() for t in (GOOD, NO_PAYLOAD, NO_ENV)]
    assert [r.status for r in results] == ["ok", "error", "error"]
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rl.loop.episodes"]
    assert len(lines) == 2, lines
    assert "task broken-1 (countdown) dropped, status error: correct: reward function error: KeyError" in lines[0]
    assert "task lost-1 (no_such_env) dropped, status error: error: RegistryError: unknown environment " \
           "'no_such_env'" in lines[1]
    assert runner.stats()["errors"] == 2


def test_rollouts_count_dropped_samples_per_status_in_the_step_metrics(runner):
    """The real in-process engine (one rank) generates, the runner scores; one task's samples all fail."""
    from megatron_rl.envs.sampler import DomainSampler
    from megatron_rl.loop.config import RLLoopConfig
    from megatron_rl.loop.rollout import Rollouts
    from megatron_rl.tokenizer import ByteTokenizer
    from tests.rollout.test_rollout_engine import _init_single, engine, make_model

    pgs = _init_single()
    tok = ByteTokenizer(384)
    cfg = RLLoopConfig(prompts_per_step=3, group_size=2, max_new_tokens=4, dynamic_sampling=False)
    rollouts = Rollouts(engine(make_model(pgs, seed=3), pgs), runner, tok,
                        lambda t: [tok.bos_id, *tok.encode(t.prompt)], cfg, seed=1)
    sampler = DomainSampler({"countdown": [GOOD]}, seed=0)
    rollouts.submit(0, [GOOD, NO_PAYLOAD, NO_ENV])
    groups, stats = rollouts.batch(0, sampler)
    assert stats["dropped_samples"] == 4 and stats["dropped_samples/error"] == 4, stats
    assert len(rollouts.trajectories(groups, "t")) == 6 - 4  # the dropped samples are not trained on


def test_unreadable_shards_are_logged_and_counted(tmp_path, caplog):
    import numpy as np

    from megatron_rl.data.shards import Trajectory, write_shard
    from megatron_rl.loop.config import EpisodesConfig, RLLoopConfig
    from megatron_rl.loop.dispatched import DispatchRollouts, episode_id, read_episodes
    from megatron_rl.loop.rollout import Group
    from megatron_rl.tokenizer import ByteTokenizer

    trajs = [Trajectory(tokens=np.array([257, 49, 65], np.int32), logprobs=np.zeros(3, np.float32),
                        loss_mask=np.array([0, 0, 1], np.uint8), prompt_len=2, reward=1.0, group_id=0,
                        policy_version_first=0, policy_version_last=0, env="countdown", task_id=GOOD.id,
                        episode_id=episode_id(0, i)) for i in range(2)]
    write_shard(tmp_path / "a.h5", trajs)
    (tmp_path / "b.h5").write_bytes(b"not an HDF5 file")  # e.g. a torn copy
    caplog.set_level(logging.WARNING)
    skipped: list[str] = []
    got = read_episodes(tmp_path, {"g0-s0", "g0-s1"}, skipped)
    assert sorted(got) == ["g0-s0", "g0-s1"] and len(skipped) == 1 and skipped[0].startswith(str(tmp_path / "b.h5"))
    assert any("quarantined shard" in r.getMessage() and "b.h5" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "b.h5").exists() and (tmp_path / "quarantine" / "b.h5.reason.txt").exists()
    (tmp_path / "b.h5").write_bytes(b"not an HDF5 file")  # torn again
    write_shard(tmp_path / "c.h5", trajs[:1])  # and an episode published twice: the first copy is kept
    # the dispatched rollouts count it among their per-step counters (every episode already published: no dispatch)
    tok = ByteTokenizer(384)
    rollouts = DispatchRollouts(None, None, tok, lambda t: [257, 49], RLLoopConfig(group_size=2), 1, EpisodesConfig(),
                                None, tmp_path, None)
    assert rollouts.counters["unreadable_shards"] == 0
    out = rollouts._dispatch([Group(0, 0, GOOD, [257, 49])], tmp_path, url="http://unused")
    assert "error" not in out, out
    assert out["counters"]["unreadable_shards"] == 1 and out["counters"]["episodes_missing"] == 0
    assert out["counters"]["quarantined_shards"] == 1 and out["counters"]["duplicate_episodes"] == 1


def _plugin_dist(root, group: str, entries: dict[str, str]) -> None:
    """A real installed distribution (dist-info on sys.path) declaring `entries` in entry-point `group`."""
    info = root / "mrl_test_plugins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mrl-test-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))


@pytest.mark.parametrize("group,good", [("megatron_rl.environments", "megatron_rl.envs.countdown.env:CountdownEnv"),
                                        ("megatron_rl.rewards", "megatron_rl.envs.countdown.env:countdown_reward")])
def test_one_broken_plugin_does_not_stop_the_others(tmp_path, monkeypatch, caplog, group, good):
    from megatron_rl.registry import Registry, RegistryError, plugin_failures

    _plugin_dist(tmp_path, group, {"plugin_ok": good, "plugin_broken": "mrl_no_such_module:Thing"})
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.WARNING, logger="megatron_rl.registry")
    reg = Registry("test plugin", entry_point_group=group)
    assert "plugin_ok" in reg.names() and "plugin_broken" not in reg.names()
    assert reg.get("plugin_ok").__name__ == good.split(":")[1]
    assert reg.failed["plugin_broken"].startswith("ModuleNotFoundError: No module named 'mrl_no_such_module'")
    assert plugin_failures()[group] >= 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "megatron_rl.registry"]
    assert f"test plugin plugin 'plugin_broken' (entry point {group} = mrl_no_such_module:Thing) failed" in line
    with pytest.raises(RegistryError, match="'plugin_broken' .* failed to load: ModuleNotFoundError"):
        reg.get("plugin_broken")
    del reg
    gc.collect()
    assert group not in plugin_failures()  # counted while the registry lives
