"""Procedural task libraries as domains (reasoning-gym's generators as `reasoning_gym/<name>`, and any library that
follows the contract in envs/procedural/contract.py): importing this package registers the contract's registry,
the reasoning-gym library (when installed) and the environments of every library's generators (made on first use).

Modules: contract (`TaskLibrary`, `LIBRARIES`, `register_library`), env (tasks, environment, reward), rgym (the
reasoning-gym adapter), domains (`envs.domains` patterns, checks). Guide: docs/task_libraries.md.
"""
from megatron_rl.envs.procedural import env, rgym  # noqa: F401  (the environments' family; reasoning-gym when installed)
from megatron_rl.envs.procedural.contract import (
    LIBRARIES,
    SEP,
    Item,
    TaskLibrary,
    is_procedural,
    library_domains,
    register_library,
    split_domain,
    task_provenance,
)

__all__ = ["LIBRARIES", "SEP", "Item", "TaskLibrary", "is_procedural", "library_domains", "register_library",
           "split_domain", "task_provenance"]
