"""Under torchrun (gloo, CPU): the rollout HTTP server in TP-serving mode (`tp_serve.serve_tp`).

TP rank 0 serves on a free port; a client thread on rank 0 sends concurrent greedy requests, a sampled
request, a compressed request, a weight update (full weights for seed 4 from a file) and greedy requests
again; the other ranks follow rank 0's broadcast commands. Rank 0 emits the responses;
tests/rollout/test_rollout_engine_multiproc.py compares the TP=2 launch with the TP=1 launch.

    torchrun --nproc_per_node=2 tests/mp/rollout_tp_serve.py
"""
from __future__ import annotations

import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from tests.mp.rollout_tp import PROMPTS, build, new_full_weights


def client_session(url: str, weights_path: str) -> list[dict]:
    from megatron_rl.rollout.client import RolloutClient

    client = RolloutClient(url, timeout=120, retries=0)
    records = []

    def greedy(tag):
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(lambda p: client.complete(p, max_tokens=10, temperature=0), PROMPTS))
        records.extend({"tag": tag, "kind": "greedy", "i": i, "tokens": [c["token_ids"] for c in o["choices"]],
                        "logprobs": [c["logprobs"]["token_logprobs"] for c in o["choices"]],
                        "versions": [c["policy_versions"] for c in o["choices"]]} for i, o in enumerate(outs))

    greedy("before")
    sampled = client.complete(PROMPTS[3], max_tokens=10, temperature=1.0, top_k=40, seed=7, n=2)
    records.append({"tag": "before", "kind": "sampled", "i": 0, "tokens": [c["token_ids"] for c in sampled["choices"]],
                    "logprobs": [c["logprobs"]["token_logprobs"] for c in sampled["choices"]]})
    prompt = [257, *range(20, 44)]
    comp = client.complete(prompt, max_tokens=6, temperature=0, turn_boundaries=[1, 6, 12, 18, 22],
                           compression={"keep_first": 1, "keep_last": 2, "marker_token_ids": [300]})
    records.append({"tag": "before", "kind": "compressed", "i": 0, "prompt": comp["prompt_token_ids"],
                    "compression": comp["compression"], "tokens": [comp["choices"][0]["token_ids"]]})
    records.append({"tag": "update", "kind": "update", "i": 0, **client.update_weights(1, weights_path)})
    greedy("after")
    records.append({"tag": "after", "kind": "health", "i": 0, **client.health()})
    return records


def main() -> None:
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from megatron_rl.distributed import destroy_distributed, init_distributed
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.rollout import EngineConfig, RolloutEngine
    from megatron_rl.rollout.tp_serve import serve_tp
    from tests.mp.launch import emit

    world = int(os.environ["WORLD_SIZE"])
    os.environ["MEGATRON_RL_ROLLOUT_TOKEN"] = "tp-serve-test-token"  # the job token: server and client read it
    ctx = init_distributed(ParallelConfig(tp=world))
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    model = build(ctx.pgs, world)
    engine = RolloutEngine(model, EngineConfig(num_blocks=64, block_size=4, max_tokens_per_step=16),
                           ctx.pgs.tp, ctx.pgs.cp)
    rank = dist.get_rank()
    tmp = tempfile.TemporaryDirectory(prefix="tp-serve-")
    done = threading.Event()
    box: dict = {}
    if rank == 0:
        torch.save(dict(new_full_weights(model)), os.path.join(tmp.name, "w.pt"))

    def session(url):
        try:
            box["records"] = client_session(url, os.path.join(tmp.name, "w.pt"))
        except Exception as e:  # noqa: BLE001 - reported as a record, the test fails on it
            box["records"] = [{"tag": "error", "kind": "error", "i": 0, "error": repr(e)}]
        finally:
            done.set()

    serve_tp(engine, ctx.pgs.tp, ready=lambda url: threading.Thread(target=session, args=(url,)).start(), until=done)
    if rank == 0:
        for r in box["records"]:
            emit({**r, "world": world, "free_blocks": engine.cache.num_free})
    dist.barrier()
    destroy_distributed()
    tmp.cleanup()


if __name__ == "__main__":
    main()
