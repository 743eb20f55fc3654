"""Settings of the vLLM rollout backend (`engine.backend: vllm`, `engine.vllm`) and the check of its environment,
kept apart from `vllm_engine.py` so that the engine config (rollout/engine.py) can hold them without importing
the process machinery."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass

from megatron_rl.config import ConfigError

SETUP = "scripts/setup_vllm.sh"
"""The script that builds the vLLM environment (the fix every environment error names)."""


@dataclass
class VLLMConfig:
    """The vLLM backend (engine.backend: vllm): where vLLM lives and how its engine runs."""

    python: str = ".venv-vllm/bin/python"
    """The vLLM environment's python: a path (relative: to the current directory), or a command prefix
    ending in a python (e.g. `apptainer exec vllm.sif python3`); made by scripts/setup_vllm.sh."""
    version: str = "0.32.0"
    """The vLLM version required of that environment (checked before the run starts)."""
    enforce_eager: bool = True
    """No graph compilation (on CPU vLLM's inductor compile takes ~2.5 min at every start)."""
    kv_cache_gb: int = 2
    """KV cache of each engine on CPU (VLLM_CPU_KVCACHE_SPACE, GiB)."""
    cpu_threads_bind: str = ""
    """VLLM_CPU_OMP_THREADS_BIND (e.g. '0-1'; '' = vLLM's default 'auto', which keeps one core back)."""
    gpu_memory_utilization: float = 0.0
    """On a GPU: the share of its memory vLLM takes for weights and KV cache (0 = vLLM's default, 0.9: set it
    lower, e.g. 0.3, on a GPU shared with the trainer). Ignored on CPU (kv_cache_gb)."""
    weight_transfer: str = "file"
    """How each weight sync reaches vLLM. file: safetensors on tmpfs + reload_weights (any device); nccl: vLLM's
    weight-transfer API (init_weight_transfer_engine, start/update/finish_weight_update), the tensors broadcast
    from the trainer's memory over an NCCL group (GPUs only: refused without CUDA); gloo: the same route over a
    CPU (gloo) group (CPU runs; what the CPU tests drive)."""
    cuda_visible_devices: str = ""
    """CUDA_VISIBLE_DEVICES of the vLLM process ('' = this process's, vLLM then takes its first GPU). With
    weight_transfer=nccl name a GPU other than the trainer rank's: NCCL refuses two ranks of one group on one GPU
    (a vLLM sharing the trainer's GPU syncs by file)."""
    shm_dir: str = "/dev/shm"
    """Where the per-update weight folders are written (tmpfs); one folder per engine, removed at close."""
    start_timeout_s: float = 900.0
    """Seconds the vLLM process may take to load the model and answer ready."""
    step_timeout_s: float = 600.0
    """Seconds one engine step or weight reload may take before the process is declared hung (killed)."""
    max_restarts: int = 2
    """A vLLM process that dies (killed, out of memory) or hangs past step_timeout_s is restarted this many times
    per engine: it reloads the last synced weights and the samples in flight continue from their tokens so far
    (none lost); one more death stops the run with the error (0: no restart). With restarts on, the last synced
    weights stay on tmpfs (one copy of the model in shm_dir) for the reload."""

    def validate(self) -> None:
        if not self.python.strip():
            raise ConfigError(f"engine.vllm.python is empty; name the vLLM environment's python (made by {SETUP})")
        if self.weight_transfer not in ("file", "nccl", "gloo"):
            raise ConfigError(f"engine.vllm.weight_transfer={self.weight_transfer!r} is not one of file, nccl, gloo")
        for name in ("kv_cache_gb", "start_timeout_s", "step_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"engine.vllm.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.gpu_memory_utilization < 1:
            raise ConfigError(f"engine.vllm.gpu_memory_utilization must be in [0, 1), got "
                              f"{self.gpu_memory_utilization}")
        if self.max_restarts < 0:
            raise ConfigError(f"engine.vllm.max_restarts must be >= 0, got {self.max_restarts}")

    def command(self) -> list[str]:
        """The python command as an argument list (a path, or a command prefix)."""
        return shlex.split(self.python)


def check_environment(cfg: VLLMConfig) -> str:
    """The vLLM version of `cfg.python`'s environment, read from its package metadata (no `import vllm`, which
    takes seconds); ConfigError naming engine.vllm.python and the fix when it is missing or another version."""
    cmd = cfg.command()
    fix = f"run `bash {SETUP}` (or point engine.vllm.python at the python of a vLLM {cfg.version} environment)"
    if len(cmd) == 1 and not shutil.which(cmd[0]) and not os.access(cmd[0], os.X_OK):
        raise ConfigError(f"engine.vllm.python={cfg.python!r}: no such executable; {fix}")
    probe = ("import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n"
             "        print(m.version(d)); break\n    except m.PackageNotFoundError: pass\nelse: print('')")
    try:
        got = subprocess.run([*cmd, "-c", probe], capture_output=True, text=True, timeout=120)
    except OSError as e:
        raise ConfigError(f"engine.vllm.python={cfg.python!r} does not run ({e}); {fix}") from None
    version = got.stdout.strip().split("+")[0]
    if got.returncode != 0 or not version:
        raise ConfigError(f"engine.vllm.python={cfg.python!r} has no vllm installed; {fix}")
    if version != cfg.version:
        raise ConfigError(f"engine.vllm.python={cfg.python!r} has vllm {version}, the backend needs "
                          f"{cfg.version} (engine.vllm.version); {fix}")
    return version


def check_transfer_device(cfg: VLLMConfig) -> None:
    """engine.vllm.weight_transfer=nccl needs CUDA in this process and vLLM on another GPU (its own
    cuda_visible_devices): ConfigError naming the setting and the fix."""
    import torch

    if cfg.weight_transfer != "nccl":
        return
    if not torch.cuda.is_available():
        raise ConfigError("engine.vllm.weight_transfer=nccl needs CUDA GPUs (an NCCL group between the trainer and "
                          "vLLM) and none is visible here; use engine.vllm.weight_transfer=file (safetensors on "
                          "tmpfs, any device) or gloo (the same vLLM weight-transfer route over a CPU group)")
    if not cfg.cuda_visible_devices.strip():
        raise ConfigError("engine.vllm.weight_transfer=nccl needs vLLM on a GPU other than the trainer rank's (NCCL "
                          "refuses two ranks of one group on one GPU): set engine.vllm.cuda_visible_devices to that "
                          "GPU, or use engine.vllm.weight_transfer=file for a vLLM sharing the trainer's GPU")


def dtype_name(engine_dtype: str, params_dtype: str) -> str:
    """vLLM's dtype for the engine's (EngineConfig.dtype: model, fp32, bf16) and the trainer's params dtype."""
    d = params_dtype if engine_dtype == "model" else engine_dtype
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(d, d)
