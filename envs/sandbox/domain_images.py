"""Sandboxes of per-domain images, one per image (digest) per process, built on first use and kept open.

`image_sandbox(ref)` is how the product path gets an image's sandbox: the mixture's `envs.domains.<d>.image`
(`envs.mixture`) and a Harbor task whose environment/ installs packages the host lacks (`envs.harbor.env`).
Where images are built and cached comes from `DEFAULTS` (set once per process from the run config's
`envs.image_store` / `envs.image_cache`; shared store ~/.cache/megatron-rl/images, node cache under the
temp folder otherwise).
"""
from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass

from envs.sandbox import image_cache
from envs.sandbox.base import Sandbox
from envs.sandbox.image import ImageSpec


@dataclass
class ImageDirs:
    """Where images live."""

    store: str = ""
    """Shared-filesystem folder of built image files ('' = ~/.cache/megatron-rl/images)."""
    cache: str = ""
    """Node-local folder images are extracted into ('' = <tmp>/megatron-rl-images-<uid>)."""


DEFAULTS = ImageDirs()
_lock = threading.Lock()
_sandboxes: dict[tuple, Sandbox] = {}


def configure(store: str = "", cache: str = "") -> None:
    """Set this process's image folders (the run config's envs.image_store / envs.image_cache)."""
    if store:
        DEFAULTS.store = store
    if cache:
        DEFAULTS.cache = cache


def image_sandbox(ref: str | ImageSpec | dict, workers: int = 1, backend: str = "bwrap",
                  base_image: str | None = None) -> Sandbox:
    """The sandbox running in image `ref` (an ImageSpec or its dict, a spec YAML, or a built image file): built,
    cached and started once per process and image; later calls return the same one."""
    from envs.sandbox import SandboxConfig

    if isinstance(ref, dict):
        ref = ImageSpec.from_dict(ref)
    layer = image_cache.resolve(ref, DEFAULTS.store or None, DEFAULTS.cache or None)
    key = (os.getpid(), layer.digest, layer.root, workers, backend, base_image)
    with _lock:
        sb = _sandboxes.get(key)
        if sb is None:
            cfg = SandboxConfig(backend=backend, workers=workers, layer=layer.file, image=base_image,
                                image_store=DEFAULTS.store, image_cache=os.path.dirname(layer.root))
            sb = _sandboxes[key] = cfg.build()
        return sb


def close_all() -> None:
    """Close this process's image sandboxes (at exit, and in tests)."""
    with _lock:
        items = [(k, s) for k, s in _sandboxes.items() if k[0] == os.getpid()]
        for k, _ in items:
            del _sandboxes[k]
    for _, s in items:
        s.close()


atexit.register(close_all)
