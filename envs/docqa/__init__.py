"""DocQA: questions over a provided document (financial statements), rule checks plus an LLM judge."""
from megatron_rl.envs.docqa.env import DocQAEnv

__all__ = ["DocQAEnv"]
