"""Environments, task suites, sandboxes and rewards for megatron-rl."""
