"""Operator tools of megatron-rl: checkpoint conversion, the parallel-layout planner, inspection."""
