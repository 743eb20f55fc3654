"""Harbor task folders (the Terminal-Bench 2.0 format) -> `Task`s of the `harbor` domain.

A task folder holds `instruction.md` (the prompt), `task.toml` (`[agent] timeout_sec`, `[verifier] timeout_sec`
and `env`, `[environment] cpus`, `memory_mb`/`memory`, `storage_mb`/`storage`, while `gpus`/`tpu` are refused;
`[metadata]` free-form),
`tests/test.sh` (+ its files; writes the reward to /logs/verifier/reward.txt, or reward.json
`{"reward": x}`), `solution/solve.sh` (the oracle) and `environment/Dockerfile` (+ its build context).
The task id is the folder name. Loading parses the Dockerfile (`envs.harbor.spec`: unsupported instructions are
refused, naming the line), checks its packages on this host (`envs.harbor.host`) - or, with `images=True`
(`envs.domains.harbor.image: dockerfile`), puts those the host lacks in the task's sandbox image
(`envs.harbor.image`) - places the COPY'd files in
the initial workspace and rewrites absolute paths for the sandbox (`envs.harbor.paths`).

Split rule: `[metadata] split = "train" | "heldout"` ("test" means heldout) when given; otherwise a task is
heldout when the first byte of sha256(task id) is below 52 (~20%, stable across machines and task sets).
"""
from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

import tomllib

from megatron_rl.envs.base import Task
from megatron_rl.envs.harbor import paths
from megatron_rl.envs.harbor.host import check_host
from megatron_rl.envs.harbor.image import image_spec
from megatron_rl.envs.harbor.spec import EnvironmentSpec, UnsupportedInstruction, parse_dockerfile

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DEFAULT_TIMEOUT_S = 600.0  # Harbor's default agent and verifier timeouts
MAX_FILE_BYTES = 1 << 20


class HarborTaskError(ValueError):
    """A malformed task folder; the message names the folder and the file."""


def encode_files(files: dict[str, bytes]) -> dict[str, dict[str, str]]:
    """{"text": {path: str}, "b64": {path: base64}}: JSON-safe, UTF-8 files kept readable."""
    out: dict[str, dict[str, str]] = {"text": {}, "b64": {}}
    for p, data in files.items():
        try:
            out["text"][p] = data.decode("utf-8")
        except UnicodeDecodeError:
            out["b64"][p] = base64.b64encode(data).decode()
    return out


def decode_files(enc: dict, prefix: str = "") -> dict[str, bytes]:
    files = {prefix + p: t.encode() for p, t in (enc.get("text") or {}).items()}
    files.update({prefix + p: base64.b64decode(b) for p, b in (enc.get("b64") or {}).items()})
    return files


def read_tree(folder: Path, where: str) -> dict[str, bytes]:
    """Regular files below `folder` by relative path (symlinks refused)."""
    out = {}
    for f in sorted(folder.rglob("*")):
        if f.is_symlink():
            raise HarborTaskError(f"{where}: {f} is a symlink; task folders hold regular files only")
        if f.is_file() and "__pycache__" not in f.parts:
            if f.stat().st_size > MAX_FILE_BYTES:
                raise HarborTaskError(f"{where}: {f} is over {MAX_FILE_BYTES} bytes")
            out[f.relative_to(folder).as_posix()] = f.read_bytes()
    return out


def _rewritten(files: dict[str, bytes], workdir: str) -> dict[str, bytes]:
    out = {}
    for p, data in files.items():
        try:
            out[p] = paths.rewrite(data.decode("utf-8"), workdir).encode()
        except UnicodeDecodeError:
            out[p] = data
    return out


def initial_files(folder: Path, spec: EnvironmentSpec, where: str) -> dict[str, bytes]:
    """The workspace COPY places: build-context files at their paths under the WORKDIR."""
    ctx, out = folder / "environment", {}
    for src, dest in spec.copies:
        rel = paths.workspace_path(dest.rstrip("/") or "/", spec.workdir)
        if rel is None:
            raise UnsupportedInstruction(f"{where}: COPY {src} {dest}: destination outside WORKDIR {spec.workdir} "
                                         "(only the workspace is writable in this sandbox)")
        path = ctx / src
        if path.is_dir():
            for p, data in read_tree(path, where).items():
                out[_join(rel, p)] = data
        elif path.is_file():
            name = _join(rel, Path(src).name) if dest.endswith("/") or not rel else rel
            out[name] = path.read_bytes()
        else:
            raise HarborTaskError(f"{where}: COPY source {src!r} not found in environment/")
    return out


def _join(a: str, b: str) -> str:
    return f"{a}/{b}" if a else b


def _size_mb(env: dict, key: str) -> int | None:
    if f"{key}_mb" in env:
        return int(env[f"{key}_mb"])
    if key in env:  # "2G", "512M" (the older form)
        m = re.match(r"^(\d+(?:\.\d+)?)\s*([GgMm])", str(env[key]))
        if not m:
            raise ValueError(f"[environment] {key} = {env[key]!r}: use e.g. '2G' or {key}_mb = 2048")
        return int(float(m.group(1)) * (1024 if m.group(2) in "Gg" else 1))
    return None


