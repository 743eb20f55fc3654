"""A Harbor task's `environment/Dockerfile` as a spec: the subset that Debian/pip packages and files can meet.

Accepted instructions (one per logical line; `\\` continuations joined, `#` comments and blank lines skipped):
- `FROM <base>`: a Debian base - `debian:<tag>` or `python:<version>[-<variant>]` (Debian-based images); the
  python version is checked against the host's by `envs.harbor.host`.
- `RUN` of `&&`-chained `apt-get update`, `apt-get|apt install [flags] PKG...`, `pip|pip3|python3 -m pip
  install [flags] PKG...` and the usual cleanups (`rm -rf /var/lib/apt/lists/*`, `apt-get clean`).
- `COPY [--chown=...] SRC... DEST`: files of the build context (environment/) into the workspace.
- `WORKDIR <dir>`: the task's working directory (the workspace root; see `envs.harbor.paths`).
- `ENV K=V ...` / `ENV K V`: environment variables of every command the agent and the tests run.
Anything else (`USER`, `EXPOSE`, `CMD`, `ADD`, `ARG`, a RUN that is not only package installs, `COPY --from`,
a multi-stage build ...) is refused with `UnsupportedInstruction` naming the instruction and its line, before
any episode runs.

`EnvironmentSpec` is plain data (`to_dict`/`from_dict`): `envs.harbor.image` turns its packages that the host
lacks into a sandbox image spec (`envs.sandbox.image`, with `envs.domains.harbor.image: dockerfile`); without
that, `envs.harbor.host` checks the packages on the host.
"""
from __future__ import annotations

import dataclasses
import posixpath
import re
import shlex
from dataclasses import dataclass, field

_PKG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+_-]*([=<>!~]=?[A-Za-z0-9.*+_-]+)?(\[[A-Za-z0-9,_-]+\])?$")
_APT_LISTS = ("/var/lib/apt/lists/*", "/var/lib/apt/lists")
_APT_FLAGS = {"-y", "--yes", "-q", "-qq", "--no-install-recommends", "--quiet", "--assume-yes"}
_PIP_FLAGS = {"--no-cache-dir", "-q", "--quiet", "--break-system-packages", "--upgrade", "-U", "--user"}


class UnsupportedInstruction(ValueError):
    """A Dockerfile instruction this backend cannot honour; the message names the file, line and instruction."""


@dataclass
class EnvironmentSpec:
    """What a task's environment needs, as data an image builder or the host check can consume."""

    base: str = "debian:bookworm"
    """The FROM image (a Debian base)."""
    apt: list[str] = field(default_factory=list)
    """Debian packages (`name` or `name=version`)."""
    pip: list[str] = field(default_factory=list)
    """Python requirements (`name` or `name==version`)."""
    copies: list[tuple[str, str]] = field(default_factory=list)
    """(source relative to environment/, absolute destination) per COPY source, in order."""
    workdir: str = "/app"
    """The working directory (the last WORKDIR; Harbor tasks conventionally use /app)."""
    env: dict[str, str] = field(default_factory=dict)
    """ENV variables, in order."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EnvironmentSpec:
        return cls(**{**d, "copies": [tuple(c) for c in d.get("copies", [])]})


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction text) with continuations joined and comments dropped."""
    out, buf, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        start = start or n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append((start, buf + line))
        buf, start = "", 0
    if buf:
        out.append((start, buf))
    return out


def parse_dockerfile(text: str, where: str = "Dockerfile") -> EnvironmentSpec:
    """The spec of a Dockerfile; `UnsupportedInstruction` for anything outside the accepted subset."""
    spec, seen_from = EnvironmentSpec(), False
    for n, line in logical_lines(text):
        word, _, rest = line.partition(" ")
        op, rest = word.upper(), rest.strip()
        fail = _failer(where, n, line)
        if op == "FROM":
            if seen_from:
                raise fail("multi-stage builds are not supported")
            spec.base, seen_from = _base(rest, fail), True
        elif not seen_from:
            raise fail("the first instruction must be FROM")
        elif op == "RUN":
            _run(rest, spec, fail)
        elif op == "COPY":
            _copy(rest, spec, fail)
        elif op == "WORKDIR":
            spec.workdir = _workdir(rest, spec.workdir, fail)
        elif op == "ENV":
            spec.env.update(_env(rest, fail))
        else:
            raise fail(f"instruction {op} is not supported (only FROM, RUN package installs, COPY, WORKDIR, ENV)")
    if not seen_from:
        raise UnsupportedInstruction(f"{where}: no FROM instruction")
    return spec


