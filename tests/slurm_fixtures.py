"""The `slurm_cluster` session fixture: a real single-host Slurm cluster from `slurm/dev-cluster.sh`.

Started on first use (only when a selected test asks for it), shared by the whole session, stopped at
session end when this or another pytest session started it and no other session still uses it. A
cluster that was already up without pytest (a developer's `slurm/dev-cluster.sh start`) is reused and
left running. State dir: $MRL_SLURM_STATE, default /tmp/megatron-rl-slurm (kept between sessions:
a warm start is ~2 s, a cold one ~5 s; job ids continue, so submitit folders must still be fresh
per test -- use tmp_path).

    def test_x(slurm_cluster):
        out = slurm_cluster.run(["srun", "-p", slurm_cluster.cpu_partition, "-n2", "hostname"])
        slurm_cluster.patch_env(monkeypatch)   # for libraries that read os.environ (submitit)
"""
from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "dev-cluster.sh"
DEFAULT_STATE = "/tmp/megatron-rl-slurm"
# Launcher variables from an outer job must not leak into commands run against the dev cluster.
_LEAKY_PREFIXES = ("SLURM_", "SLURMD_", "SBATCH_", "SALLOC_", "SRUN_", "OMPI_", "PMIX_", "PMI_")
_LEAKY_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _tail(text: str, n: int = 40) -> str:
    return "\n".join((text or "").splitlines()[-n:])


@dataclass
class SlurmCluster:
    """A running dev cluster: its environment, partitions and a command runner."""

    state_dir: Path
    """The cluster's state directory (config in etc/, daemon logs in log/)."""
    env: dict[str, str]
    """Environment for commands against the cluster: SLURM_CONF set, repo root on PYTHONPATH."""
    cpu_partition: str = "cpu"
    """Partition of node `cpunode` (8 CPUs, default partition)."""
    gpu_partition: str = "gpu"
    """Partition of node `gpunode` (4 CPUs, Gres=gpu:2 backed by fake devices)."""
    repo_root: Path = REPO
    """Repository root: the working directory of every command (and so of srun steps)."""
    python: str = field(default_factory=lambda: sys.executable)
    """Absolute path of the venv python, for srun steps (they do not activate the venv)."""
    script: Path = SCRIPT
    """slurm/dev-cluster.sh."""

    @property
    def slurm_conf(self) -> str:
        return self.env["SLURM_CONF"]

    def run(self, cmd: Sequence[str] | str, timeout: float = 120, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Run `cmd` (argv list, or a string for bash) in the repo root with the cluster's environment.

        On timeout the whole process group gets SIGTERM (srun then cancels its step), then SIGKILL,
        and an AssertionError shows the output so far and the queue. With check, a non-zero exit
        raises an AssertionError showing stdout and stderr.
        """
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        shown = cmd if isinstance(cmd, str) else shlex.join(argv)
        proc = subprocess.Popen(argv, cwd=self.repo_root, env=self.env, text=True, start_new_session=True,
                                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            out, err = self._terminate(proc)
            raise AssertionError(
                f"timed out after {timeout}s: {shown}\n--- stdout\n{_tail(out)}\n--- stderr\n{_tail(err)}"
                f"\n--- squeue\n{self._squeue()}") from None
        result = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise AssertionError(f"exit {proc.returncode}: {shown}\n--- stdout\n{_tail(out)}"
                                 f"\n--- stderr\n{_tail(err)}")
        return result

    def patch_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point os.environ at the cluster for this test (for code that calls sbatch/sacct itself)."""
        for k in list(os.environ):
            if k.startswith(_LEAKY_PREFIXES) or k in _LEAKY_NAMES:
                monkeypatch.delenv(k, raising=False)
        for k in ("SLURM_CONF", "MRL_SLURM_STATE", "PYTHONPATH"):
            monkeypatch.setenv(k, self.env[k])

    @staticmethod
    def _terminate(proc: subprocess.Popen) -> tuple[str, str]:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                return proc.communicate(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return "", ""

    def _squeue(self) -> str:
        try:
            return subprocess.run(["squeue", "-a", "-o", "%.12i %.9P %.20j %.8T %.10M %R"], env=self.env,
                                  capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"(squeue failed: {e})"


def cluster_env(state_dir: Path) -> dict[str, str]:
    """os.environ without outer launcher variables, plus SLURM_CONF and the repo root on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith(_LEAKY_PREFIXES) or k in _LEAKY_NAMES)}
    env["SLURM_CONF"] = str(state_dir / "etc" / "slurm.conf")
    env["MRL_SLURM_STATE"] = str(state_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return env


def dev_cluster(action: str, *args: str, env: dict[str, str] | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `slurm/dev-cluster.sh ACTION ARGS` (no check; the caller reads returncode and output)."""
    return subprocess.run(["bash", str(SCRIPT), action, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running dev Slurm cluster, shared by the session (see the module docstring)."""
    state = Path(os.environ.get("MRL_SLURM_STATE", DEFAULT_STATE)).resolve()
    env = cluster_env(state)
    marker = state / "run" / "started-by-pytest"  # run/ is emptied by `stop`
    # Every session using the cluster holds a shared lock; the last one out stops what pytest started.
    with open(f"{state}.users", "a") as users:
        fcntl.flock(users, fcntl.LOCK_SH)
        try:
            was_up = dev_cluster("status", env=env).returncode == 0
            started = dev_cluster("start", env=env)
            if started.returncode != 0:
                raise RuntimeError(f"slurm/dev-cluster.sh start failed (exit {started.returncode}):\n"
                                   f"{_tail(started.stderr, 80)}\n{_tail(started.stdout)}")
            if not was_up:
                marker.touch()
            yield SlurmCluster(state_dir=state, env=env)
        finally:
            _stop_if_last(users, marker, env)


def _stop_if_last(users, marker: Path, env: dict[str, str]) -> None:
    try:
        fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another session still uses the cluster; the last one out stops it
    if marker.exists():
        stopped = dev_cluster("stop", env=env)
        if stopped.returncode != 0:
            print(f"slurm/dev-cluster.sh stop failed:\n{stopped.stderr}", file=sys.stderr)
