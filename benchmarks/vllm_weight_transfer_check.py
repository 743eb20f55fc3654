"""GPU check of vLLM's NCCL weight-transfer route against the file route (`engine.vllm.weight_transfer: nccl` vs
`file`): PREPARED, NOT RUN HERE (no GPU is lent to this project's sessions). Run by the vLLM environment's python
(a CUDA build: `MRL_VLLM_SPEC=vllm==0.32.0 bash scripts/setup_vllm.sh .venv-vllm-cuda`), never by the
project's venv: it imports vLLM and transformers 5 only (scripts/gpu_check_vllm.sh runs it).

    .venv-vllm-cuda/bin/python benchmarks/vllm_weight_transfer_check.py --model models/SmolLM2-135M-Instruct \
        [--trainer-gpu 0 --vllm-gpu 1] [--dtype float32]

What it checks, one JSON line on stdout (exit 0: every check passed, 1: a check failed, 3: fewer than 2 GPUs):
- a vLLM server (`vllm.entrypoints.openai.api_server`, VLLM_SERVER_DEV_MODE=1 for the RL routes,
  `--weight-transfer-config {"backend": "nccl"}`) on --vllm-gpu; this process is the trainer (NCCL rank 0)
  on --trainer-gpu. NCCL refuses two ranks of one communicator on the same GPU, hence 2 GPUs (one GPU shared by
  trainer and vLLM would need the `ipc` backend instead: not covered here).
- new weights (the model's, each tensor times 1 + 0.05 N(0, 1), HF names as our converter writes them:
  q/k/v and gate/up unfused, no lm_head for a tied model) sent by `NCCLTrainerWeightTransferEngine` through
  `HTTPVLLMWeightSyncClient`, then the prefix cache reset (as our file route does after reload_weights);
  `greedy_nccl_equals_file`: vLLM's greedy tokens after the NCCL update equal those after the file route
  (the same tensors as safetensors on /dev/shm + `collective_rpc reload_weights`), and
  `greedy_equals_transformers`: both equal transformers' greedy tokens on those weights (a tied output layer
  that kept the old embedding, the CPU build's trap that vllm_worker._retie fixes, would break this);
  `logprob_max_abs_diff`: vLLM's sampled-token log-probs against transformers' teacher-forced ones
  (the GPU mismatch figure); `restored_equals_baseline`: the original weights sent back by NCCL restore the
  original greedy tokens.
- timing: `nccl_s` (two rounds: first includes the communicator's warm-up) vs `file_s` (write + reload).
How this relates to the engine's route (`engine.vllm.weight_transfer: nccl`, `VLLMEngine._update_transfer`):
the engine drives the same worker RPCs (init_weight_transfer_engine, start_weight_update, update_weights with the
same names / dtype names / shapes, finish_weight_update) but the project's venv has no vLLM, hence no
`PyNcclCommunicator`: its worker (`rollout/vllm_worker.py`) registers vLLM's NCCL engine with a torch
process group instead (`stateless_init_torch_distributed_process_group`, ProcessGroupNCCL on GPUs, gloo on CPU)
and the trainer joins it with torch alone (`rollout/vllm_transfer.py`), unpacked, one tensor at a time. That route
is checked by `tests/rollout/test_vllm_weight_transfer.py` (gloo on CPU, run here; nccl with
MRL_VLLM_WEIGHT_TRANSFER=nccl MRL_VLLM_GPU=1, run by scripts/gpu_check_vllm.sh). This script stays as the
reference: vLLM's own (packed) NCCL engine on the same model, its greedy tokens and its seconds, which the engine
route's should match (tokens) and approach (seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPTS = [[1, 4093, 314, 216, 23, 1232, 30], [1, 504, 3458, 282, 4649, 314], [1, 19, 1232, 216, 25, 446]]
"""Token-id prompts (ids below SmolLM2's vocabulary; any model with a >= 5k vocabulary takes them)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body or {}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else {}


def start_server(model: str, gpu: int, port: int, dtype: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--dtype", dtype, "--max-model-len", "512", "--enable-prefix-caching", "--gpu-memory-utilization", "0.5",
           "--weight-transfer-config", json.dumps({"backend": "nccl"})]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited ({proc.returncode}); its log: {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return proc
        except OSError:
            time.sleep(2)
    proc.kill()
    raise RuntimeError(f"vLLM server not up in 900 s; its log: {log}")


def greedy(url: str, model: str, n: int = 16) -> tuple[list[list[int]], list[list[float]]]:
    """vLLM's greedy tokens and their log-probs for PROMPTS."""
    toks, lps = [], []
    for p in PROMPTS:
        c = _post(f"{url}/v1/completions", {"model": model, "prompt": p, "max_tokens": n, "temperature": 0.0,
                                           "logprobs": 0, "return_token_ids": True})["choices"][0]
        toks.append(c["token_ids"])
        lps.append(c["logprobs"]["token_logprobs"])
    return toks, lps


def hf_reference(model: str, state: dict, device: str, tokens: list[list[int]]):
    """transformers' greedy tokens on `state` and its teacher-forced log-probs of `tokens`."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    want, lps = [], []
    with torch.no_grad():
        for p, got in zip(PROMPTS, tokens):
            out = []
            for _ in range(len(got)):
                out.append(int(hf(torch.tensor([p + out], device=device)).logits[0, -1].argmax()))
            want.append(out)
            logits = hf(torch.tensor([p + got], device=device)).logits[0, len(p) - 1:-1].float()
            lps.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(got, device=device)[:, None])[:, 0]
                       .tolist())
    return want, lps


def nccl_sender(url: str, state: dict, port: int):
    """The trainer side of vLLM's NCCL route (rank 0 of a 2-rank group with the server's worker)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    class DictSource(WeightSource):
        def __init__(self):
            self.state = state

        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.state.items()]

        def __iter__(self):
            yield from self.state.items()

    source = DictSource()
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2, rank=0)
    engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=HTTPVLLMWeightSyncClient(url), source=source)
    return engine, source


