"""Countdown: reach a target number with the given numbers (+ - * /, each number at most once)."""
from megatron_rl.envs.countdown.env import CountdownEnv, countdown_reward, generate_tasks

__all__ = ["CountdownEnv", "countdown_reward", "generate_tasks"]
