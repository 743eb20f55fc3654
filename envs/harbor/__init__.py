"""Harbor: task folders in the Terminal-Bench 2.0 / Harbor format as a multi-turn shell domain with a separate
verifier sandbox (envs/harbor/tasks/<name>/: instruction.md, task.toml, environment/, tests/, solution/)."""
from megatron_rl.envs.harbor import reward  # noqa: F401  (registers the harbor_tests reward)
from megatron_rl.envs.harbor.env import HarborEnv
from megatron_rl.envs.harbor.loader import load_harbor, load_task_folder

__all__ = ["HarborEnv", "load_harbor", "load_task_folder"]
