"""Run a Harbor task's reference solution (solution/solve.sh) as the agent's one command, then its tests: how the
suite's own tests check that every shipped task is solvable and that doing nothing fails it."""
from __future__ import annotations

from megatron_rl.envs.base import Task
from megatron_rl.envs.harbor import paths
from megatron_rl.envs.harbor.env import HarborEnv
from megatron_rl.envs.harbor.loader import decode_files


def solve_command() -> str:
    return f"bash {paths.WORK}/{paths.SOLUTION}/solve.sh"


def attempt(task: Task, sandbox, solve: bool = True):
    """(RewardResult, agent command result or None): solve.sh as the agent (or no command at all), then the tests."""
    env = HarborEnv(sandbox=sandbox)
    env.reset(task)
    res = None
    if solve:
        files = decode_files(task.payload.get("solution") or {}, prefix=f"{paths.SOLUTION}/")
        res, _ = env.run_command(solve_command(), extra_files=files)
    return env.finish("ok").reward_result, res
