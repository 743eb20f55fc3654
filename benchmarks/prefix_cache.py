"""The engine's prefix cache on a multi-turn workload: time and prefilled tokens with it vs without (CPU).

Each of `--episodes` episodes has a `--prompt`-token prompt (a system prompt with tool schemas is ~600 tokens
for the main job's model) and `--turns` turns: the model generates `--new` tokens greedily, an observation of
`--obs` tokens is appended and the whole context goes back as the next turn's request, as the RL loop's
multi-turn episodes do. All episodes' turn k run together (continuous batching). Both engines are built from
the same weights; their tokens must be identical. Prints one JSON object with the ratio.

    .venv/bin/python benchmarks/prefix_cache.py [--episodes 8 --turns 3 --prompt 600 --new 32 --obs 64]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from megatron_rl.models.gpt import ModelConfig

CFG = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, vocab_size=384,
                  max_seq_length=2048)


def build():
    from megatron.core import tensor_parallel

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.distributed import init_distributed
    from megatron_rl.models.gpt import build_gpt
    from megatron_rl.parallel import ParallelConfig

    ctx = init_distributed(ParallelConfig(), source="single")
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_gpt(CFG, ParallelConfig(), ctx.pgs)
    init_weights_by_name(model, seed=0)
    return model.eval(), ctx.pgs


def episodes(args) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Prompts [E][P] and observations [E][turns-1][O] (random printable byte ids)."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(32, 127) for _ in range(n)]  # noqa: E731
    return ([[257, *ids(args.prompt - 1)] for _ in range(args.episodes)],
            [[ids(args.obs) for _ in range(args.turns - 1)] for _ in range(args.episodes)])


def run(engine, prompts, observations, args) -> tuple[float, list[list[int]]]:
    from megatron_rl.rollout import SamplingParams

    contexts, t0 = [list(p) for p in prompts], time.perf_counter()
    for turn in range(args.turns):
        outs = engine.generate(contexts, SamplingParams(temperature=0.0, max_new_tokens=args.new))  # no stop ids
        for i, o in enumerate(outs):
            contexts[i] += o.samples[0].token_ids + (observations[i][turn] if turn < args.turns - 1 else [])
    return time.perf_counter() - t0, contexts


def main() -> None:
    from megatron_rl.rollout import EngineConfig, RolloutEngine

    ap = argparse.ArgumentParser()
    for name, default in (("episodes", 8), ("turns", 3), ("prompt", 600), ("new", 32), ("obs", 64)):
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, pgs = build()
    prompts, obs = episodes(args)
    res = {}
    for name, on in (("cold", False), ("prefix_cache", True)):
        eng = RolloutEngine(model, EngineConfig(num_blocks=2048, max_tokens_per_step=2048, max_running=64,
                                                prefix_cache=on), pgs.tp, pgs.cp)
        run(eng, prompts[:1], obs[:1], args)  # warm-up
        s0 = eng.stats()
        seconds, contexts = run(eng, prompts, obs, args)
        s1 = eng.stats()
        prefilled = (s1["prompt_tokens"] - s0["prompt_tokens"]) - (s1["prefix_hit_tokens"] - s0["prefix_hit_tokens"])
        res[name] = {"seconds": round(seconds, 3), "prefilled_tokens": prefilled, "contexts": contexts}
    same = res["cold"].pop("contexts") == res["prefix_cache"].pop("contexts")
    print(json.dumps({"workload": vars(args), "threads": torch.get_num_threads(), "identical_tokens": same, **res,
                      "speedup": round(res["cold"]["seconds"] / res["prefix_cache"]["seconds"], 2),
                      "prefill_ratio": round(res["prefix_cache"]["prefilled_tokens"] / res["cold"]["prefilled_tokens"],
                                             3)}))


if __name__ == "__main__":
    main()
