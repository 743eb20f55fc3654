"""Generated task sources: a domain that can make its own tasks (countdown: an easier curriculum for tiny models)
provides them here, so that generic code (the run config, the loop, `megatron-rl eval`) names no domain.

    source = task_source(cfg.curriculum, cfg.data.domain)   # the run config's `curriculum:` section
    if source is not None:                                   # enabled, for a domain that has a source
        tasks = source.generate(n, seed, split)              # split: train (warm-up), rl or heldout (disjoint)

A source is a module of the domain's package holding `CurriculumConfig` (the section's settings: `enabled`,
`rl_tasks`, and the domain's own fields; documented there) whose instances have `generate(n, seed, split)`.
"""
from __future__ import annotations

import importlib
from typing import Any

from megatron_rl.config import ConfigError, from_dict

TASK_SOURCES: dict[str, str] = {"countdown": "megatron_rl.envs.countdown.curriculum"}
"""Domain -> the module of its generated task source (imported when a run uses it)."""


def task_source(section: dict[str, Any], domain: str, mixture: list[str] | None = None):
    """The enabled task source of `domain` built from `section` (the `curriculum:` mapping; {} = the source's
    defaults, which are on), None when it is off. Refused, naming the fix: a section for a domain without a source
    (unless off), or an enabled source while the RL mixture (`mixture`: its domain names) holds other domains."""
    if domain not in TASK_SOURCES:
        if section.get("enabled", True) is not False:
            raise ConfigError(f"curriculum: data.domain {domain!r} has no generated task source (domains with one: "
                              f"{', '.join(sorted(TASK_SOURCES))}); set curriculum.enabled=false")
        return None
    cls = importlib.import_module(TASK_SOURCES[domain]).CurriculumConfig
    cfg = from_dict(cls, section, prefix="curriculum")
    if not cfg.enabled:
        return None
    if mixture is not None and set(mixture) != {domain}:
        raise ConfigError(f"curriculum.enabled generates {domain} tasks for the RL loop but envs.domains is "
                          f"{sorted(mixture)}; set curriculum.enabled=false")
    return cfg
