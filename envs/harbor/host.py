"""Whether this host meets a task's `EnvironmentSpec`: the bubblewrap sandbox mounts the host's /usr read-only,
so every package a Dockerfile installs must already be installed here (nothing is installed at run time).

Checks: the FROM python version equals the host's `python3`; each apt package is installed (`dpkg-query`,
with its version when pinned); each pip requirement is importable metadata of the host `python3` (with its
version when pinned with ==). A miss raises `MissingPackage` naming the package and the fix.
"""
from __future__ import annotations

import functools
import json
import re
import subprocess

from megatron_rl.envs.harbor.spec import EnvironmentSpec

HOST_PYTHON = "/usr/bin/python3"
_PIP_Q = ("import importlib.metadata as m, json, sys\nout = {}\nfor n in sys.argv[1:]:\n    try:\n"
          "        out[n] = m.version(n)\n    except m.PackageNotFoundError:\n        out[n] = None\n"
          "print(json.dumps(out))")


class MissingPackage(RuntimeError):
    """A package (or base python) a task needs is not on this host."""


@functools.cache
def host_python_version() -> str:
    out = subprocess.run([HOST_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


@functools.cache
def apt_version(name: str) -> str | None:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Status}\t${Version}", name], capture_output=True, text=True,
                             timeout=30)
    except FileNotFoundError:
        return None
    status, _, version = out.stdout.partition("\t")
    return version if out.returncode == 0 and status.endswith(" installed") else None


def pip_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    out = subprocess.run([HOST_PYTHON, "-I", "-c", _PIP_Q, *names], capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout or "{}")


def check_host(spec: EnvironmentSpec, where: str) -> None:
    """Raise MissingPackage when the host lacks something `spec` needs."""
    m = re.match(r"^python:(\d+\.\d+)", spec.base)
    if m and m.group(1) != host_python_version():
        raise MissingPackage(f"{where}: FROM {spec.base} needs python {m.group(1)}; this host's python3 is "
                             f"{host_python_version()} (use FROM python:{host_python_version()}-slim or debian)")
    for pkg in spec.apt:
        name, _, want = pkg.partition("=")
        have = apt_version(name)
        if have is None or (want and have != want):
            raise MissingPackage(f"{where}: apt package {pkg!r} is not installed on this host "
                                 f"({'have ' + have if have else 'missing'}): `apt-get install {name}` here first")
    reqs = {re.split(r"[=<>!~\[]", p)[0]: p for p in spec.pip}
    found = pip_versions(tuple(reqs)) if reqs else {}
    for name, req in reqs.items():
        want = req.split("==", 1)[1] if "==" in req else ""
        have = found.get(name)
        if have is None or (want and have != want):
            raise MissingPackage(f"{where}: pip package {req!r} is not installed for {HOST_PYTHON} "
                                 f"({'have ' + have if have else 'missing'}): install it on the host first")
