"""Task suites: JSONL or YAML files of tasks, loaded with errors that name the file and the line.

A task file lives in `envs/<domain>/tasks/`. JSONL: one JSON object per line (blank lines allowed). YAML:
a list of mappings. Fields: `id` (required), `prompt` (required), `payload` (object, optional),
`domain` (optional; must agree with the domain being loaded), `split` (optional: train or heldout; default
heldout for a file named heldout.*, else train). Unknown fields are errors (a typo is not silently lost).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import yaml

from megatron_rl.envs.base import Task

ENVS_DIR = Path(__file__).resolve().parent
SPLITS = ("train", "heldout")
_FIELDS = {"id", "domain", "prompt", "payload", "split"}


class TaskFileError(ValueError):
    """A malformed task file; the message starts with file:line."""


def _split_default(path: Path) -> str:
    return "heldout" if path.stem.split(".")[0] in ("heldout", "test", "eval") else "train"


def _make_task(obj, path: Path, line: int, domain: str | None) -> Task:
    where = f"{path}:{line}"
    if not isinstance(obj, dict):
        raise TaskFileError(f"{where}: a task must be an object with 'id' and 'prompt', got {type(obj).__name__}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise TaskFileError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
    for name in ("id", "prompt"):
        if name not in obj or obj[name] in (None, ""):
            raise TaskFileError(f"{where}: missing required field {name!r}")
    if not isinstance(obj["prompt"], str):
        raise TaskFileError(f"{where}: 'prompt' must be a string")
    if not isinstance(obj.get("payload", {}), dict):
        raise TaskFileError(f"{where}: 'payload' must be an object")
    task_domain = obj.get("domain") or domain
    if not task_domain:
        raise TaskFileError(f"{where}: no 'domain' field and none given to the loader")
    if domain and task_domain != domain:
        raise TaskFileError(f"{where}: task domain {task_domain!r} differs from the suite's domain {domain!r}")
    split = obj.get("split") or _split_default(path)
    if split not in SPLITS:
        raise TaskFileError(f"{where}: split {split!r} is not one of {list(SPLITS)}")
    return Task(id=str(obj["id"]), domain=task_domain, prompt=obj["prompt"], payload=obj.get("payload") or {},
                split=split, source=where)


def _jsonl_records(path: Path, text: str) -> Iterable[tuple[int, object]]:
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None


def _yaml_records(path: Path, text: str) -> Iterable[tuple[int, object]]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return
        if not isinstance(node, yaml.SequenceNode):
            raise TaskFileError(f"{path}:{node.start_mark.line + 1}: a YAML task file must be a list of tasks")
        for item in node.value:
            yield item.start_mark.line + 1, loader.construct_object(item, deep=True)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise TaskFileError(f"{path}:{mark.line + 1 if mark else '?'}: invalid YAML ({e})") from None
    finally:
        loader.dispose()


def load_task_file(path: str | Path, domain: str | None = None) -> list[Task]:
    """Load one .jsonl/.yaml/.yml task file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TaskFileError(f"{path}: task file not found") from None
    except UnicodeDecodeError as e:
        raise TaskFileError(f"{path}: not UTF-8 ({e})") from None
    if path.suffix == ".jsonl":
        records = _jsonl_records(path, text)
    elif path.suffix in (".yaml", ".yml"):
        records = _yaml_records(path, text)
    else:
        raise TaskFileError(f"{path}: unknown task file type {path.suffix!r}; use .jsonl, .yaml or .yml")
    return [_make_task(obj, path, line, domain) for line, obj in records]


def load_tasks(paths: Iterable[str | Path], domain: str | None = None, split: str | None = None) -> list[Task]:
    """Load several task files; duplicate ids within a domain are an error naming both places."""
    tasks, seen = [], {}
    for path in paths:
        for t in load_task_file(path, domain):
            key = (t.domain, t.id)
            if key in seen:
                raise TaskFileError(f"{t.source}: duplicate task id {t.id!r} (first at {seen[key]})")
            seen[key] = t.source
            tasks.append(t)
    if split is not None:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {list(SPLITS)}")
        tasks = [t for t in tasks if t.split == split]
    return tasks


def builtin_task_files(domain: str) -> list[Path]:
    """The task files shipped in envs/<domain>/tasks/."""
    d = ENVS_DIR / domain / "tasks"
    files = sorted(p for p in d.glob("*") if p.suffix in (".jsonl", ".yaml", ".yml")) if d.is_dir() else []
    if not files:
        raise TaskFileError(f"{d}: no shipped task files for domain {domain!r}; pass task files explicitly")
    return files


FOLDER_DOMAINS = {"harbor": "megatron_rl.envs.harbor.loader:load_harbor"}
"""Domains whose tasks are folders, not task files: domain -> 'module:function(roots, split)'."""


def load_domain(domain: str, files: Iterable[str | Path] | None = None, split: str | None = None,
                **options) -> list[Task]:
    """Tasks of one domain: the given files (folders for a folder domain), the shipped suite, or a task library's
    generated tasks (envs/procedural). `options` go to a folder domain's loader (harbor: images=True) or to the
    generator (`envs.procedural.env.generate`: counts, seed, config)."""
    if domain in FOLDER_DOMAINS:
        import importlib

        module, fn = FOLDER_DOMAINS[domain].split(":")
        return getattr(importlib.import_module(module), fn)(list(files) if files else None, split=split, **options)
    from megatron_rl.envs.procedural import is_procedural

    if not files and is_procedural(domain):  # a task library's generator (options: counts, seed, config)
        from megatron_rl.envs.procedural.env import generate

        return generate(domain, split, **options)
    if options:
        raise ValueError(f"domain {domain!r} takes no loader options, got {sorted(options)}")
    return load_tasks(list(files) if files else builtin_task_files(domain), domain=domain, split=split)


def write_tasks(path: str | Path, tasks: Iterable[Task]) -> None:
    """Write tasks as JSONL (one object per line, keys sorted: byte-stable output)."""
    lines = [json.dumps(t.to_dict(), sort_keys=True, ensure_ascii=False) for t in tasks]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_splits(folder: str | Path, tasks: list[Task], splits: tuple[str, ...] = ("train", "heldout")) -> None:
    """Write `<folder>/<split>.jsonl` for each split (the shipped layout of a domain's task suite)."""
    for split in splits:
        write_tasks(Path(folder) / f"{split}.jsonl", [t for t in tasks if t.split == split])