def _failer(where: str, n: int, line: str):
    return lambda why: UnsupportedInstruction(f"{where}:{n}: {line[:120]!r}: {why}")


def _base(rest: str, fail) -> str:
    image = rest.split()[0] if rest else ""
    name = image.split(":")[0].removeprefix("docker.io/").removeprefix("library/")
    if " as " in rest.lower() or rest.startswith("--") or name not in ("debian", "python"):
        raise fail("FROM must name a Debian base (debian:<tag> or python:<version>[-slim|-bookworm])")
    return image


def _run(rest: str, spec: EnvironmentSpec, fail) -> None:
    if rest.startswith("["):
        raise fail("RUN in exec form is not supported; use the shell form of package installs")
    if re.search(r"[;|`$<>()]", rest) or "&" in rest.replace("&&", ""):
        raise fail("RUN may only chain package installs with &&")
    for part in rest.split("&&"):
        try:
            argv = shlex.split(part)
        except ValueError as e:
            raise fail(f"cannot parse the command ({e})") from None
        if _harmless(argv):
            continue
        kind, pkgs = _install(argv)
        if kind is None:
            raise fail(f"RUN {part.strip()!r} is not a package install (apt-get install / pip install)")
        bad = [p for p in pkgs if not _PKG.match(p)]
        if bad or not pkgs:
            raise fail(f"package name(s) {bad or '(none)'} not supported (use name or name==version)")
        getattr(spec, kind).extend(pkgs)


def _harmless(argv: list[str]) -> bool:
    """apt-get/apt update or clean (with flags only), or removing the apt lists: nothing to do here."""
    words = [a for a in argv if not a.startswith("-")]
    if argv[:1] in (["apt-get"], ["apt"]) and words[1:] in (["update"], ["clean"]):
        return True
    return argv[:2] in (["rm", "-rf"], ["rm", "-fr"]) and bool(argv[2:]) and all(a in _APT_LISTS for a in argv[2:])


def _install(argv: list[str]) -> tuple[str | None, list[str]]:
    if argv[:2] in (["apt-get", "install"], ["apt", "install"]):
        flags, kind = _APT_FLAGS, "apt"
        args = argv[2:]
    elif argv[:2] in (["pip", "install"], ["pip3", "install"]) or argv[:4] == ["python3", "-m", "pip", "install"]:
        flags, kind = _PIP_FLAGS, "pip"
        args = argv[2:] if argv[0] != "python3" else argv[4:]
    else:
        return None, []
    if any(a.startswith("-") and a not in flags for a in args):
        return None, []
    return kind, [a for a in args if not a.startswith("-")]


def _copy(rest: str, spec: EnvironmentSpec, fail) -> None:
    args = shlex.split(rest)
    while args and args[0].startswith(("--chown=", "--chmod=")):
        args = args[1:]
    if not args or args[0].startswith("--") or len(args) < 2 or rest.lstrip().startswith("["):
        raise fail("COPY takes SRC... DEST (no --from, no JSON form)")
    dest = posixpath.normpath(posixpath.join(spec.workdir, args[-1]))  # an absolute DEST replaces the workdir
    dest += "/" if args[-1].endswith(("/", "/.", ".")) or len(args) > 2 else ""
    for src in args[:-1]:
        norm = posixpath.normpath(src)
        if norm.startswith("..") or src.startswith("/") or any(c in src for c in "*?["):
            raise fail(f"COPY source {src!r} must be a plain path inside environment/ (no globs)")
        spec.copies.append((norm, dest))


def _workdir(rest: str, current: str, fail) -> str:
    if not rest or "$" in rest or " " in rest:
        raise fail("WORKDIR takes one literal path")
    path = posixpath.normpath(rest if rest.startswith("/") else posixpath.join(current, rest))
    if path == "/" or path.split("/")[1] in ("usr", "etc", "bin", "lib", "proc", "dev", "sys", "tmp", "work"):
        raise fail(f"WORKDIR {path} would shadow a system directory; use a directory such as /app")
    return path


def _env(rest: str, fail) -> dict[str, str]:
    try:
        args = shlex.split(rest)
    except ValueError as e:
        raise fail(f"cannot parse ENV ({e})") from None
    if args and "=" not in args[0]:
        if len(args) < 2:
            raise fail("ENV needs K=V or K V")
        return {args[0]: " ".join(args[1:])}
    out = {}
    for a in args:
        k, eq, v = a.partition("=")
        if not eq or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k) or "$" in v:
            raise fail(f"ENV {a!r}: need K=V with a literal value")
        out[k] = v
    return out
