"""Code: the model writes a Python function; the reward is the unit-test pass rate in the sandbox."""
from envs.code.env import CodeEnv

__all__ = ["CodeEnv"]
