"""Typed configuration: YAML files and dotted command-line overrides load into component dataclasses.

Each component owns a small `@dataclass` whose every field carries a one-line docstring (a string literal
on the line after the field). This module turns plain data (YAML) into those dataclasses strictly:

- unknown keys are rejected, naming the full dotted key and the closest known one;
- values are type-checked against the annotations (int, float, bool, str, Optional, Literal, list, tuple,
  dict, Enum and nested dataclasses); an int is accepted for a float, nothing else is coerced;
- a dataclass may rewrite its raw mapping before that (a static `prepare_config(data, prefix)`: `envs.domains`
  patterns expand to the domains they match);
- after construction every dataclass's `validate()` (if it has one) runs, innermost first, so impossible
  combinations fail before any work starts. `validate()` is pure; what a config names outside itself (the
  checkpoint of model.init) is read in the dataclass's `resolve_sources()`, which runs just before it.

Overrides use dotted keys: `train.lr=1e-6 parallel.tp=2 model.moe.num_experts=8`; values are parsed as
YAML scalars (with `1e-6`-style floats accepted).
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import enum
import functools
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the reason."""


# ----------------------------------------------------------------------------------------------- docs
@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings of a dataclass's fields (string literal right after each field)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def undocumented_fields(cls: type) -> list[str]:
    """Fields of `cls` (and nested config dataclasses) that have no docstring, as dotted names."""
    missing, docs = [], field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name not in docs:
            missing.append(f"{cls.__name__}.{f.name}")
        sub = _dataclass_in(_hints(cls)[f.name])
        if sub is not None:
            missing += undocumented_fields(sub)
    return missing


# ------------------------------------------------------------------------------------------ loading
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass inside `tp` (itself, or X in Optional[X]); None if there is none."""
    if dataclasses.is_dataclass(tp):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if _is_union(tp) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`; build nested dataclasses. Raises ConfigError naming `key`."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=key)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        return _convert_union(value, args, key)
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:  # YAML 1.1 reads off/on as booleans
            value = "on" if value else "off"
        if value not in args:
            raise ConfigError(f"config key '{key}': {value!r} is not one of {list(args)}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        return _convert_sequence(value, tp, origin or tp, args, key)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {k: _convert(v, vt, f"{key}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return value if isinstance(value, tp) else tp(value)
        except ValueError:
            raise ConfigError(f"config key '{key}': {value!r} is not one of {[m.value for m in tp]}") from None
    return _convert_scalar(value, tp, key)


def _convert_union(value: Any, args: tuple, key: str) -> Any:
    if value is None and type(None) in args:
        return None
    errors = []
    for a in args:
        if a is type(None):
            continue
        try:
            return _convert(value, a, key)
        except ConfigError as e:
            errors.append(str(e))
    names = " or ".join(_type_name(a) for a in args)
    raise ConfigError(f"config key '{key}': expected {names}, got {value!r}")


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _convert_sequence(value: Any, tp: Any, origin: Any, args: tuple, key: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"config key '{key}': expected a list, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise ConfigError(f"config key '{key}': expected {len(args)} items, got {len(value)}")
        return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    et = args[0] if args else Any
    items = [_convert(v, et, f"{key}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _convert_scalar(value: Any, tp: Any, key: str) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 (PyYAML) reads `1e-5` (no dot) as a string
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"config key '{key}': expected {tp.__name__}, got bool {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(
            f"config key '{key}': expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def from_dict(cls: type[T], data: dict | None, prefix: str = "", base: Any = None) -> T:
    """Build dataclass `cls` from a mapping, strictly (see module docstring).

    A nested section given in part starts from the defaults its parent declares for it (e.g. a parent's
    `field(default_factory=lambda: Optim(lr=2e-4))`), not from the nested class's own defaults; `base` is
    that starting instance."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix or cls.__name__}': expected a mapping, got {data!r}")
    prepare = getattr(cls, "prepare_config", None)
    if callable(prepare):  # the class rewrites its raw mapping first (envs: domain patterns)
        data = prepare(data, prefix)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in data:
        if k not in fields:
            raise ConfigError(_unknown_key_message(cls, prefix, k, list(fields)))
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        sub = _dataclass_in(_hints(cls)[name])
        if sub is not None and isinstance(value, dict):
            start = getattr(base, name) if base is not None else _field_default(fields[name])
            kwargs[name] = from_dict(sub, value, prefix=key, base=start if isinstance(start, sub) else None)
        else:
            kwargs[name] = _convert(value, _hints(cls)[name], key)
    if base is not None:
        for name in fields:
            kwargs.setdefault(name, copy.deepcopy(getattr(base, name)))
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field missing
        raise ConfigError(f"config section '{prefix or cls.__name__}': {e}") from None
    _validate_one(obj, prefix)
    return obj


def _unknown_key_message(cls: type, prefix: str, key: str, known: list[str]) -> str:
    full = f"{prefix}.{key}" if prefix else key
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown config key '{full}'{hint}; {cls.__name__} accepts: {', '.join(sorted(known))}"


def _validate_one(obj: Any, prefix: str) -> None:
    """The resolve step (`resolve_sources()`: read what the config names on disk, e.g. a checkpoint's shape),
    then the pure `validate()`, of one config object that defines them."""
    for step in ("resolve_sources", "validate"):
        method = getattr(obj, step, None)
        if not callable(method):
            continue
        try:
            method()
        except ConfigError as e:
            where = f"config section '{prefix}': " if prefix else ""
            raise ConfigError(f"{where}{e}") from None


def validate(obj: Any, prefix: str = "") -> None:
    """Run `resolve_sources()` and `validate()` on `obj` and every nested dataclass, innermost first (for objects
    built in code)."""
    for f in dataclasses.fields(obj):
        sub = getattr(obj, f.name)
        if dataclasses.is_dataclass(sub):
            validate(sub, f"{prefix}.{f.name}" if prefix else f.name)
    _validate_one(obj, prefix)


def to_dict(obj: Any) -> Any:
    """Plain data (for YAML/JSON) from a config dataclass; round-trips through `from_dict`."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


# ---------------------------------------------------------------------------------------- overrides
def parse_override_value(text: str) -> Any:
    """A YAML scalar/list/mapping; `1e-6` (which YAML 1.1 reads as a string) becomes a float."""
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override value {text!r} is not valid YAML: {e}") from None
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".en") else int(value)
        except ValueError:
            pass
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set dotted keys in a nested mapping: ['train.lr=1e-6', 'parallel.tp=2']; returns a new mapping."""
    data = copy.deepcopy(data) if data else {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. train.lr=1e-6)")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty key part in {key!r}")
        node = data
        for i, p in enumerate(parts[:-1]):
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[:i + 1])}' is a value, not a section")
            node = child
        node[parts[-1]] = parse_override_value(text)
    return data


def read_yaml_mapping(path: str | Path) -> dict:
    """The top-level mapping of a YAML config file; ConfigError naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load `cls` from a YAML file (optional) plus dotted overrides."""
    data = read_yaml_mapping(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides or []))
