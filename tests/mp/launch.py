"""Launch a script on local ranks on CPU (gloo) and collect the records its ranks `emit`.

Ranks write records to per-rank files (stdout lines of several ranks can interleave mid-line), the
launcher reads them back after the run.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
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
    """Run `script` on `nproc` local ranks (the product's launcher, `LocalRanks`: torchrun's variables, the
    rendezvous store hosted in this process on a port the kernel picks); return the records emitted; raise with
    the output on failure."""
    from megatron_rl.commands.launch import LocalRanks

    with tempfile.TemporaryDirectory(prefix="mrl-mp-") as results:
        # TORCHDYNAMO_DISABLE: Megatron's torch.compile'd functions (the MoE router's) run eagerly; compiling one
        # cost ~12 CPU-s in every rank that routes (C++ through inductor). Same code, same results; the compile
        # path itself is tested by tests/compat/test_deferred_compile.py and by every `megatron-rl train` launch.
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": str(REPO),
                    RESULT_DIR_ENV: results, **(env or {})}
        for k in [k for k in full_env if k.startswith("SLURM_")]:
            full_env.pop(k)
        with open(Path(results) / "output.log", "w+") as out:
            ranks = LocalRanks([str(script), *args], nproc, full_env, stdout=out, stderr=subprocess.STDOUT)
            rc = ranks.start().wait(timeout)
            out.seek(0)
            output = out.read()
        if rc != 0:
            raise AssertionError(f"ranks of {script} failed ({rc}):\n{output[-12000:]}")
        records = []
        for path in sorted(Path(results).glob("rank*.jsonl")):
            records += [json.loads(line) for line in path.read_text().splitlines() if line]
        return records
