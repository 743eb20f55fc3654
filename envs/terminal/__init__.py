"""Terminal: shell commands over turns in a scratch workspace; a hidden verifier decides success."""
from envs.terminal import rewards  # noqa: F401  (registers the domain's reward into envs.reward_spec.REWARDS)
from envs.terminal.env import TerminalEnv

__all__ = ["TerminalEnv"]
