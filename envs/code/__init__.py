"""Code: the model writes a Python function; the reward is the unit-test pass rate in the sandbox."""
from megatron_rl.envs.code import rewards  # noqa: F401  (registers the domain's reward into envs.reward_spec.REWARDS)
from megatron_rl.envs.code.env import CodeEnv

__all__ = ["CodeEnv"]
