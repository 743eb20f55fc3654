"""Rank script: RL steps (GRPO) of the Megatron-Core policy in several layouts vs the one-process run.

    torchrun --nproc_per_node W tests/mp/trainer_parity.py --layouts tp2,pp2,...

Each layout: Policy + RLTrainer (KL reference, recomputed old log-probs, TIS, entropy bonus, chunked
log-probs), STEPS RL steps on synthetic global batches, weights initialised from global parameter names.
Layouts use the fused log-prob path (rl.logprob_impl='fused', the default) unless their name ends in
'_logits'. Afterwards rank 0 starts a one-rank world, runs the one-process reference of every model used
with the layout's log-prob path (the record's loss/metric/weight diffs) and, for fused layouts, also with
the logits path (the record's cross_* diffs), checks that the loss and gradients of the real model do not
depend on the packing, and emits one record per layout. --kl-layouts and --cp-layouts add the layouts of
tests/mp/kl_reward_parity.py and tests/mp/trainer_cp.py to the same launch (one start-up, shared references).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from tests.mp.launch import emit, free_port

SEED, STEPS, VOCAB = 1234, 3, 64
LAYOUTS = {  # name -> (ParallelConfig kwargs, num_layers, moe: bool or "dsv3"/"mla", distributed optimizer)
    "tp2": (dict(tp=2), 2, False, False),
    "pp2": (dict(pp=2), 2, False, False),
    "pp2_vpp2": (dict(pp=2, vpp=2), 4, False, False),
    "ep2_moe": (dict(ep=2), 2, True, False),
    "dp2_distopt": (dict(), 2, False, True),
    "tp2_pp2": (dict(tp=2, pp=2), 2, False, False),
    "tp2_logits": (dict(tp=2), 2, False, False),
    "tp2_sp": (dict(tp=2, sequence_parallel=True), 2, False, False),
    "tp2_pp2_logits": (dict(tp=2, pp=2), 2, False, False),
    "tp2_sp_dsv3": (dict(tp=2, sequence_parallel=True), 2, "dsv3", False),  # MoE + TP needs SP in training
    "ep2_dsv3": (dict(ep=2), 2, "dsv3", False),
    "pp2_dsv3": (dict(pp=2), 2, "dsv3", False),
    "tp2_mla": (dict(tp=2), 2, "mla", False),  # no SP: the shared RoPE key's gradient summed over TP ranks
    "tp2_sp_mtp": (dict(tp=2, sequence_parallel=True), 2, "mtp", False),  # + one MTP layer and its loss
    "ep2_mtp": (dict(ep=2), 2, "mtp", False),
    "pp2_mtp": (dict(pp=2), 2, "mtp", False),  # the MTP layer on the last stage, with its embedding copy
}


def dsv3_config(layers: int):
    """DeepSeek-V3 in miniature: MLA (q/kv latents, YaRN), the first layer dense, then 8 sigmoid-routed experts in
    4 groups (top-2 groups, top-4 experts) with an expert bias, routed scaling and a shared expert."""
    from megatron_rl.models.gpt import MLAConfig, ModelConfig, MoEConfig, RopeScaling

    return ModelConfig(
        num_layers=layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
        max_seq_length=64, rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=16,
                                                    mscale=1.0, mscale_all_dim=1.0),
        mla=MLAConfig(kv_lora_rank=16, q_lora_rank=24, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8),
        moe=MoEConfig(num_experts=8, topk=4, ffn_hidden_size=16, shared_expert_ffn_hidden_size=16,
                      layer_pattern=[0] + [1] * (layers - 1), router_score_function="sigmoid",
                      router_expert_bias=True, router_num_groups=4, router_group_topk=2, routed_scaling_factor=2.5))


def init_model(model) -> None:
    """Weights from their global names; every MoE layer's expert bias the same fixed draw (not zero)."""
    from megatron_rl.compat.testing import init_weights_by_name

    init_weights_by_name(model, SEED)
    bias = torch.rand(8, generator=torch.Generator().manual_seed(SEED)) * 0.2
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buf.copy_(bias)


def model_config(layers: int, moe: bool | str):
    from megatron_rl.models.gpt import ModelConfig, MoEConfig

    if moe in ("dsv3", "mla", "mtp"):  # "mla": DeepSeek-V3's attention with dense MLPs; "mtp": + an MTP layer
        cfg = dsv3_config(layers)
        if moe == "mtp":
            return dataclasses.replace(cfg, mtp_num_layers=1)
        return cfg if moe == "dsv3" else dataclasses.replace(cfg, moe=MoEConfig())
    return ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                       vocab_size=VOCAB, max_seq_length=64,
                       moe=MoEConfig(num_experts=4, topk=2, ffn_hidden_size=32) if moe else MoEConfig())


