#!/usr/bin/env bash
# The README's test command: set up (idempotent) and run the whole test suite, Slurm and multi-process
# tests included; as root, without arguments, then the sandbox tests again as a normal user
# (scripts/test_unprivileged.sh; MRL_SKIP_UNPRIVILEGED=1 skips that pass). Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m "not slow"` (the main pass only). The vLLM backend's environment (.venv-vllm,
# scripts/setup_vllm.sh; ~5 min the first time, then a stamp check) is built too, so its tests run here
# rather than skip; MRL_SKIP_VLLM=1 leaves it out (tests/rollout/test_vllm_backend.py then skips, naming the script).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ "${MRL_SKIP_VLLM:-0}" = 1 ] || bash scripts/setup_vllm.sh
export PYTHONUNBUFFERED=1
. scripts/pycache.sh  # bytecode compiled once per checkout, not at every import
# Two pytest workers (pytest-xdist): the multi-process and Slurm tests leave a third of the 2 cores idle
# waiting on launches and the scheduler. tests/conftest.py keeps a file's tests on one worker and all Slurm
# tests on one worker, costliest first. MRL_TEST_WORKERS=0 runs in this process, one test at a time.
WORKERS=${MRL_TEST_WORKERS:-2}
PAR=()
[ "$WORKERS" = 0 ] || PAR=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
if [ $# -gt 0 ] || [ "$(id -u)" != 0 ] || [ -n "${MRL_SKIP_UNPRIVILEGED:-}" ]; then
  exec .venv/bin/python -m pytest -p no:cacheprovider "${PAR[@]}" "$@"
fi
rc=0
.venv/bin/python -m pytest -p no:cacheprovider "${PAR[@]}" || rc=$?
bash scripts/test_unprivileged.sh || rc=$((rc ? rc : $?))
exit "$rc"
