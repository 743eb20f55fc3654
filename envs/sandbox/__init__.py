"""Sandboxes: run untrusted code with limits (`Sandbox.run`), backends in a registry, a concurrent pool.

THREAT MODEL: see `envs.sandbox.base` (shared contract) and each backend module: `bwrap` (default; the
only one for untrusted model output on the dev machines), `apptainer` (clusters that provide it),
`subprocess` (trusted code only: isolates nothing). `build_sandbox` never silently downgrades: an
unavailable backend raises `SandboxUnavailable` with the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.config import ConfigError
from megatron_rl.envs.sandbox import apptainer, bwrap, subprocess_backend  # noqa: F401  (register the backends)
from megatron_rl.envs.sandbox.base import SANDBOXES, Limits, Sandbox, SandboxResult, SandboxUnavailable
from megatron_rl.envs.sandbox.image_cache import resolve as resolve_image
from megatron_rl.envs.sandbox.pool import SandboxJob, SandboxPool

__all__ = ["SANDBOXES", "Limits", "Sandbox", "SandboxConfig", "SandboxJob", "SandboxPool", "SandboxResult",
           "SandboxUnavailable", "build_sandbox"]


@dataclass
class SandboxConfig:
    """Which sandbox backend to build, and how."""

    backend: str = "bwrap"
    """Registered backend name: bwrap (default), apptainer (clusters), subprocess (trusted code only), or auto
    (apptainer when it is on PATH and `image` names a base image, else bwrap)."""
    rootfs: str | None = None
    """bwrap: a root filesystem directory mounted read-only instead of the host's /usr; None = host."""
    image: str | None = None
    """apptainer: the .sif image (or unpacked image directory) to run in."""
    workers: int = 1
    """Concurrent sandbox slots; above 1 a SandboxPool of that many slots (threads) is built."""
    limits: Limits = field(default_factory=Limits)
    """Default limits of a run (a run may pass its own)."""
    prespawn: bool = True
    """bwrap: set up the next run's sandbox while the current one runs (hides setup latency)."""
    layer: str | None = None
    """A per-domain image over the system (`envs.sandbox.image`): an image spec YAML (built into image_store on
    first use) or a built image file (.sqfs/.tar); None = the bare system."""
    image_store: str = ""
    """Shared-filesystem folder of built images ('' = ~/.cache/megatron-rl/images)."""
    image_cache: str = ""
    """Node-local folder images are extracted into ('' = <tmp>/megatron-rl-images-<uid>)."""
    lease_dir: str = ""
    """bwrap as root: the node-wide registry of slot uid leases ('' = /run/megatron-rl/sandbox-uids). Every job on
    a node must see the same folder (never a per-job TMPDIR), owned by the worker's uid and writable by no one
    else; see `envs.sandbox._linux`."""

    def resolved_backend(self) -> str:
        """The backend `build` uses ('auto' resolved)."""
        if self.backend != "auto":
            return self.backend
        return "apptainer" if self.image and apptainer.find_apptainer() else "bwrap"

    def validate(self) -> None:
        if self.layer and self.resolved_backend() not in ("bwrap", "apptainer"):
            raise ConfigError(f"sandbox.layer (a domain image) needs backend bwrap or apptainer, not "
                              f"{self.resolved_backend()!r}: the subprocess backend mounts nothing")
        if self.layer and self.rootfs:
            raise ConfigError("sandbox.layer goes over the host system; it cannot be combined with sandbox.rootfs")
        if self.workers < 1:
            raise ConfigError(f"sandbox.workers must be >= 1, got {self.workers}")
        if self.resolved_backend() == "apptainer" and not self.image:
            raise ConfigError("sandbox.image is required with backend 'apptainer' (a .sif file)")
        if self.rootfs is not None and self.resolved_backend() != "bwrap":
            raise ConfigError(f"sandbox.rootfs applies to backend 'bwrap' only, not {self.backend!r}; "
                              "use sandbox.image for apptainer")
        self.limits.validate()

    def build(self) -> Sandbox:
        """The configured backend (a SandboxPool when workers > 1)."""
        self.validate()
        backend = self.resolved_backend()
        cls = SANDBOXES.get(backend)
        kwargs: dict = {"limits": self.limits}
        if self.layer:
            kwargs["layer"] = resolve_image(self.layer, self.image_store or None, self.image_cache or None)
        if backend == "bwrap":
            kwargs.update(rootfs=self.rootfs, prespawn=self.prespawn, lease_dir=self.lease_dir or None)
        elif backend == "apptainer":
            kwargs.update(image=self.image)

        def factory(_slot: int) -> Sandbox:
            return cls(**kwargs)

        return factory(0) if self.workers == 1 else SandboxPool(factory, self.workers)


def build_sandbox(cfg: SandboxConfig) -> Sandbox:
    """Build the sandbox a config describes."""
    return cfg.build()
