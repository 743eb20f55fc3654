"""The sandbox contract: run untrusted code with limits, get a result; nothing survives a run.

Threat model (shared by every backend; each backend module states what it covers and what it does not):
the program, its files and its output are untrusted model output. A backend must never let one run
crash the worker that called it, must report every limit it enforced as a violation, and must clean up
everything the run created. Backends differ in what isolation they give; see their modules.
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field

from megatron_rl.config import ConfigError
from megatron_rl.registry import Registry


@dataclass
class Limits:
    """Resource limits of one sandboxed run."""

    wall_s: float = 10.0
    """Wall-clock limit in seconds; the run is killed after it."""
    cpu_s: float = 10.0
    """CPU-time limit in seconds (RLIMIT_CPU; SIGXCPU past it)."""
    memory_mb: int = 512
    """Memory limit in MiB (cgroup memory where available, else RLIMIT_AS)."""
    pids: int = 64
    """Maximum number of processes/threads inside the sandbox."""
    file_size_mb: int = 16
    """Largest file the program may write, in MiB (RLIMIT_FSIZE)."""
    scratch_mb: int = 64
    """Size of the writable scratch directory, in MiB."""
    output_bytes: int = 1 << 20
    """Bytes of stdout and of stderr kept each; the run is killed when it writes more."""
    network: bool = False
    """Allow network access (off by default; on only for trusted domains)."""
    cpus: float = 1.0
    """CPU bandwidth in cores (cgroup cpu quota); 0 leaves it unlimited."""
    open_files: int = 256
    """Most open file descriptors per process (RLIMIT_NOFILE)."""

    def validate(self) -> None:
        """Raise ConfigError naming the field when a limit is impossible."""
        for name in ("wall_s", "cpu_s", "memory_mb", "pids", "file_size_mb", "scratch_mb", "output_bytes",
                     "open_files"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.cpus < 0:
            raise ConfigError(f"Limits.cpus must be >= 0 (0 = unlimited), got {self.cpus!r}")


@dataclass
class SandboxResult:
    """What one run produced."""

    exit_code: int
    """Exit status of the program (negative: killed by that signal number)."""
    stdout: str
    """Captured standard output, decoded as UTF-8 with replacement, truncated to the output limit."""
    stderr: str
    """Captured standard error, same treatment."""
    wall_s: float
    """Wall-clock time of the run in seconds."""
    cpu_s: float = 0.0
    """CPU time used by the program in seconds, when measurable."""
    violations: list[str] = field(default_factory=list)
    """Limits that were hit, by name: wall, cpu, memory, pids, file_size, output, setup."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Files the caller asked to collect from the scratch directory after the run (missing ones left out)."""
    peak_memory_mb: float = 0.0
    """Peak memory of the run in MiB, when measurable (cgroup); 0 otherwise."""
    notes: list[str] = field(default_factory=list)
    """What the backend could not enforce as asked (e.g. rlimits instead of cgroups), and cleanup trouble."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.violations

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class SandboxUnavailable(RuntimeError):
    """The backend cannot work on this machine (binary missing, namespaces disabled); the message says how to
    fix it."""


class Sandbox(abc.ABC):
    """A backend. `run` must not raise on anything the program does; only on caller errors (a bad file path,
    bad limits). Use as a context manager, or call `close()`, to release what it holds."""

    name: str = "abstract"
    layer = None
    """The per-domain image it runs in (`image_cache.ImageLayer`); None = the bare system."""

    @abc.abstractmethod
    def run(
        self,
        command: list[str] | str,
        files: dict[str, str | bytes] | None = None,
        limits: Limits | None = None,
        stdin: bytes | None = None,
        collect: list[str] | None = None,
        sockets: dict | None = None,
    ) -> SandboxResult:
        """Run `command` (argv list, or a shell string run by /bin/sh -c) in a fresh scratch directory
        holding `files` (relative path -> content); return its result. `collect` names scratch files to
        read back after the run. `sockets`: name -> bind(host_path), Unix sockets the caller listens on that
        the program reaches at /.sandbox/<name> during this run (a backend that cannot bind them into the
        run raises ValueError)."""

    def run_python(
        self,
        source: str,
        files: dict[str, str | bytes] | None = None,
        limits: Limits | None = None,
        stdin: bytes | None = None,
        collect: list[str] | None = None,
        python: str = "python3",
        python_args: tuple[str, ...] = (),
        args: tuple[str, ...] = (),
    ) -> SandboxResult:
        """Run Python `source` as `main.py` in the scratch directory: `python [python_args] main.py [args]`.
        Interpreter options such as `-I` or `-S` (faster start) are the caller's choice."""
        files = dict(files or {})
        if "main.py" in files:
            raise ValueError("run_python writes the program to main.py; rename the file 'main.py' in `files`")
        files["main.py"] = source
        return self.run([python, *python_args, "main.py", *args], files=files, limits=limits, stdin=stdin,
                        collect=collect)

    def zygote(self, name: str, source: str):
        """A forking service (`envs.sandbox.zygote.Zygote`) running trusted `source` in a sandbox of this
        backend's kind, cached by `name` and closed with this sandbox; None where the backend has none (the
        caller then runs its script per request with `run`)."""
        return None

    def close(self) -> None:
        """Release anything the backend holds (worker slots, cgroups)."""
        return None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


SANDBOXES: Registry[type[Sandbox]] = Registry("sandbox backend", entry_point_group="megatron_rl.sandboxes")
