"""Under torchrun (gloo, CPU): the rollout engine with TP = world size, then a bucketed broadcast weight update.

Every rank builds the policy (weights drawn from each parameter's global name, so TP=1 and TP=2 hold the
same model), generates greedy and sampled continuations, then rank 0 broadcasts full (unsharded) new
weights in small buckets, every rank cuts its TP slice, and the greedy run is repeated. Rank 0 emits the
outputs; tests/rollout/test_rollout_engine_multiproc.py compares the TP=2 launch with the TP=1 launch. With
--models gqa,dsv3 one launch does this for each model in turn (the start-up of a launch paid once).

    torchrun --nproc_per_node=2 tests/mp/rollout_tp.py [--models gqa,dsv3]   # default: gqa
"""
from __future__ import annotations

import sys

import torch

PROMPTS = [[257, *range(10 + 7 * i, 10 + 7 * i + n)] for i, n in enumerate([2, 9, 4, 17, 1, 12])]


def build(pgs, tp: int, dsv3: bool = False):
    """The policy at TP=`tp`: a small GQA model, or (dsv3) DeepSeek-V3 in miniature."""
    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.models.gpt import ModelConfig, build_gpt
    from megatron_rl.parallel import ParallelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=384,
                      max_seq_length=128)
    if dsv3:  # DeepSeek-V3 in miniature: MLA over the latent cache, sigmoid-routed MoE
        from dataclasses import replace

        from tests.models.test_deepseek_v3 import tiny_dsv3

        cfg = replace(tiny_dsv3(), vocab_size=384, max_seq_length=128)
    model = build_gpt(cfg, ParallelConfig(tp=tp), pgs)
    init_weights_by_name(model, seed=3)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.mul_(3)
    return model.eval()


def new_full_weights(model) -> list[tuple[str, torch.Tensor]]:
    """Unsharded weights for seed 4, as a TP=1 trainer would hold them (names as in the model)."""
    from megatron_rl.compat.testing import _draw, _global_shape, global_param_names

    names = global_param_names(model)
    out = []
    for local, p in model.named_parameters():
        size = p.tp_group.size() if getattr(p, "tp_group", None) is not None else None
        full = _draw(names[local], _global_shape(p, size or _tp_size()), 4).float()
        out.append((local, full * 3 if "word_embeddings" in local else full))
    return out


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def run(engine, tag: str) -> list[dict]:
    from megatron_rl.rollout import SamplingParams

    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    sampled = engine.generate(PROMPTS[:3], SamplingParams(temperature=1.0, top_k=40, max_new_tokens=10, seed=7, n=2))
    return [{"tag": tag, "kind": kind, "i": i, "tokens": [s.token_ids for s in o.samples],
             "logprobs": [s.logprobs for s in o.samples], "versions": [s.policy_versions for s in o.samples]}
            for kind, outs in (("greedy", greedy), ("sampled", sampled)) for i, o in enumerate(outs)]


def models() -> list[str]:
    """The models named by --models (gqa, dsv3; comma-separated), in order."""
    names = sys.argv[sys.argv.index("--models") + 1].split(",") if "--models" in sys.argv else ["gqa"]
    assert set(names) <= {"gqa", "dsv3"}, names
    return names


def main() -> None:
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from megatron_rl.distributed import destroy_distributed, init_distributed
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.rollout import EngineConfig, RolloutEngine
    from tests.mp.launch import emit

    world = int(__import__("os").environ["WORLD_SIZE"])
    ctx = init_distributed(ParallelConfig(tp=world))
    rank = dist.get_rank()
    for name in models():
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        model = build(ctx.pgs, world, dsv3=name == "dsv3")
        engine = RolloutEngine(model, EngineConfig(num_blocks=64, block_size=4, max_tokens_per_step=16),
                               ctx.pgs.tp, ctx.pgs.cp)
        records = run(engine, "before")
        named = new_full_weights(model) if rank == 0 else None
        n = engine.update_weights_from_broadcast(1, src=0, named_tensors=named, bucket_bytes=64 << 10)
        records += run(engine, "after")
        if rank == 0:
            for r in records:
                emit({**r, "model": name, "world": world, "loaded": n, "free_blocks": engine.cache.num_free})
        dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
