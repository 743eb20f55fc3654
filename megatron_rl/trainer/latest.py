"""The run's one "latest checkpoint" pointer: `<run>/checkpoints/latest`, a text file naming the newest complete
checkpoint relative to `<run>/checkpoints` (`step-000005`: an RL checkpoint; `warmup/step-000030`: a warm-up
one). Both phases write it (atomically, after the save is complete) and every reader (resume, eval, export)
reads it through `latest`.

Run folders written before the pointer was shared kept the warm-up's pointer in `<run>/checkpoints/warmup/latest`
(naming `step-N` inside `warmup/`); when `<run>/checkpoints/latest` is absent that file is read instead, so such a
folder resumes its warm-up unchanged."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

Phase = Literal["warmup", "rl"]
POINTER = "latest"
WARMUP = "warmup"
LEGACY_WARMUP_POINTER = Path(WARMUP) / POINTER
"""The warm-up's own pointer in run folders written before the shared one (read, never written)."""


def _name(run_dir: Path) -> str | None:
    """What the pointer names, relative to <run>/checkpoints (the legacy warm-up pointer when it is the only one)."""
    root = Path(run_dir) / "checkpoints"
    if (root / POINTER).exists():
        return (root / POINTER).read_text().strip()
    if (root / LEGACY_WARMUP_POINTER).exists():
        return f"{WARMUP}/{(root / LEGACY_WARMUP_POINTER).read_text().strip()}"
    return None


def phase_of(name: str) -> Phase:
    """The phase that wrote the checkpoint `name` (relative to <run>/checkpoints)."""
    return WARMUP if Path(name).parts[0] == WARMUP else "rl"


def latest(run_dir: Path, phase: Phase | None = None) -> Path | None:
    """The newest complete checkpoint of the run (of `phase` when given: None when the newest is the other
    phase's), or None when the run has none."""
    name = _name(run_dir)
    if name is None or (phase is not None and phase_of(name) != phase):
        return None
    return Path(run_dir) / "checkpoints" / name


def write_latest(run_dir: Path, path: Path) -> None:
    """Point <run>/checkpoints/latest at the complete checkpoint `path` (inside <run>/checkpoints), atomically;
    a legacy warm-up pointer is removed (the shared one supersedes it)."""
    root = Path(run_dir) / "checkpoints"
    tmp = root / f"{POINTER}.tmp"
    tmp.write_text(Path(path).relative_to(root).as_posix() + "\n")
    os.replace(tmp, root / POINTER)
    (root / LEGACY_WARMUP_POINTER).unlink(missing_ok=True)  # one pointer from here on
