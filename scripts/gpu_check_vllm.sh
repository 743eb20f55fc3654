#!/usr/bin/env bash
# What a GPU run of the vLLM rollout backend (engine.backend: vllm) must check: PREPARED, NOT RUN (no GPU is
# lent to this project's sessions; every figure in the README about the backend is from vLLM's CPU build).
#   bash scripts/gpu_check_vllm.sh [HF_MODEL_DIR]     (default models/SmolLM2-135M-Instruct; a machine with
#                                                      CUDA GPUs, network for the first set-up, ~15 min)
# Steps (each prints its result; the script stops at the first failure):
#   1. the CUDA build of vLLM in a venv of its own (MRL_VLLM_SPEC=vllm==0.32.0; idempotent set-up script).
#   2. the backend's contract tests with that environment (MRL_VLLM_PYTHON): vLLM then runs on the GPU, our
#      references (transformers, the trainer) on the CPU: greedy tokens equal, log-probs within 1e-3, weight sync
#      by the file route (safetensors on /dev/shm + reload_weights; the tied-output-layer fix), versions, abort,
#      restarts of a killed or hung process, bad input, fleet episodes and the gateway, honest mismatch
#      (bf16 vLLM vs the fp32 trainer: mismatch_kl > 0, TIS weights, the alert).
#      What may differ on a GPU: fp32 GEMMs with TF32 or other kernels (greedy parity could break after some
#      tokens: look at the first difference before relaxing anything).
#   3. engine.vllm.weight_transfer=nccl (needs 2 GPUs: NCCL refuses two ranks of one group on one GPU):
#      a) tests/rollout/test_vllm_weight_transfer.py with MRL_VLLM_WEIGHT_TRANSFER=nccl, vLLM on GPU 1 and this
#         process (the trainer side, rank 0) on GPU 0: the engine's route (vLLM's weight-transfer RPCs, our
#         torch ProcessGroupNCCL, tensors from memory) gives transformers' greedy tokens after an update and the
#         file route's on the same engine, versions, abort, a restarted process re-joining a new group (the CPU
#         run covers the same with gloo; only the NCCL group itself is new here: two torch builds' NCCL meeting);
#      b) benchmarks/vllm_weight_transfer_check.py: vLLM's own packed NCCL engine vs the file route (greedy
#         tokens, transformers' tokens, original weights restored, log-prob agreement, NCCL vs file seconds).
#   4. the main job on the GPU with both backends, model.init=hf:HF_MODEL_DIR (engine.vllm.gpu_memory_utilization:
#      vLLM shares the GPU with the trainer; the default 0.9 would leave the trainer nothing): held-out
#      before/after within noise of each other, mismatch_kl per step (non-zero with vllm), vllm_restarts 0;
#      with 2 GPUs also vllm_nccl (engine.vllm.weight_transfer=nccl, vLLM on GPU 1): the same within noise.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-models/SmolLM2-135M-Instruct}
VENV=${MRL_VLLM_VENV:-$PWD/.venv-vllm-cuda}
OUT=${MRL_GPU_CHECK_OUT:-runs/gpu_check_vllm}
log() { printf '[gpu_check_vllm] %s\n' "$*" >&2; }

command -v nvidia-smi >/dev/null || { log "no nvidia-smi: this check needs CUDA GPUs"; exit 3; }
[ -d "$MODEL" ] || { log "no model folder $MODEL (an HF folder: bash scripts/setup.sh imports the default)"; exit 2; }
MODEL=$(cd "$MODEL" && pwd)
mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
GPUS=$(nvidia-smi -L | wc -l)

log "1. vLLM CUDA build in $VENV"
MRL_VLLM_SPEC=${MRL_VLLM_SPEC:-vllm==0.32.0} bash scripts/setup_vllm.sh "$VENV"

log "2. contract tests with vLLM on the GPU"
MRL_VLLM_PYTHON="$VENV/bin/python" PYTHONPATH=$PWD timeout 3600 .venv/bin/python -m pytest -p no:cacheprovider -q \
  tests/rollout/test_vllm_backend.py 2>&1 | tee "$OUT/contract_tests.log"

log "3. NCCL weight transfer vs file route ($GPUS GPU(s))"
if [ "$GPUS" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0,1 MRL_VLLM_WEIGHT_TRANSFER=nccl MRL_VLLM_GPU=1 MRL_VLLM_PYTHON="$VENV/bin/python" \
    PYTHONPATH=$PWD timeout 1800 .venv/bin/python -m pytest -p no:cacheprovider -q \
    tests/rollout/test_vllm_weight_transfer.py 2>&1 | tee "$OUT/weight_transfer_tests.log"
  timeout 1800 "$VENV/bin/python" benchmarks/vllm_weight_transfer_check.py --model "$MODEL" --trainer-gpu 0 \
    --vllm-gpu 1 --log-dir "$OUT" | tee "$OUT/weight_transfer.json"
else
  log "skipped: one GPU (NCCL needs the trainer and vLLM on different GPUs; a shared GPU syncs by file)"
fi

log "4. the main job, both backends, on the GPU ($MODEL)"
RUNS="native vllm"
[ "$GPUS" -ge 2 ] && RUNS="$RUNS vllm_nccl"  # vLLM on GPU 1, the trainer on GPU 0, weights by NCCL
for run in $RUNS; do
  backend=${run%_nccl}
  extra=()
  [ "$run" = vllm_nccl ] && extra=(engine.vllm.weight_transfer=nccl engine.vllm.cuda_visible_devices=1)
  timeout 3600 .venv/bin/megatron-rl train configs/post_train_cpu.yaml name="post_train_gpu_$run" \
    output_dir="$OUT" model.init="hf:$MODEL" engine.backend=$backend engine.vllm.python="$VENV/bin/python" \
    engine.vllm.gpu_memory_utilization=0.3 "${extra[@]}" 2>&1 | tail -5
  .venv/bin/python - "$OUT/post_train_gpu_$run" "$run" <<'PY'
import json, sys
from pathlib import Path
run, backend = Path(sys.argv[1]), sys.argv[2]
s = json.loads((run / "summary.json").read_text())
rl = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "rl"]
print(backend, "held-out", s["heldout_before"], "->", s["heldout_after"],
      "| mismatch_kl per step", [r.get("mismatch_kl") for r in rl], "| vllm_restarts", rl[-1].get("vllm_restarts"))
PY
done
log "done: results in $OUT"
