"""`megatron-rl plan`: memory and parallel-layout planner, dense and MoE models up to 1T parameters.

Modules: `spec` (the PlanConfig YAML schema, ArchSpec, GPU table), `count` (parameter counts and FLOPs),
`memory` (per-GPU memory terms and step time of one layout), `search` (layout search, rollout KV cache,
weight-sync bandwidth), `cli` (the command line).
"""
from megatron_rl.tools.plan.cli import main

__all__ = ["main"]
