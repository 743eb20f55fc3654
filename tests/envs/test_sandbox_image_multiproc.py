"""The node image cache filled by many worker processes at once: one extraction, every worker gets the complete
image, nothing half-made is ever visible under the final name, and a dead filler's leftovers are cleaned."""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from envs.sandbox import image_cache
from envs.sandbox.image import MANIFEST, ImageSpec, build

WORKERS = 6


def _fill(file: str, cache: str, barrier, out) -> None:
    barrier.wait()
    layer = image_cache.ensure_cached(file, cache)
    files = sorted(str(p.relative_to(layer.root)) for p in Path(layer.root).rglob("*") if p.is_file())
    out.put((layer.root, layer.fill_s > 0, files, (Path(layer.root) / "opt/blob").stat().st_size))


@pytest.fixture()
def open_dir():
    d = tempfile.mkdtemp(prefix="mrl-test-imgcache-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("fmt", ["tar", "sqfs"])
def test_concurrent_cache_fill_is_safe(open_dir, fmt):
    if fmt == "sqfs" and not shutil.which("unsquashfs"):
        pytest.skip("squashfs-tools not installed (the tar format is tested)")
    (open_dir / "blob").write_bytes(os.urandom(8 << 20))  # big enough that extraction takes a while
    for i in range(50):
        (open_dir / f"f{i}").write_text(str(i))
    files = {"/opt/blob": str(open_dir / "blob"), **{f"/opt/small/f{i}": str(open_dir / f"f{i}") for i in range(50)}}
    image = build(ImageSpec(files=files), str(open_dir / "store"), fmt=fmt)
    cache = open_dir / "cache"
    digest = os.path.basename(image).split(".")[0]
    cache.mkdir()
    (cache / f".fill-{digest}-dead").mkdir()  # a filler that died mid-extraction
    (cache / f".fill-{digest}-dead" / "junk").write_text("x")
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=_fill, args=(image, str(cache), barrier, out)) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    roots = {r[0] for r in results}
    assert roots == {str(cache / digest)}
    assert sum(r[1] for r in results) == 1  # exactly one worker extracted
    expected = sorted([MANIFEST, "opt/blob"] + [f"opt/small/f{i}" for i in range(50)])
    assert all(r[2] == expected and r[3] == 8 << 20 for r in results)  # every worker saw the complete image
    assert sorted(os.listdir(cache)) == sorted([digest, f"{digest}.lock"])  # leftovers gone, no temp folder
