"""Arithmetic: short integer questions answered in words; the last number of the reply is the answer."""
from megatron_rl.envs.arithmetic.env import ArithmeticEnv, final_number_reward

__all__ = ["ArithmeticEnv", "final_number_reward"]
