"""megatron-rl: RL post-training of large language models on Megatron-Core, Slurm-native.

From Python (a submitit executor runs `train` on a cluster node like any function):

    from megatron_rl import load_config, train
    cfg = load_config("configs/post_train_cpu.yaml", ["rl.steps=4"])
    summary = train(cfg)                  # the same run as `megatron-rl train`; returns summary.json's dict
"""
__version__ = "0.1.0"

from megatron_rl.compat import deferred_compile as _deferred_compile  # noqa: E402

_deferred_compile.install()  # Megatron's import without TorchDynamo (its torch.compile decorations wait for a call)

from megatron_rl.compat import tensorboard_s3 as _tensorboard_s3  # noqa: E402

_tensorboard_s3.install()  # TensorBoard's import (by Megatron) without boto3: its unused s3:// file system off

from megatron_rl.compat import quiet as _quiet  # noqa: E402

_quiet.install()  # Megatron's known-harmless CPU warnings (no TE/Apex) filtered, each named with its reason

__all__ = ["load_config", "train", "export"]


def load_config(path: str, overrides: list[str] | None = None):
    """A validated RunConfig from a YAML file and dotted overrides (errors name the key)."""
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    return C.load(RunConfig, path, overrides or [])


def train(cfg) -> dict:
    """Run (or resume) the whole job of `cfg` (a RunConfig or a YAML path); returns the run's summary."""
    from megatron_rl.commands.train import run

    return run(load_config(cfg) if isinstance(cfg, str) else cfg)


def export(run_dir: str, step: int | None = None, out: str | None = None, verify: bool = False) -> dict:
    """Write a run's policy (latest or `step`) as an HF folder; returns the export report."""
    from pathlib import Path

    from megatron_rl.commands.export import export_run

    return export_run(Path(run_dir), step, out, verify)
