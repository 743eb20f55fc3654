"""Trainer memory and RL step time of LoRA against full fine-tuning, on Megatron-Core (CPU, TP=1), same run.

Each mode runs in a fresh subprocess (so peaks do not mix): `Policy` + `RLTrainer` of the same GPT (random
weights drawn by global name: the same base in every mode), GRPO steps on the same synthetic global batches.
Modes: full (every weight trained), lora (rank-r adapters on qkv/proj/fc1/fc2, the base frozen in fp32),
lora_bf16 (the same with the base held in bf16). Per mode:
- param_mb (every parameter), trainable_mb, grad_buffer_mb (DDP's gradient buffers: trainable parameters
  only), optimizer_mb (Adam's state tensors after the first step), peak_rss_mb (the process's VmHWM minus its
  RSS after imports), step_s / step_cpu_s (median wall / process CPU seconds of a step after the first),
  sync_mb (what the engine weight sync moves: the merged weights) and adapter_mb (what a backend serving
  adapters would need instead).
Ratios are lora / full. The modes run one after another on a shared machine: step times are comparable only
as ratios measured in the same run (and CPU seconds are less disturbed by other load than wall time).

    .venv/bin/python benchmarks/lora_memory.py [--steps 4] [--layers 8 --hidden 512 --ffn 1536 --vocab 32000]
    .venv/bin/python benchmarks/lora_memory.py --smollm2     # the main job's model shape (135M)

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODES = ("full", "lora", "lora_bf16")


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def _batch(step: int, vocab: int, samples: int, length: int):
    import numpy as np

    from megatron_rl.data.shards import Trajectory, TrajectoryColumns

    gen = np.random.default_rng(1000 + step)
    trajs = []
    for i in range(samples):
        prompt = 8
        mask = (np.arange(length) >= prompt).astype(np.uint8)
        trajs.append(Trajectory(
            tokens=gen.integers(0, vocab, length).astype(np.int32), loss_mask=mask,
            logprobs=np.where(mask, -np.log(vocab), 0).astype(np.float32), prompt_len=prompt,
            reward=float(i % 2), group_id=i // 4, policy_version_first=0, policy_version_last=0, env="synthetic",
            task_id=str(i // 4), episode_id=f"s{step}-{i}"))
    return TrajectoryColumns.from_trajectories(trajs)


def run_mode(args) -> dict:
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.convert.runtime import start
    from megatron_rl.kernels.logprob import LogprobKernelConfig
    from megatron_rl.models.gpt import ModelConfig
    from megatron_rl.rl.config import LossConfig
    from megatron_rl.trainer.lora import LoRAConfig, adapter_bytes
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.policy import OptimConfig, Policy
    from megatron_rl.trainer.rl_step import RLConfig, RLTrainer

    torch.set_num_threads(args.threads)
    ctx = start()
    base_rss = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak counts from here
    model_parallel_cuda_manual_seed(0)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      num_query_groups=args.kv_heads, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                      max_seq_length=args.length, tie_embeddings=True)
    lora = LoRAConfig(enabled=args.mode != "full", rank=args.rank, alpha=2.0 * args.rank,
                      base_dtype="bf16" if args.mode == "lora_bf16" else "same")
    policy = Policy(cfg, OptimConfig(lr=1e-5, distributed_optimizer=False), ctx, total_steps=args.steps,
                    init=lambda m: init_weights_by_name(m, 0), lora=lora)
    trainer = RLTrainer(policy, RLConfig(loss=LossConfig(name="grpo"),
                                         packing=PackingConfig(max_tokens=args.length * 4),
                                         logprob_kernel=LogprobKernelConfig(impl="torch")))
    wall, cpu = [], []
    for s in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.step(_batch(s, args.vocab, args.samples, args.length))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    module = policy.chunks[0].module
    params = list(module.parameters())
    states = [t for inner in _inner(policy.optimizer) for st in inner.state.values() for t in st.values()
              if torch.is_tensor(t)]
    grads = [b.grad_data for c in policy.chunks for b in c.buffers]
    return {"mode": args.mode, "param_mb": _mb(params), "trainable_mb": _mb(p for p in params if p.requires_grad),
            "grad_buffer_mb": _mb(grads), "optimizer_mb": _mb(states),
            "peak_rss_mb": _status_mb("VmHWM") - base_rss, "step_s": statistics.median(wall[1:] or wall),
            "step_cpu_s": statistics.median(cpu[1:] or cpu),
            "sync_mb": _mb(t for _, t in policy.global_named_tensors()),
            "adapter_mb": adapter_bytes(module) / 2**20}


def _inner(optimizer) -> list:
    return [s.optimizer for s in getattr(optimizer, "chained_optimizers", [optimizer])]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in this process
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--samples", type=int, default=8, help="samples per RL step (2 groups of 4)")
    p.add_argument("--length", type=int, default=128, help="tokens per sample")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smollm2", action="store_true", help="SmolLM2-135M's shape (30 layers, 576 hidden, ...)")
    a = p.parse_args(argv)
    if a.smollm2:
        a.layers, a.hidden, a.heads, a.kv_heads, a.ffn, a.vocab = 30, 576, 9, 3, 1536, 49152
    return a


def main(argv=None) -> None:
    args = parse(argv)
    if args.mode:
        print(json.dumps(run_mode(args)), flush=True)
        return
    forwarded = [x for x in (argv if argv is not None else sys.argv[1:])]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads)}
    rows = {}
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, *forwarded], env=env, check=True,
                             capture_output=True, text=True).stdout
        rows[mode] = json.loads(out.strip().splitlines()[-1])
    full = rows["full"]
    ratios = {m: {k: round(rows[m][k] / full[k], 4) for k in ("param_mb", "trainable_mb", "grad_buffer_mb",
                                                              "optimizer_mb", "peak_rss_mb", "step_s",
                                                              "step_cpu_s") if full[k]}
              for m in MODES if m != "full"}
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "rank",
                                           "samples", "length", "steps", "threads")}
    print(json.dumps({"shape": shape, "modes": rows, "ratio_vs_full": ratios}, indent=1))


if __name__ == "__main__":
    main()
