"""Tool use: multi-turn episodes with a calculator, workspace files and sandboxed Python; final answer checked."""
from envs.tool_use.env import ToolUseEnv, calculate

__all__ = ["ToolUseEnv", "calculate"]
