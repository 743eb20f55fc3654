"""Tool use: multi-turn episodes with a calculator, workspace files and sandboxed Python; final answer checked."""
from megatron_rl.envs.tool_use.env import ToolUseEnv, calculate

__all__ = ["ToolUseEnv", "calculate"]
