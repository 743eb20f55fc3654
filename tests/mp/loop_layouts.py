"""Rank script: the RL loop's engine set-up and weight sync (`loop.job.build` + `loop.job.sync_weights`) at
several trainer layouts in one 4-rank launch; greedy rollouts must equal the one-copy (TP=1, PP=EP=1) loop's.

For each case the loop's parts are built from a RunConfig, the policy's weights are drawn from each
parameter's global name (the same model in every layout), the loop's sync copies them into the engine, and
every rank generates greedily. The sync must write every engine parameter (the engine raises otherwise);
each case also checks that a sync missing one trainer tensor is refused naming it. With
`server: separate` the weights the loop pushes to a separate rollout server are captured and loaded into a
fresh engine (as `rollout/server.py` does), which must generate the same.

    torchrun --nproc_per_node 4 tests/mp/loop_layouts.py --dir DIR
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist

PROMPTS = [[1, *range(10 + 7 * i, 10 + 7 * i + n)] for i, n in enumerate([2, 9, 4, 13])]
DENSE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=384,
             max_seq_length=64)
MOE = dict(DENSE, num_layers=2, moe={"num_experts": 4, "topk": 2, "ffn_hidden_size": 32})
CASES = [  # (name, model, parallel); each name's model reference is the first case with that model
    ("ref_tied", dict(DENSE), {}),
    ("pp2_tied", dict(DENSE), {"pp": 2}),
    ("pp2_vpp2_tied", dict(DENSE), {"pp": 2, "vpp": 2}),
    ("tp2_pp2_tied", dict(DENSE), {"tp": 2, "pp": 2}),
    ("ref_untied", dict(DENSE, tie_embeddings=False), {}),
    ("pp2_untied", dict(DENSE, tie_embeddings=False), {"pp": 2}),
    ("ref_moe", MOE, {}),
    ("ep2_moe_separate", MOE, {"ep": 2}),
    ("tp2_ep2_etp1_moe", MOE, {"tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True}),
    ("tp2_etp4_moe", MOE, {"tp": 2, "etp": 4, "sequence_parallel": True}),
]


class Captured:
    """Stands in for the rollouts object: keeps what the loop pushes to a separate rollout server."""

    def __init__(self):
        self.pushed: dict | None = None

    def push_weights(self, version, named) -> None:
        self.pushed = {n: t.detach().clone() for n, t in named}


def config(model: dict, parallel: dict, run_dir: Path):
    from megatron_rl.config import from_dict, validate
    from megatron_rl.run_config import RunConfig

    raw = {"name": "layouts", "output_dir": str(run_dir), "launch": {"nproc_per_node": 4}, "parallel": parallel,
           "model": model, "data": {"train_tasks": 8, "heldout_tasks": 4},
           "curriculum": {"enabled": True, "rl_tasks": 8}, "train": {"steps": 0, "seq_length": 32},
           "rl": {"steps": 1, "max_new_tokens": 8, "prompts_per_step": 2, "group_size": 2},
           "monitor": {"tensorboard": False}, "engine": {"num_blocks": 64}}
    cfg = from_dict(RunConfig, raw)
    validate(cfg)
    return cfg


def run_case(name: str, model: dict, parallel: dict, run_dir: Path) -> dict:
    from megatron.core import tensor_parallel

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.distributed import init_distributed
    from megatron_rl.loop import job as setup
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.rollout import SamplingParams
    from tests.mp.ckpt_resume import reset

    cfg = config(model, parallel, run_dir / name)
    ctx = init_distributed(ParallelConfig(**parallel))
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    parts = setup.build(cfg, run_dir / name, ctx)
    if "vpp" in name or "ep2" in name:  # these cases send tensors of >= 16 KiB on their own, straight into the engine
        parts.sync.direct_bytes = 16 << 10
    init_weights_by_name([c.module for c in parts.policy.chunks], seed=5)
    captured = Captured()
    setup.sync_weights(parts, captured, version=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    outs = parts.engine.generate(PROMPTS, greedy)
    rec = {"case": name, "tokens": [o.samples[0].token_ids for o in outs],
           "logprobs": [o.samples[0].logprobs for o in outs], "version": parts.engine.version,
           "engine_params": len(dict(parts.engine.model.named_parameters())),
           "engine_layers": len(parts.engine.model.decoder.layers)}
    rec["refused"] = refused_without_one(parts)
    if name.endswith("_separate"):  # a separate server at TP=1 loads rank 0's push into an engine of its own
        fresh, _ = setup.build_engine(cfg, ctx, parts.tok.vocab_size)
        if ctx.rank == 0:
            fresh.update_weights(1, captured.pushed.items(), complete=True)
            rec["server_tokens"] = [o.samples[0].token_ids for o in fresh.generate(PROMPTS, greedy)]
            rec["pushed_experts"] = sorted({n.split("local_experts.")[1].split(".")[0] for n in captured.pushed
                                            if "local_experts" in n})
    parts.close()
    reset()
    return rec


def refused_without_one(parts) -> str | None:
    """Sync the policy's tensors but the last stage's final norm: the engine must refuse, naming it."""
    named = [(n, t) for n, t in parts.policy.global_named_tensors() if n != "decoder.final_layernorm.weight"]
    try:
        parts.sync(parts.engine, 2, named)
    except RuntimeError as e:
        return str(e)
    return None


def main() -> None:
    from tests.mp.launch import emit

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--cases", default=",".join(c[0] for c in CASES))
    args = parser.parse_args()
    want = args.cases.split(",")
    for name, model, parallel in CASES:
        if name in want:
            rec = run_case(name, model, parallel, Path(args.dir))
            emit({**rec, "rank": dist.get_rank()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
