"""Rollout engine: generation from the trainer's own Megatron model with a paged KV cache, continuous
batching, weight updates and an OpenAI-compatible HTTP API (see engine.py, server.py)."""
from megatron_rl.rollout.compression import CompressionConfig, CompressionRecord
from megatron_rl.rollout.engine import EngineConfig, RequestOutput, RolloutEngine, SampleOutput
from megatron_rl.rollout.sampling import SamplingParams

__all__ = ["CompressionConfig", "CompressionRecord", "EngineConfig", "RequestOutput", "RolloutEngine", "SampleOutput",
           "SamplingParams"]
