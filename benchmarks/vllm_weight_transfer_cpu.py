"""The vLLM backend's two weight-sync routes on CPU, one engine, the same tensors: `engine.vllm.weight_transfer`
gloo (vLLM's weight-transfer API: init/start/update/finish RPCs, the HF tensors broadcast from memory over a gloo
group, the CPU twin of nccl) against file (safetensors on tmpfs + reload_weights), alternated `--repeats` times.
Per sync: [wall s, trainer-side CPU-s, vLLM process CPU-s] (CPU-s from getrusage and /proc/PID/stat: wall times
mean little on a shared machine). Prints one JSON line.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vllm_weight_transfer_cpu.py [--model models/SmolLM2-135M-Instruct]

Measured 2026-12-05 (2 shared cores, nice 19, SmolLM2-135M fp32, 538 MB; two runs of 2 syncs per route): gloo
6.3-15.3 s wall, 0.6-0.9 trainer CPU-s, 2.8-3.5 vLLM CPU-s; file 6.8-11.6 s, 0.7-2.0, 2.0-2.5. About the same
CPU work (~3.5-4.4 CPU-s a sync), moved from the trainer (no safetensors write) to vLLM (one `load_weights` per
tensor): on CPU the gloo route buys no speed; it is there to run the nccl route's code here.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def trainer_cpu() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    return a.ru_utime + a.ru_stime


def process_cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def megatron_tensors(model_dir: Path) -> list:
    """The trainer's model (Megatron names) initialised from the HF folder, as (name, tensor) pairs."""
    from megatron.core import tensor_parallel

    from megatron_rl import config as C
    from megatron_rl.convert.runtime import start
    from megatron_rl.convert.source import initializer
    from megatron_rl.models.gpt import build_gpt
    from megatron_rl.run_config import RunConfig

    cfg = C.load(RunConfig, None, [f"model.init=hf:{model_dir}", "model.max_seq_length=256", "train.steps=0",
                                   "data.domain=arithmetic", "curriculum.enabled=false", "launch.nproc_per_node=1"])
    ctx = start()
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_gpt(cfg.model, ctx.parallel, ctx.pgs)
    initializer(cfg.model)(model)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def main() -> None:
    from megatron_rl.rollout.engine import EngineConfig
    from megatron_rl.rollout.vllm_config import VLLMConfig
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    named = megatron_tensors(Path(args.model))
    eng = VLLMEngine(VLLMConfig(python=args.python, weight_transfer="gloo", max_restarts=0),
                     EngineConfig(max_running=4), f"hf:{args.model}", 512, "float32")
    res: dict = {"model": args.model, "bytes": sum(t.numel() * t.element_size() for _, t in named)}
    try:
        for route in ("gloo", "file") * args.repeats:
            eng.vcfg.weight_transfer = route
            t0, c0, v0 = time.perf_counter(), trainer_cpu(), process_cpu(eng.proc.pid)
            eng.update_weights(eng.version + 1, named)
            res.setdefault(route, []).append([round(time.perf_counter() - t0, 2), round(trainer_cpu() - c0, 2),
                                              round(process_cpu(eng.proc.pid) - v0, 2)])
    finally:
        eng.close()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
