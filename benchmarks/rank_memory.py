"""Resident memory of one in-process RL rank of a run config, stage by stage, without generating anything.

    python benchmarks/rank_memory.py [--config configs/many_domains_cpu.yaml] [--samples 2] [--checkpoint]
        [--set key=value ...]

Builds what `megatron-rl train` builds on a single rank, in the same order (the policy with its optimizer and
trainer from model.init, then the rollout engine with its KV pool), then runs one `RLTrainer.step` on
synthetic samples of the longest length the config trains (a prompt of model.max_seq_length - rl.max_new_tokens
tokens and rl.max_new_tokens generated, half of them rewarded so every group has a gradient). It reports VmRSS
after each stage, the KV pool's bytes, and the step's peak: the VmHWM reached during it (sampled every 0.1 s
as well). The step's peak is the largest the run reaches: the engine's decode transients are far smaller
than a trainer micro-batch's activations (packing.max_tokens tokens through every layer) plus Adam's state,
which the first step allocates. `--samples` 2 fills one micro-batch of 2048 tokens at the config's lengths.
Weights are random (model.init's shape, its loading skipped): memory does not depend on their values.
`--checkpoint` then saves the rank's RL checkpoint (trainer/checkpoint.save_checkpoint, into a temporary folder
beside the config's output_dir, removed after) and reports its peak (VmHWM reset before it) and CPU seconds: the
save of the last step, when the run's resident memory is highest.

Measured (SmolLM2-135M-Instruct shape, fp32, 2 samples; docs/task_libraries.md, Measured): step peak
    python benchmarks/rank_memory.py --set model.recompute_activations=false     8.57 GB
    python benchmarks/rank_memory.py                                             5.40 GB (recompute on)
    python benchmarks/rank_memory.py --checkpoint          save: 4.91 -> 9.64 GB peak, 13 CPU-s (this process)
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np


def status_gb(field: str) -> float:
    """A /proc/self/status memory line (VmRSS, VmHWM) in GB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1e6
    raise KeyError(field)


def synthetic_columns(n: int, prompt: int, new: int, vocab: int):
    """n samples of `prompt` prompt tokens and `new` generated ones, groups of 2 with rewards 0 and 1."""
    from megatron_rl.data.shards import Trajectory, TrajectoryColumns

    gen, total = np.random.default_rng(0), prompt + new
    mask = (np.arange(total) >= prompt).astype(np.uint8)
    return TrajectoryColumns.from_trajectories([Trajectory(
        tokens=gen.integers(0, vocab, total).astype(np.int32), loss_mask=mask,
        logprobs=np.where(mask, -3.0, 0.0).astype(np.float32), prompt_len=prompt, reward=float(i % 2),
        group_id=i // 2, policy_version_first=0, policy_version_last=0, env="synthetic", task_id=str(i // 2),
        episode_id=f"m{i}") for i in range(n)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/many_domains_cpu.yaml")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--checkpoint", action="store_true", help="then save a checkpoint and report its peak")
    p.add_argument("--set", nargs="*", default=[], help="run-config overrides key=value")
    args = p.parse_args()

    import megatron_rl.config as C
    from megatron_rl.distributed import init_distributed
    from megatron_rl.loop.job import build_engine, new_policy, trainer_config
    from megatron_rl.run_config import RunConfig
    from megatron_rl.trainer.rl_step import RLTrainer

    cfg = C.load(RunConfig, args.config, args.set)
    out: dict = {"config": args.config, "overrides": args.set, "samples": args.samples,
                 "recompute_activations": cfg.model.recompute_activations, "rss_gb": {}}
    ctx = init_distributed(cfg.parallel, cfg.launch.backend)
    out["rss_gb"]["start"] = status_gb("VmRSS")
    tok = cfg.tokenizer.build(cfg.model)
    policy = new_policy(cfg, ctx, "rl", init=None)
    trainer = RLTrainer(policy, trainer_config(cfg, tok.vocab_size))
    out["rss_gb"]["policy_and_trainer"] = status_gb("VmRSS")
    engine, _ = build_engine(cfg, ctx, tok.vocab_size)
    out["kv_pool_gb"] = engine.cache.kv.numel() * engine.cache.kv.element_size() / 1e9
    out["rss_gb"]["engine"] = status_gb("VmRSS")
    cols = synthetic_columns(args.samples, cfg.model.max_seq_length - cfg.rl.max_new_tokens, cfg.rl.max_new_tokens,
                             tok.vocab_size)
    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], status_gb("VmRSS"))
            time.sleep(0.1)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0 = time.process_time()
    trainer.step(cols)
    done.set()
    watcher.join()
    out["step_cpu_s"] = time.process_time() - t0
    out["rss_gb"]["after_step"] = status_gb("VmRSS")
    out["step_peak_rss_gb"] = max(peak[0], status_gb("VmHWM"))
    if args.checkpoint:
        out.update(checkpoint_peak(policy, cfg.output_dir))
    print(json.dumps(out, indent=1))


def checkpoint_peak(policy, output_dir: str) -> dict:
    """Save the policy's checkpoint (model, DistributedOptimizer state, scheduler) into a temporary folder; the
    resident peak during the save (VmHWM reset first, /proc/self/clear_refs) and its CPU seconds."""
    import tempfile
    from pathlib import Path

    from megatron_rl.trainer.checkpoint import save_checkpoint

    Path(output_dir).mkdir(parents=True, exist_ok=True)
    before = status_gb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    t0 = time.process_time()
    with tempfile.TemporaryDirectory(dir=output_dir, prefix="rank-memory-ckpt-") as tmp:
        save_checkpoint(policy, Path(tmp) / "step-000001")
    return {"checkpoint_cpu_s": time.process_time() - t0, "checkpoint_peak_rss_gb": status_gb("VmHWM"),
            "rss_gb_before_checkpoint": before, "rss_gb_after_checkpoint": status_gb("VmRSS")}


if __name__ == "__main__":
    main()
