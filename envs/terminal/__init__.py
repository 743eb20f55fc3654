"""Terminal: shell commands over turns in a scratch workspace; a hidden verifier decides success."""
from envs.terminal.env import TerminalEnv

__all__ = ["TerminalEnv"]
