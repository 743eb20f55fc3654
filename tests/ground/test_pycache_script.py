"""scripts/pycache.sh (sourced by the README's two commands): with PYTHONDONTWRITEBYTECODE=1, as on the project's
machines, every process compiled every import from source (torch + Megatron: 14.3 CPU-s, 5.3 from bytecode).
Sourced, it makes Python write and reuse bytecode in one ignored folder; MRL_PYCACHE=0 leaves the caller's
setting alone."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _import_under_script(tmp_path: Path, **env: str) -> Path:
    """Source the script in `tmp_path` (as the README's commands do from the repository root), then import a
    module from there; returns the cache folder the script chose."""
    (tmp_path / "mod_x.py").write_text("X = 1\n")
    cmd = f". {REPO / 'scripts' / 'pycache.sh'} && {sys.executable} -c 'import mod_x'"
    subprocess.run(["bash", "-c", cmd], cwd=tmp_path, check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ".",
                                                                        "PYTHONDONTWRITEBYTECODE": "1", **env})
    return tmp_path / ".pycache"


def test_sourced_it_caches_bytecode_in_one_folder(tmp_path):
    cache = _import_under_script(tmp_path)
    assert list(cache.rglob("mod_x*.pyc")), "no bytecode was written under .pycache"
    assert not (tmp_path / "__pycache__").exists()


def test_mrl_pycache_0_keeps_the_callers_setting(tmp_path):
    cache = _import_under_script(tmp_path, MRL_PYCACHE="0")
    assert not cache.exists() and not (tmp_path / "__pycache__").exists()
