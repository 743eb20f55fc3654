"""Environments, task suites, sandboxes and rewards for megatron-rl.

Importing `envs` registers the built-in environments (arithmetic, code, math, tool_use, terminal, docqa, countdown,
harbor), the domains of the procedural task libraries (`envs.procedural`: reasoning_gym/<generator>, made on
first use) and reward functions; third-party ones come through the `megatron_rl.environments` and
`megatron_rl.rewards` entry-point groups.
"""
from megatron_rl.envs import (  # noqa: F401  (register the built-ins)
    arithmetic,
    code,
    countdown,
    docqa,
    harbor,
    math,
    procedural,
    terminal,
    tool_use,
)
from megatron_rl.envs.base import ENVIRONMENTS, Environment, Observation, RewardResult, StepResult, Task, make_env
from megatron_rl.envs.rewards import REWARDS

__all__ = ["ENVIRONMENTS", "REWARDS", "Environment", "Observation", "RewardResult", "StepResult",
           "Task", "make_env"]
