"""Under torchrun (gloo, CPU): several `megatron-rl convert` commands in the same ranks, one after another.

Each command is the CLI's own `main(argv)` as a launched rank runs it (`megatron-rl convert` under torchrun);
between commands Megatron's model-parallel groups are torn down so that the next one starts its own layout
(tp/pp/ep/stages) over the same world. Rank 0 emits each command's JSON report (what the CLI prints); a command
that returns non-zero stops the launch with its error. tests/convert/test_convert_multiproc.py runs its
conversions of one world size in one launch: a launch per command only adds the start-up of Python, torch and
Megatron on every rank.

    torchrun --nproc_per_node=N tests/mp/convert_batch.py COMMANDS.json   # a JSON list of argv lists
"""
from __future__ import annotations

import contextlib
import io
import json
import sys


def run_one(argv: list[str]) -> dict | None:
    """`megatron-rl convert ARGV` in this rank; its report (rank 0), None elsewhere."""
    from megatron.core import parallel_state

    from megatron_rl.tools.convert.cli import main

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()  # the next command starts its own layout (runtime.start)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc != 0:
        raise SystemExit(f"convert {argv} failed (exit {rc})")
    reports = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith('{"op"')]
    return reports[0] if reports else None


def main() -> None:
    from megatron_rl.distributed import destroy_distributed
    from tests.mp.launch import emit

    with open(sys.argv[1]) as f:
        commands = json.load(f)
    for i, argv in enumerate(commands):
        report = run_one(argv)
        if report is not None:
            emit({"i": i, "argv": argv, **report})
    destroy_distributed()


if __name__ == "__main__":
    main()
