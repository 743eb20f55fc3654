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

from megatron_rl.config import ConfigError
from megatron_rl.envs.sandbox import image_cache
from megatron_rl.envs.sandbox.base import Sandbox
from megatron_rl.envs.sandbox.image import ImageSpec


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
    from megatron_rl.envs.sandbox import SandboxConfig

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


def publish(ref: str | ImageSpec) -> dict[str, str]:
    """The driver's half of a dispatched domain image: `ref` (a spec YAML or a built file) as a file of the
    shared store, {digest, file}, which the worker spec carries to every worker (`worker_sandbox`)."""
    from megatron_rl.envs.sandbox import image as img

    if isinstance(ref, str) and ref.endswith((".sqfs", ".tar")):
        if not os.path.isfile(ref):
            raise ConfigError(f"image file {ref!r} does not exist (build it from its spec, or name the spec YAML)")
        file = os.path.abspath(ref)
    else:
        spec = ImageSpec.load(ref) if isinstance(ref, str) else ref
        file = img.build(spec, DEFAULTS.store or image_cache.default_store_dir())
    return {"digest": os.path.basename(file).split(".")[0], "file": os.path.abspath(file)}


def worker_sandbox(name: str, ref: dict, workers: int = 1, backend: str = "bwrap") -> Sandbox:
    """The worker's half: environment `name`'s image {digest, file} from the worker spec, extracted once into
    this node's cache (`image_cache.ensure_cached`, under a flock) and mounted by its sandbox. A file that is
    missing here or is not that digest is refused, naming the fix."""
    digest, file = ref.get("digest", ""), ref.get("file", "")
    if not os.path.isfile(file):
        raise ConfigError(f"worker image of {name!r}: {file!r} is not readable on this node; put envs.image_store "
                          "on a filesystem every worker node mounts")
    if not digest or os.path.basename(file).split(".")[0] != digest:
        raise ConfigError(f"worker image of {name!r}: {file!r} is not image {digest!r} (the store was changed "
                          "under the run); rebuild it from its spec")
    layer = image_cache.ensure_cached(file, DEFAULTS.cache or None)  # once per node (flock); then a lookup
    if _manifest_digest(layer.root) != digest:
        raise ConfigError(f"worker image of {name!r}: the cached image {layer.root!r} is not {digest!r}; clear "
                          "envs.image_cache")
    return image_sandbox(file, workers=workers, backend=backend)


def _manifest_digest(root: str) -> str | None:
    import json

    from megatron_rl.envs.sandbox.image import MANIFEST

    with open(os.path.join(root, MANIFEST)) as f:
        return json.load(f).get("digest")


def close_all() -> None:
    """Close this process's image sandboxes (at exit, and in tests)."""
    with _lock:
        items = [(k, s) for k, s in _sandboxes.items() if k[0] == os.getpid()]
        for k, _ in items:
            del _sandboxes[k]
    for _, s in items:
        s.close()


atexit.register(close_all)
