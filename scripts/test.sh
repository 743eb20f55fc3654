#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the whole test suite, Slurm and multi-process
# tests included. Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
