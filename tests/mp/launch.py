"""Launch a script under torchrun on CPU (gloo) and collect the records its ranks `emit`.

Ranks write records to per-rank files (stdout lines of several ranks can interleave mid-line), the
launcher reads them back after the run.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULT_DIR_ENV = "MRL_TEST_RESULT_DIR"


def emit(record: dict) -> None:
    """Called inside a launched rank: append one JSON record to this rank's result file."""
    rank = os.environ.get("RANK", "0")
    path = Path(os.environ[RESULT_DIR_ENV]) / f"rank{rank}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str | Path, nproc: int, args: list[str] = (), timeout: float = 300,
             env: dict | None = None) -> list[dict]:
    """Run `script` on `nproc` local ranks; return the records emitted; raise with the output on failure.
    A rendezvous port taken between picking and binding it (EADDRINUSE) is retried with a new port."""
    for attempt in range(3):
        try:
            return _torchrun_once(script, nproc, args, timeout, env)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortTaken(AssertionError):
    pass


def _torchrun_once(script, nproc: int, args, timeout: float, env: dict | None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="mrl-mp-") as results:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1", str(script), *args]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), RESULT_DIR_ENV: results,
                    **(env or {})}
        for k in [k for k in full_env if k.startswith("SLURM_")]:
            full_env.pop(k)
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            taken = "EADDRINUSE" in proc.stderr and not list(Path(results).glob("rank*.jsonl"))
            error = _PortTaken if taken else AssertionError
            raise error(f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                        f"{proc.stderr[-8000:]}")
        records = []
        for path in sorted(Path(results).glob("rank*.jsonl")):
            records += [json.loads(line) for line in path.read_text().splitlines() if line]
        return records
