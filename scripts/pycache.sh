# Sourced by scripts/run.sh and scripts/test.sh (from the repository root): compile Python's bytecode once, not
# at every import. With PYTHONDONTWRITEBYTECODE=1 (set on the project's machines) and venvs installed without
# .pyc files (uv's default), every process compiled torch, Megatron, transformers and vLLM from source again:
# `import torch, megatron.core, megatron_rl.trainer` 14.3 CPU-s, 5.3 with the bytecode cached; the vLLM
# process's `from vllm import EngineArgs, LLMEngine` 18 -> 9 CPU-s. The cache lives in one ignored folder,
# .pycache (the sources and venvs get no __pycache__); MRL_PYCACHE=0 keeps the caller's setting.
if [ "${MRL_PYCACHE:-1}" != 0 ]; then
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$PWD/.pycache}
  unset PYTHONDONTWRITEBYTECODE
fi