def rl_config(max_tokens: int = 40, impl: str = "fused"):
    from megatron_rl.kernels.logprob import LogprobKernelConfig
    from megatron_rl.rl.config import AdvantageConfig, LossConfig
    from megatron_rl.trainer.packing import PackingConfig
    from megatron_rl.trainer.rl_step import RLConfig

    return RLConfig(loss=LossConfig(name="grpo", kl_coef=0.05, entropy_coef=0.01, is_correction="tis"),
                    advantage=AdvantageConfig(name="grpo"), packing=PackingConfig(max_tokens=max_tokens),
                    temperature=0.9, logprob_chunk_size=16, old_logprobs="recompute", reference=True,
                    logprob_impl=impl, logprob_kernel=LogprobKernelConfig(impl="torch", chunk_tokens=16,
                                                                          chunk_vocab=24))


def batch(step: int):
    """Global batch of step `step`: 12 samples in 3 groups, lengths 6..30 (same on every rank)."""
    from megatron_rl.data.shards import Trajectory, TrajectoryColumns

    gen = np.random.default_rng(SEED + step)
    trajs = []
    for i in range(12):
        n, prompt = int(gen.integers(6, 31)), int(gen.integers(2, 5))
        mask = (np.arange(n) >= prompt).astype(np.uint8)
        trajs.append(Trajectory(
            tokens=gen.integers(0, VOCAB, n).astype(np.int32), loss_mask=mask,
            logprobs=np.where(mask, np.log(1.0 / VOCAB) + 0.3 * gen.normal(size=n), 0).astype(np.float32),
            prompt_len=prompt, reward=float(gen.integers(0, 2)), group_id=i // 4, policy_version_first=0,
            policy_version_last=0, env="synthetic", task_id=str(i // 4), episode_id=f"s{step}-{i}"))
    return TrajectoryColumns.from_trajectories(trajs)


def build(parallel_kwargs: dict, layers: int, moe: bool, distopt: bool, ctx=None, max_tokens: int = 40,
          impl: str = "fused"):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.distributed import init_distributed
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.trainer.policy import OptimConfig, Policy
    from megatron_rl.trainer.rl_step import RLTrainer

    ctx = ctx or init_distributed(ParallelConfig(**parallel_kwargs))
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    policy = Policy(model_config(layers, moe), OptimConfig(lr=1e-3, clip_grad=1.0, distributed_optimizer=distopt),
                    ctx, total_steps=STEPS, init=init_model)
    return RLTrainer(policy, rl_config(max_tokens, impl))


def _tp_gather(param: torch.Tensor, group) -> torch.Tensor:
    """The unsharded tensor of a TP-sharded parameter (inverse of testing._local_slice)."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach().clone()
    parts = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
    return torch.cat([torch.cat([p.chunk(stride, dim)[j] for p in parts], dim) for j in range(stride)], dim)


def full_weights(policy) -> dict[str, torch.Tensor]:
    """{global name: unsharded weight} of the whole model, on every rank (copies of replicas compared)."""
    from megatron_rl.compat.testing import _tp_group_of, global_param_names

    mine = {}
    for chunk in policy.chunks:
        names, groups = global_param_names(chunk.module), _tp_group_of(chunk.module)
        for local, p in chunk.module.named_parameters():
            mine.setdefault(names[local], []).append(_tp_gather(p, groups.get(local)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, list] = {}
    for d in everyone:
        for k, v in d.items():
            merged.setdefault(k, []).extend(v)
    return merged


def run_layout(name: str) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    par, layers, moe, distopt = LAYOUTS[name]
    start = time.perf_counter()
    trainer = build(par, layers, moe, distopt, impl="logits" if name.endswith("_logits") else "fused")
    metrics = [trainer.step(batch(s)) for s in range(STEPS)]
    weights = full_weights(trainer.policy)
    parallel_state.destroy_model_parallel()
    get_cuda_rng_tracker().reset()
    return {"layout": name, "model": (layers, moe), "impl": trainer.cfg.logprob_impl, "metrics": metrics,
            "weights": weights,
            "seconds": round(time.perf_counter() - start, 2)}


def single_rank_world():
    """Rank 0 alone: a fresh one-rank world and Megatron groups (for the one-process reference)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_rl.compat import cpu
    from megatron_rl.distributed import DistContext, LaunchInfo
    from megatron_rl.parallel import ParallelConfig

    cpu.apply()
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # else the new rendezvous waits for torchrun's store
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    return DistContext(LaunchInfo(0, 1, 0, "127.0.0.1", port, "single"), ParallelConfig().resolve(1), "gloo",
                       ProcessGroupCollection.use_mpu_process_groups())


def reference(layers: int, moe: bool, ctx, impl: str = "fused") -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().reset()
    trainer = build({}, layers, moe, False, ctx=ctx, impl=impl)
    metrics = [trainer.step(batch(s)) for s in range(STEPS)]
    return {"metrics": metrics, "weights": full_weights(trainer.policy)}


def compare(result: dict, ref: dict) -> dict:
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(result["metrics"], ref["metrics"]))
    keys = ("clip_fraction", "ref_kl", "entropy_mean", "tokens", "samples", "mtp_loss")
    metric_diff = max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for a, b in zip(result["metrics"], ref["metrics"])
                      for k in keys)
    missing = sorted(set(ref["weights"]) ^ set(result["weights"]))
    weight_diff = max(float((c - ref["weights"][k][0]).abs().max()) for k, v in result["weights"].items()
                      if k in ref["weights"] for c in v)
    replica_diff = max(float((c - v[0]).abs().max()) for v in result["weights"].values() for c in v)
    return {"layout": result["layout"], "impl": result.get("impl"), "loss_diff": loss_diff, "metric_diff": metric_diff,
            "weight_diff": weight_diff, "names_differ": missing, "losses": [m["loss"] for m in result["metrics"]],
            "ref_losses": [m["loss"] for m in ref["metrics"]], "seconds": result["seconds"],
            "mtp_losses": [m.get("mtp_loss") for m in result["metrics"]],
            "update_ok": all(m["update_ok"] for m in result["metrics"]), "replica_diff": replica_diff}


def packing_invariance(ctx) -> dict:
    """Loss and gradients of the real model under three token budgets (different packings)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    out = []
    for budget in (30, 45, 120):
        get_cuda_rng_tracker().reset()
        trainer = build({}, 2, False, False, ctx=ctx, max_tokens=budget)
        mbs, _ = trainer.prepare(batch(0))
        loss, grads = trainer.compute_gradients(batch(0))
        out.append((len(mbs), loss, grads))
    grad_diff = max(float((g - out[0][2][n]).abs().max()) for _, _, gr in out[1:] for n, g in gr.items())
    grad_max = max(float(g.abs().max()) for g in out[0][2].values())
    return {"packing": True, "microbatches": [o[0] for o in out], "losses": [o[1] for o in out],
            "grad_diff": grad_diff, "grad_max": grad_max}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="")
    parser.add_argument("--packing", action="store_true", help="also check packing invariance (rank 0)")
    parser.add_argument("--kl-layouts", default="", help="also tests/mp/kl_reward_parity.py's layouts (dp2,pp2,cp2) "
                                                         "in this launch: its records carry kl_reward=True")
    parser.add_argument("--cp-layouts", default="", help="also tests/mp/trainer_cp.py's layouts in this launch: "
                                                         "its records carry cp=True and the splits")
    parser.add_argument("--also", default="", help="comma-separated rank scripts of tests/mp run in this launch "
                        "after the layouts, NAME or NAME:ARG (lora_tp, ckpt_resume:DIR, uneven_stages:DIR): their "
                        "world_part(ARG) on every rank, one_process_part(state, ctx, ARG) on rank 0 in the one-rank "
                        "world; their records carry script=NAME")
    args = parser.parse_args()
    results = [run_layout(n) for n in args.layouts.split(",") if n]
    kl_names = [n for n in args.kl_layouts.split(",") if n]
    if kl_names:
        from tests.mp import kl_reward_parity

        kl_results = kl_reward_parity.run_layouts(kl_names)
    from tests.mp import trainer_cp

    cp_results = [trainer_cp.run_layout(n) for n in args.cp_layouts.split(",") if n]
    also = []  # (name, module, arg, state)
    for spec in [s for s in args.also.split(",") if s]:
        name, _, arg = spec.partition(":")
        module = importlib.import_module(f"tests.mp.{name}")
        state, mine = module.world_part(arg or None)
        for record in mine:
            emit({**record, "script": name})
        also.append((name, module, arg or None, state))
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        return
    ctx = single_rank_world()
    refs = {}

    def ref(model, impl):
        if (model, impl) not in refs:
            refs[model, impl] = reference(*model, ctx, impl=impl)
        return refs[model, impl]

    for res in results:
        key = tuple(res["model"])
        record = compare(res, ref(key, res["impl"]))
        if res["impl"] == "fused":  # the fused layout against the one-process LOGITS path
            cross = compare(res, ref(key, "logits"))
            record.update({f"cross_{k}": cross[k] for k in ("loss_diff", "metric_diff", "weight_diff")})
        emit(record)
    if args.packing:
        emit(packing_invariance(ctx))
    for res in cp_results:  # as trainer_cp.py emits them (its reference: the fused one-process run)
        emit({**compare(res, ref(tuple(res["model"]), "fused")), "splits": res["splits"], "cp": True})
    if kl_names:
        kl_reward_parity.emit_compared(kl_results, ctx)
    for name, module, arg, state in also:  # last: ckpt_resume's TP=1 resume keeps its groups
        for record in module.one_process_part(state, ctx, arg):
            emit({**record, "script": name})


if __name__ == "__main__":
    main()
