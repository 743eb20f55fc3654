"""The countdown curriculum is countdown's own task source (`envs.task_source`): the run config's `curriculum:`
section keeps its keys, is checked by countdown's CurriculumConfig, and generic code reaches it by data.domain."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl import config as C
from megatron_rl.config import ConfigError
from megatron_rl.envs.countdown.curriculum import CurriculumConfig, generate
from megatron_rl.envs.task_source import task_source
from megatron_rl.run_config import RunConfig

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_configs_curriculum_section_builds_countdowns_source():
    cfg = C.load(RunConfig, REPO / "configs" / "demo_cpu.yaml")
    source = cfg.task_source()
    assert isinstance(source, CurriculumConfig) and (source.max_value, source.max_numbers) == (9, 3)
    assert source.generate(5, cfg.seed, "heldout") == generate(5, source, cfg.seed, "heldout")
    from megatron_rl.loop.job import task_lists

    lists = task_lists(cfg)
    assert list(lists["rl"]) == ["countdown"] and len(lists["rl"]["countdown"]) == source.rl_tasks
    assert all(t.id.startswith("easy-heldout-") for t in lists["eval"])
    off = C.load(RunConfig, REPO / "configs" / "demo_cpu.yaml", ["curriculum.enabled=false"])
    assert off.task_source() is None and not task_lists(off)["train"][0].id.startswith("easy-")


def test_the_section_is_checked_by_the_domains_source_naming_the_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'curriculum.max_vaule'.*max_value"):
        task_source({"max_vaule": 5}, "countdown")
    with pytest.raises(ConfigError, match="min_numbers <= max_numbers"):
        task_source({"min_numbers": 4, "max_numbers": 3}, "countdown")
    assert task_source({"enabled": False}, "countdown") is None and task_source({}, "countdown").enabled


def test_a_domain_without_a_source_or_a_mixed_mixture_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"data.domain 'arithmetic' has no generated task source .* set "
                                          r"curriculum.enabled=false"):
        task_source({}, "arithmetic")
    assert task_source({"enabled": False}, "arithmetic") is None
    with pytest.raises(ConfigError, match=r"generates countdown tasks for the RL loop but envs.domains is "
                                          r"\['countdown', 'math'\]; set curriculum.enabled=false"):
        task_source({}, "countdown", mixture=["countdown", "math"])
