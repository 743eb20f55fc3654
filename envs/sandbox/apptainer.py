"""Apptainer / Singularity backend, for clusters that provide it (it cannot be installed on the dev machines).

THREAT MODEL
Covered (as Apptainer provides it, run unprivileged): `--containall` gives new pid, ipc and mount
namespaces, a minimal /dev, no host home or /tmp, and a clean environment (`--cleanenv`, `--no-home`);
`--net --network none` gives a network namespace with only loopback; the image is read-only, the only
writable host path is the run's scratch directory bound on /work (a fresh directory, removed after the
run); the run's process group is killed after it, and the pid namespace takes its descendants with it.
Limits: RLIMIT_CPU/FSIZE/NOFILE/AS per process, wall timeout and output caps (killed at the cap), all
named like the other backends; with `cgroup_flags=True` Apptainer's own `--memory`, `--memory-swap`,
`--pids-limit` and `--cpus` as well (needs cgroups v2 delegation or root on the cluster).
Not covered: the program runs as the worker's own uid (no per-slot uid: concurrent runs are separated by
their pid namespaces only, and RLIMIT_NPROC is not set because it would count the worker's processes);
without `cgroup_flags` memory is an address-space limit per process and pids are unlimited; scratch size
is checked after the run only; no seccomp filter; a domain image (`layer`) is the store's squashfs given to
`--overlay FILE:ro` (or, for a tar image, its extracted /usr/local and /opt bound read-only); the site's
apptainer.conf decides what else is mounted (e.g. `bind path` entries) - review it. Tests on the dev
machines check only the generated command line and the error when the binary is missing.
"""
from __future__ import annotations

import os
import shutil

from megatron_rl.envs.sandbox.base import SANDBOXES, Limits, Sandbox, SandboxResult, SandboxUnavailable
from megatron_rl.envs.sandbox.image_cache import ImageLayer
from megatron_rl.envs.sandbox.subprocess_backend import _argv, run_in_scratch

_HINT = ("install Apptainer (https://apptainer.org/docs/admin/main/installation.html) or `module load "
         "apptainer` on the cluster, pass binary=/path/to/apptainer, or use backend 'bwrap'")


def find_apptainer(binary: str | None = None) -> str | None:
    """The apptainer (or singularity) executable: `binary` if it exists, else the first on PATH."""
    if binary is not None:
        return binary if os.path.isfile(binary) and os.access(binary, os.X_OK) else shutil.which(binary)
    return shutil.which("apptainer") or shutil.which("singularity")


@SANDBOXES.register("apptainer")
class ApptainerSandbox(Sandbox):
    """Runs each command with `apptainer exec` in `image` (a .sif file or an unpacked directory).

    require_binary=False builds command lines without an installed apptainer (for inspection and tests);
    running then fails with SandboxUnavailable.
    """

    name = "apptainer"

    def __init__(self, image: str | None = None, *, limits: Limits | None = None, binary: str | None = None,
                 require_binary: bool = True, cgroup_flags: bool = False, env: dict[str, str] | None = None,
                 scratch_parent: str | None = None, layer: ImageLayer | None = None):
        if not image:
            raise ValueError("the apptainer sandbox needs `image`: a .sif file or an unpacked image directory")
        self.image = image
        self.binary = find_apptainer(binary)
        if self.binary is None and require_binary:
            what = f"{binary!r}" if binary else "'apptainer' or 'singularity' on PATH"
            raise SandboxUnavailable(f"Apptainer not found ({what}): {_HINT}")
        self.default_limits = limits or Limits()
        self.default_limits.validate()
        self.cgroup_flags = cgroup_flags
        self.layer = layer
        self.env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp",
                    "LANG": "C.UTF-8", **(layer.env if layer else {}), **(env or {})}
        self.scratch_parent = scratch_parent

    def command_line(self, command, scratch: str, limits: Limits | None = None) -> list[str]:
        """The exact argv that runs `command` with `scratch` bound on /work under `limits`."""
        limits = limits or self.default_limits
        a = [self.binary or "apptainer", "exec", "--containall", "--no-home", "--cleanenv"]
        if not limits.network:
            a += ["--net", "--network", "none"]
        a += ["--bind", f"{scratch}:/work", "--pwd", self.layer.workdir if self.layer else "/work"]
        if self.layer is not None and self.layer.file.endswith(".sqfs"):
            a += ["--overlay", f"{self.layer.file}:ro"]  # the store's squashfs, overlaid read-only on the base image
        elif self.layer is not None:
            for src, dst in self.layer.mounts():
                a += ["--bind", f"{src}:{dst}:ro"]
        for k, v in self.env.items():
            a += ["--env", f"{k}={v}"]
        if self.cgroup_flags:
            a += ["--memory", f"{limits.memory_mb}M", "--memory-swap", f"{limits.memory_mb}M",
                  "--pids-limit", str(limits.pids)]
            if limits.cpus > 0:
                a += ["--cpus", f"{limits.cpus:g}"]
        return a + [self.image, *_argv(command)]

    def run(self, command, files=None, limits=None, stdin=None, collect=None, sockets=None) -> SandboxResult:
        if sockets:
            raise ValueError("the apptainer backend cannot bind Unix sockets into a run (agent episodes need "
                             "them); use sandbox.backend=bwrap")
        limits = limits or self.default_limits
        limits.validate()
        _argv(command)
        if self.binary is None:
            raise SandboxUnavailable(f"Apptainer not found: {_HINT}")
        notes = [] if self.cgroup_flags else ["apptainer: memory is RLIMIT_AS per process; pids not limited"]
        return run_in_scratch(lambda scratch: self.command_line(command, scratch, limits), files, limits, stdin,
                              collect, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, notes=notes,
                              scratch_parent=self.scratch_parent)
