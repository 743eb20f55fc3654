"""A Harbor task's environment/ as a per-domain sandbox image (`envs.sandbox.image`): the Debian and pip packages
its Dockerfile installs that this host lacks.

The image is a layer over the node's Debian system (the sandbox keeps the host's /usr and python), so the
FROM python version must equal the host's python3 (refused otherwise, naming both), packages the host
already has at the asked version come from the host, and only the others go into the image. COPY'd files,
WORKDIR and ENV stay where `envs.harbor.loader` puts them (the workspace at /work, exported per command):
they are the task's, not the image's. Two tasks needing the same packages share one image (same digest).
"""
from __future__ import annotations

import re

from megatron_rl.envs.harbor.host import MissingPackage, apt_version, host_python_version, pip_versions
from megatron_rl.envs.harbor.spec import EnvironmentSpec
from megatron_rl.envs.sandbox.image import ImageSpec

DEB_DIRS = ["/var/cache/apt/archives"]
"""Local .deb folders searched before `apt-get download` (a site with a package mirror on disk adds it here)."""
WHEEL_DIRS: list[str] = []
"""Local wheel folders for pip (`--find-links`); with PIP_NO_INDEX, the only source (offline sites)."""
PIP_NO_INDEX = False


def image_spec(spec: EnvironmentSpec, where: str) -> ImageSpec | None:
    """The image holding what `spec` needs beyond this host; None when the host has it all."""
    m = re.match(r"^python:(\d+\.\d+)", spec.base)
    if m and m.group(1) != host_python_version():
        raise MissingPackage(f"{where}: FROM {spec.base} needs python {m.group(1)}; the sandbox image goes over this "
                             f"host's python3 {host_python_version()} (use FROM python:{host_python_version()}-slim)")
    apt = []
    for pkg in spec.apt:
        name, _, want = pkg.partition("=")
        have = apt_version(name)
        if have is None or (want and have != want):
            apt.append(pkg)
    reqs = {re.split(r"[=<>!~\[]", p)[0]: p for p in spec.pip}
    found = pip_versions(tuple(reqs)) if reqs else {}
    pip = [req for name, req in reqs.items()
           if found.get(name) is None or ("==" in req and found[name] != req.split("==", 1)[1])]
    if not apt and not pip:
        return None
    return ImageSpec(name=f"harbor-{spec.base}", base=spec.base, apt=apt, pip=pip, deb_dirs=list(DEB_DIRS),
                     pip_find_links=list(WHEEL_DIRS), pip_no_index=PIP_NO_INDEX)
