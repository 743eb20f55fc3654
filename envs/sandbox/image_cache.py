"""The node-local cache of sandbox images: an image file of the shared store (`envs.sandbox.image`) extracted
once per node into `<cache>/<digest>/`, which sandboxes mount read-only.

Fill protocol (safe for any number of concurrent workers on a node): an exclusive `flock` on
`<cache>/<digest>.lock` serialises the fillers of one digest; the first extracts into a private folder
`<cache>/.fill-<digest>-<random>` and publishes it with one `rename` to `<cache>/<digest>`; the others wake up,
see the folder and use it. A folder under the final name is therefore always complete; a filler that died
leaves only a `.fill-*` folder, which the next filler of that digest removes. The cache folder and the images
are world-readable (0755) so the sandboxes' slot uids can read them; nothing in them is writable but by the
worker's uid, and they are mounted read-only.

THREAT MODEL: the store is trusted (written by this project's builder); the cache folder must be node-local
and owned by the worker (a cache folder owned by another uid is refused). squashfs images are extracted
with `unsquashfs` (rootless, no FUSE needed), tars member by member (`image._safe_members`: no absolute or
`..` names, device files, hard links out, or writes through a symlink of the archive). An extracted image is
checked before it is published (`image.check_tree`): its /usr/local and /opt are real folders (a link there
would make bwrap bind the link's target on the host) and no symlink climbs out of it; `mounts()` checks again.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field

from megatron_rl.config import ConfigError
from megatron_rl.envs.sandbox import image as img


@dataclass
class ImageLayer:
    """An image ready to mount: its extracted folder on this node, and what its manifest says."""

    root: str
    """The extracted image (its /usr/local and /opt are mounted over the host's)."""
    digest: str
    """Content address of the image."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of programs run in it."""
    workdir: str = "/work"
    """Start directory of programs."""
    file: str = ""
    """The image file in the shared store it came from."""
    fill_s: float = 0.0
    """Seconds this process spent extracting it (0.0 when the node cache already had it)."""

    def mounts(self) -> list[tuple[str, str]]:
        """(host folder, sandbox path) pairs to bind read-only: /usr/local and /opt when the image has them."""
        out = []
        for d in img._ROOT_DIRS:
            p = os.path.join(self.root, d)
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISDIR(os.lstat(p).st_mode):  # a link would make bwrap bind its host target
                    raise img.ImageBuildError(f"image {self.root}: /{d} is not a real folder; refusing to mount it")
                out.append((p, "/" + d))
        return out


def default_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"megatron-rl-images-{os.geteuid()}")


def default_store_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "megatron-rl", "images")


def _own_dir(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConfigError(f"image cache {path!r} is not a folder owned by uid {os.geteuid()}; pass a node-local "
                          "folder of this user (sandbox.image_cache)")
    os.chmod(path, 0o755)


def ensure_cached(file: str, cache_dir: str | None = None) -> ImageLayer:
    """The image `file` (`<digest>.sqfs|.tar` from the store) extracted in this node's cache; fills it when
    missing (see the module docstring)."""
    cache_dir = cache_dir or default_cache_dir()
    _own_dir(cache_dir)
    digest = os.path.basename(file).split(".")[0]
    final = os.path.join(cache_dir, digest)
    t0, filled = time.monotonic(), False
    if not os.path.isdir(final):
        lock = os.open(os.path.join(cache_dir, f"{digest}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.isdir(final):
                _fill(file, cache_dir, digest, final)
                filled = True
        finally:
            os.close(lock)  # releases the flock
    return _layer(final, digest, file, time.monotonic() - t0 if filled else 0.0)


def _fill(file: str, cache_dir: str, digest: str, final: str) -> None:
    for stale in os.listdir(cache_dir):  # a dead filler's leftovers (we hold the digest's lock)
        if stale.startswith(f".fill-{digest}-"):
            shutil.rmtree(os.path.join(cache_dir, stale), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=f".fill-{digest}-", dir=cache_dir)
    try:
        dest = os.path.join(tmp, "root")
        img.unpack(file, dest)
        if not os.path.isfile(os.path.join(dest, img.MANIFEST)) or os.path.islink(os.path.join(dest, img.MANIFEST)):
            raise img.ImageBuildError(f"{file}: not an image of this project (no {img.MANIFEST})")
        img.check_tree(dest, file)  # /usr/local and /opt real folders, no link out of the image
        img._open_up(dest)
        try:
            os.rename(dest, final)
        except OSError:
            if not os.path.isdir(final):  # else a filler that did not take the lock published it first: use that
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _layer(root: str, digest: str, file: str, fill_s: float) -> ImageLayer:
    with open(os.path.join(root, img.MANIFEST)) as f:
        m = json.load(f)
    return ImageLayer(root=root, digest=digest, env=dict(m.get("env") or {}), workdir=m.get("workdir") or "/work",
                      file=file, fill_s=fill_s)


def resolve(ref, store: str | None = None, cache_dir: str | None = None) -> ImageLayer:
    """An image ready to mount from `ref`: an `ImageSpec`, an image spec YAML path, or a built image file
    (.sqfs/.tar); a spec is built into `store` first when the store lacks it."""
    if isinstance(ref, img.ImageSpec):
        spec = ref
    elif isinstance(ref, str) and ref.endswith((".sqfs", ".tar")):
        if not os.path.isfile(ref):
            raise ConfigError(f"image file {ref!r} does not exist (build it from its spec, or name the spec YAML)")
        return ensure_cached(ref, cache_dir)
    elif isinstance(ref, str) and ref.endswith((".yaml", ".yml")):
        if not os.path.isfile(ref):
            raise ConfigError(f"image spec {ref!r} does not exist")
        spec = img.ImageSpec.load(ref)
    else:
        raise ConfigError(f"image {ref!r}: name an image spec (.yaml) or a built image file (.sqfs/.tar)")
    return ensure_cached(img.build(spec, store or default_store_dir()), cache_dir)