def file_route(url: str, state: dict, folder: Path) -> float:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    _post(f"{url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
    _post(f"{url}/reset_prefix_cache?reset_running_requests=true")
    shutil.rmtree(folder, ignore_errors=True)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="an HF model folder (safetensors)")
    p.add_argument("--trainer-gpu", type=int, default=0)
    p.add_argument("--vllm-gpu", type=int, default=1)
    p.add_argument("--dtype", default="float32", help="vLLM's dtype (float32: parity checks are exact)")
    p.add_argument("--log-dir", default="", help="the server's log folder ('' = a temporary one)")
    args = p.parse_args()
    import torch
    from safetensors.torch import load_file

    if torch.cuda.device_count() < 2:
        print(json.dumps({"skipped": f"{torch.cuda.device_count()} CUDA GPU(s): NCCL needs the trainer and vLLM "
                                     f"on different GPUs"}))
        return 3
    device = f"cuda:{args.trainer_gpu}"
    torch.cuda.set_device(device)
    model = str(Path(args.model).resolve())
    files = sorted(Path(model).glob("*.safetensors"))
    base = {k: v.to(device) for f in files for k, v in load_file(str(f)).items()}
    g = torch.Generator(device=device).manual_seed(0)
    new = {k: v * (1 + 0.05 * torch.randn(v.shape, generator=g, device=device, dtype=v.dtype))
           for k, v in base.items()}
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm-gpu-check-"))
    logs.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(model, args.vllm_gpu, port, args.dtype, logs / "vllm_server.log")
    res: dict = {"model": model, "dtype": args.dtype, "gpus": torch.cuda.device_count()}
    try:
        res.update(_checks(url, model, base, new, device))
    finally:
        os.killpg(server.pid, 9)
        server.wait()
    print(json.dumps(res))
    ok = all(res[k] for k in ("greedy_nccl_equals_file", "greedy_equals_transformers", "restored_equals_baseline"))
    return 0 if ok and res["logprob_max_abs_diff"] < 1e-3 else 1


def _checks(url: str, model: str, base: dict, new: dict, device: str) -> dict:
    shm = Path(tempfile.mkdtemp(prefix="vllm-gpu-check-", dir="/dev/shm"))
    try:
        baseline, _ = greedy(url, model)
        engine, source = nccl_sender(url, new, _free_port())
        times = []
        for _ in range(2):  # the first round includes the communicator's warm-up
            torch_sync(device)
            t0 = time.perf_counter()
            engine.send_weights()
            _post(f"{url}/reset_prefix_cache?reset_running_requests=true")
            times.append(time.perf_counter() - t0)
        after_nccl, lps = greedy(url, model)
        source.state = base  # the original weights back through NCCL
        engine.send_weights()
        _post(f"{url}/reset_prefix_cache?reset_running_requests=true")
        restored, _ = greedy(url, model)
        file_s = file_route(url, new, shm / "v1")
        after_file, _ = greedy(url, model)
        want, ref = hf_reference(model, new, device, after_nccl)
        diff = max(abs(a - b) for x, y in zip(lps, ref) for a, b in zip(x, y))
        return {"nccl_s": [round(t, 3) for t in times], "file_s": round(file_s, 3),
                "greedy_nccl_equals_file": after_nccl == after_file, "greedy_equals_transformers": after_nccl == want,
                "greedy_changed_by_update": after_nccl != baseline, "restored_equals_baseline": restored == baseline,
                "logprob_max_abs_diff": diff, "bytes": sum(t.numel() * t.element_size() for t in new.values())}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def torch_sync(device: str) -> None:
    import torch

    torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
