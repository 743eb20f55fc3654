"""Terminal: shell commands over turns in a scratch workspace; a hidden verifier decides success."""
from megatron_rl.envs.terminal import rewards  # noqa: F401  (registers the domain's reward into envs.reward_spec.REWARDS)
from megatron_rl.envs.terminal.env import TerminalEnv

__all__ = ["TerminalEnv"]
