"""The RL trainer step on a real model vs a Hugging Face forward+backward of the same model, batch and dtype.

Ours: `RLTrainer.step` exactly as the main job runs it (Megatron-Core policy built from `model.init: hf:DIR`,
packed micro-batches of at most `--max-tokens`, GRPO loss with the fused log-prob kernel, Megatron optimizer).
HF: `AutoModelForCausalLM.from_pretrained(DIR)` in a child process that never imports megatron_rl (no CPU
compat layer there), one padded batch per micro-batch of the same samples, token log-probs of the labels
times the same advantages (a policy-gradient loss), backward, torch AdamW step. Both in `--dtype`; the same
thread count. The samples have RL shapes: a chat-template prompt (~45 tokens) and a response of 8-40 tokens.
Tokens/s counts the real tokens of a step (prompt + response); steps alternate between the two sides after
one warm-up step each; the median is reported, and `ratio_cpu_time`: the same ratio of process CPU seconds
per step (a loaded machine inflates them far less than wall time; clean with `--threads 1`, what each of the
main job's 2 ranks gets on 2 cores). Prints one JSON object; target: ratio >= 1.

    .venv/bin/python benchmarks/trainer_vs_hf.py [--hf-model models/SmolLM2-135M-Instruct] [--samples 32]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def samples(n: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(40, 50)), int(rng.integers(8, 41))
        out.append({"tokens": rng.integers(0, vocab, p + r).tolist(), "prompt_len": p, "reward": float(i % 3 == 0),
                    "group": i // 8})
    return out


def ours(args, batch: list[dict]) -> list[float]:
    import torch
    from megatron.core import tensor_parallel

    from megatron_rl import config as C
    from megatron_rl.convert.source import initializer
    from megatron_rl.data.shards import Trajectory, read_arrays, write_shard
    from megatron_rl.distributed import init_distributed
    from megatron_rl.loop.job import trainer_config
    from megatron_rl.run_config import RunConfig
    from megatron_rl.trainer.policy import Policy
    from megatron_rl.trainer.rl_step import RLTrainer

    cfg = C.load(RunConfig, REPO / "configs/post_train_cpu.yaml",
                 [f"model.init=hf:{args.hf_model}", f"model.params_dtype={args.dtype}",
                  f"rl.trainer.packing.max_tokens={args.max_tokens}"])
    ctx = init_distributed(cfg.parallel, "gloo", source="single")
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    policy = Policy(cfg.model, cfg.rl.optim, ctx, total_steps=100, init=initializer(cfg.model))
    trainer = RLTrainer(policy, trainer_config(cfg, cfg.model.vocab_size))
    trajs = [Trajectory(tokens=np.asarray(s["tokens"], np.int32), logprobs=np.full(len(s["tokens"]), -2.0, np.float32),
                        loss_mask=np.r_[np.zeros(s["prompt_len"]), np.ones(len(s["tokens"]) - s["prompt_len"])]
                        .astype(np.uint8), prompt_len=s["prompt_len"], reward=s["reward"], group_id=s["group"],
                        policy_version_first=0, policy_version_last=0, env="arithmetic", task_id=f"t{i}",
                        episode_id=f"e{i}") for i, s in enumerate(batch)]
    with tempfile.TemporaryDirectory() as d:
        write_shard(Path(d) / "b.h5", trajs)
        cols = read_arrays(Path(d) / "b.h5")
    times = []
    for _ in range(args.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.step(cols)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    del torch
    return times[1:]


def hf(args, batch: list[dict]) -> list[float]:
    """In a child process without megatron_rl (see the docstring)."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "batch.json").write_text(json.dumps(batch))
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        out = subprocess.run([sys.executable, __file__, "--hf-child", d, "--hf-model", args.hf_model, "--dtype",
                              args.dtype, "--steps", str(args.steps), "--max-tokens", str(args.max_tokens),
                              "--threads", str(args.threads)], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def hf_child(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    assert "megatron_rl" not in sys.modules
    batch = json.loads((Path(args.hf_child) / "batch.json").read_text())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.hf_model, torch_dtype=dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    rewards = torch.tensor([s["reward"] for s in batch])
    adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # [N]
    mbs, cur, used = [], [], 0
    for i, s in enumerate(batch):  # micro-batches of at most max_tokens real tokens, as ours packs them
        if cur and used + len(s["tokens"]) > args.max_tokens:
            mbs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += len(s["tokens"])
    mbs.append(cur)
    times = []
    for _ in range(args.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        for mb in mbs:
            width = max(len(batch[i]["tokens"]) for i in mb)
            ids = torch.zeros(len(mb), width, dtype=torch.long)  # [b, W] right-padded
            att = torch.zeros(len(mb), width, dtype=torch.long)
            lmask = torch.zeros(len(mb), width - 1)
            for j, i in enumerate(mb):
                t = batch[i]["tokens"]
                ids[j, :len(t)] = torch.tensor(t)
                att[j, :len(t)] = 1
                lmask[j, batch[i]["prompt_len"] - 1:len(t) - 1] = 1
            logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()  # [b, W-1, V]
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [b, W-1]
            loss = -(lp * lmask * adv[mb][:, None]).sum() / lmask.sum().clamp(min=1)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    print(json.dumps(times[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-model", default=str(REPO / "models/SmolLM2-135M-Instruct"))
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--hf-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_child:
        return hf_child(args)
    import torch

    torch.set_num_threads(args.threads)
    vocab = json.loads((Path(args.hf_model) / "config.json").read_text())["vocab_size"]
    batch = samples(args.samples, vocab)
    tokens = sum(len(s["tokens"]) for s in batch)
    t_hf = hf(args, batch)
    t_ours = ours(args, batch)
    wall_ours, wall_hf = [t for t, _ in t_ours], [t for t, _ in t_hf]
    cpu_ours, cpu_hf = [c for _, c in t_ours], [c for _, c in t_hf]
    res = {"model": args.hf_model, "dtype": args.dtype, "samples": args.samples, "tokens_per_step": tokens,
           "threads": args.threads, "steps": args.steps,
           "ours_tokens_per_s": round(tokens / statistics.median(wall_ours), 1),
           "hf_tokens_per_s": round(tokens / statistics.median(wall_hf), 1),
           "ours_step_s": [round(t, 2) for t in wall_ours], "hf_step_s": [round(t, 2) for t in wall_hf],
           "ours_step_cpu_s": [round(c, 2) for c in cpu_ours], "hf_step_cpu_s": [round(c, 2) for c in cpu_hf]}
    res["ratio"] = round(res["ours_tokens_per_s"] / res["hf_tokens_per_s"], 2)
    res["ratio_cpu_time"] = round(statistics.median(cpu_hf) / statistics.median(cpu_ours), 2)
    res["target_ratio"] = 1.0
    print(json.dumps(res))


if __name__ == "__main__":
    main()