def task_limits(cfg: dict) -> dict:
    """The limits task.toml declares (None where it declares none; the environment applies its caps)."""
    env = cfg.get("environment") or {}
    if env.get("gpus") or env.get("tpu"):
        raise ValueError("[environment] asks for GPUs/TPUs; this sandbox gives none (drop the task or the key)")
    return {"agent_s": float((cfg.get("agent") or {}).get("timeout_sec", DEFAULT_TIMEOUT_S)),
            "verifier_s": float((cfg.get("verifier") or {}).get("timeout_sec", DEFAULT_TIMEOUT_S)),
            "cpus": float(env["cpus"]) if "cpus" in env else None,
            "memory_mb": _size_mb(env, "memory"), "storage_mb": _size_mb(env, "storage")}


def split_of(name: str, cfg: dict, where: str) -> str:
    split = (cfg.get("metadata") or {}).get("split")
    if split is None:
        return "heldout" if hashlib.sha256(name.encode()).digest()[0] < 52 else "train"
    split = {"test": "heldout"}.get(split, split)
    if split not in ("train", "heldout"):
        raise HarborTaskError(f"{where}/task.toml: metadata.split {split!r} must be train, heldout or test")
    return split


def _need(folder: Path, rel: str) -> Path:
    p = folder / rel
    if not p.is_file():
        raise HarborTaskError(f"{folder}: missing {rel} (a Harbor task needs instruction.md, task.toml, "
                              "tests/test.sh and environment/Dockerfile)")
    return p


def load_task_folder(folder: str | Path, check: bool = True, images: bool = False) -> Task:
    """One task folder as a Task; `check`: refuse packages missing on this host, or with `images` put them in
    the task's sandbox image instead (`payload["image"]`, an ImageSpec dict; `envs.harbor.image`)."""
    folder = Path(folder)
    where = str(folder)
    try:
        cfg = tomllib.loads(_need(folder, "task.toml").read_text(encoding="utf-8"))
        limits = task_limits(cfg)
    except (tomllib.TOMLDecodeError, ValueError, TypeError) as e:
        raise HarborTaskError(f"{where}/task.toml: {e}") from None
    spec = parse_dockerfile(_need(folder, "environment/Dockerfile").read_text(encoding="utf-8"),
                            f"{where}/environment/Dockerfile")
    image = None
    if images:
        image = image_spec(spec, where)
    elif check:
        check_host(spec, where)
    _need(folder, "tests/test.sh")
    wd = spec.workdir
    sol = folder / "solution"
    venv = {k: paths.rewrite(str(v), wd) for k, v in ((cfg.get("verifier") or {}).get("env") or {}).items()}
    payload = {"files": encode_files(_rewritten(initial_files(folder, spec, where), wd)),
               "tests": encode_files(_rewritten(read_tree(folder / "tests", where), wd)),
               "solution": encode_files(_rewritten(read_tree(sol, where), wd) if sol.is_dir() else {}),
               "env": {k: paths.rewrite(v, wd) for k, v in spec.env.items()}, "verifier_env": venv,
               "limits": limits, "spec": spec.to_dict(), "image": image.to_dict() if image else None}
    prompt = paths.rewrite(_need(folder, "instruction.md").read_text(encoding="utf-8"), wd).strip()
    return Task(id=folder.name, domain="harbor", prompt=prompt, payload=payload,
                split=split_of(folder.name, cfg, where), source=where)


def task_folders(roots: Iterable[str | Path]) -> list[Path]:
    """Each root is a task folder (it has task.toml) or a folder of task folders."""
    out = []
    for root in map(Path, roots):
        if not root.is_dir():
            raise HarborTaskError(f"{root}: not a folder of Harbor tasks")
        out += [root] if (root / "task.toml").is_file() else sorted(p for p in root.iterdir()
                                                                    if (p / "task.toml").is_file())
    return out


def load_harbor(roots: Iterable[str | Path] | None = None, split: str | None = None, check: bool = True,
                images: bool = False) -> list[Task]:
    """Tasks of the given folders (default: the shipped envs/harbor/tasks), optionally one split; `images`: see
    `load_task_folder`."""
    folders = task_folders(list(roots) if roots else [TASKS_DIR])
    if not folders:
        raise HarborTaskError(f"{list(roots or [TASKS_DIR])}: no task folders (each needs a task.toml)")
    seen: dict[str, Path] = {}
    for f in folders:
        if f.name in seen:
            raise HarborTaskError(f"{f}: duplicate task id {f.name!r} (also {seen[f.name]})")
        seen[f.name] = f
    tasks = [load_task_folder(f, check, images) for f in folders]
    return [t for t in tasks if split is None or t.split == split]
