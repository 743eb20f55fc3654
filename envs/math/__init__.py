"""Math: a final answer checked with math-verify, plus a format component."""
from megatron_rl.envs.math.env import MathEnv

__all__ = ["MathEnv"]
