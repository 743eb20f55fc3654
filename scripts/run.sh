#!/usr/bin/env bash
# The README's main-job command: set up (idempotent) and run the main job on the embedded defaults
# (CPU, local executor, bubblewrap sandboxes). Extra arguments are config overrides, e.g. train.steps=5.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. scripts/pycache.sh  # bytecode compiled once per checkout, not at every import
exec .venv/bin/megatron-rl train configs/post_train_cpu.yaml "$@"
