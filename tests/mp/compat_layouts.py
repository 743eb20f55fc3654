"""Train a tiny GPTModel on CPU/gloo in several parallel layouts in one launch; print JSON results.

    python tests/mp/compat_layouts.py --world 2 --layouts dense_tp2,pp2 [--needed] [--ckpt DIR] --out F

Spawns ``--world`` ranks. Each rank applies ``megatron_rl.compat.cpu``, then runs every layout (3 Adam
steps, weights from ``init_weights_by_name``) and records the losses. ``--needed`` then reruns, for
each CPU-compat patch, the layout named in its ``is_needed`` with that patch switched off through
``MEGATRON_RL_CPU_COMPAT_DISABLE`` (errors are caught and recorded). ``--ckpt`` saves the ``dense_tp2``
model with dist_checkpointing. Finally rank 0 re-initialises a one-rank world and computes the
one-process reference of every model used (and loads the checkpoint at TP=1), writing all to ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import time
import traceback
from dataclasses import dataclass

import torch

SEED, STEPS, GLOBAL_BATCH, SEQ, VOCAB = 1234, 3, 4, 32, 128


@dataclass(frozen=True)
class Layout:
    """Parallel degrees and model variant of one scenario."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    sp: bool = False
    moe: str | None = None
    """MoE token dispatcher ('alltoall', 'allgather'); None for a dense model."""
    distopt: bool = False
    layers: int = 2
    mla: bool = False
    """Multi-latent attention (DeepSeek-V3) instead of standard attention."""

    def model_key(self) -> str:
        """The one-process model this layout must reproduce."""
        return f"{'mla' if self.mla else 'moe' if self.moe else 'dense'}{self.layers}"


LAYOUTS = {
    "dense_dp2": Layout(),
    "dense_tp2": Layout(tp=2),
    "dense_tp2_sp": Layout(tp=2, sp=True),
    "pp2": Layout(pp=2),
    "pp2_vpp2": Layout(pp=2, vpp=2, layers=4),
    "moe_ep2_alltoall": Layout(ep=2, moe="alltoall"),
    "moe_ep2_allgather": Layout(ep=2, moe="allgather"),
    "distopt_dp2": Layout(distopt=True),
    "tp2_pp2": Layout(tp=2, pp=2),
    "moe_tp2_ep2_sp": Layout(tp=2, ep=2, sp=True, moe="alltoall"),
    "mla_tp2": Layout(tp=2, mla=True),
}
REFERENCES = {"dense2": Layout(), "dense4": Layout(layers=4), "moe2": Layout(moe="alltoall"),
              "mla2": Layout(mla=True)}
MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16, qk_layernorm=True, rope_type="rope")
"""MLATransformerConfig fields of the MLA scenario (plain RoPE)."""


def transformer_config(lay: Layout):
    """Tiny fp32 GPT config for ``lay``; dropout off so every layout computes the same function."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type=lay.moe,
               moe_aux_loss_coeff=0.0, moe_ffn_hidden_size=64, add_bias_linear=False) if lay.moe else {}
    return (MLATransformerConfig if lay.mla else TransformerConfig)(
        num_layers=lay.layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=lay.tp,
        pipeline_model_parallel_size=lay.pp, virtual_pipeline_model_parallel_size=lay.vpp,
        expert_model_parallel_size=lay.ep, sequence_parallel=lay.sp, bias_dropout_fusion=False,
        **moe, **(MLA if lay.mla else {}),
    )


def layer_spec(lay: Layout):
    """The local spec; for MLA with megatron_rl's core attention and kv down projection (models/mla_attention)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_rl.models.mla_attention import MLADotProductAttention, replicated_linear

    spec = get_gpt_layer_local_spec(num_experts=4 if lay.moe else None, multi_latent_attention=lay.mla,
                                    qk_layernorm=lay.mla)
    if lay.mla:
        spec.submodules.self_attention.submodules.core_attention = MLADotProductAttention
        spec.submodules.self_attention.submodules.linear_kv_down_proj = replicated_linear()
    return spec


def build_chunks(lay: Layout):
    """Model chunks (one per virtual stage) with layout-independent weights, wrapped in DDP."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.models.mla_attention import fix_rope_key_grad

    config = transformer_config(lay)
    spec = layer_spec(lay)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=lay.distopt,
                                               overlap_grad_reduce=lay.distopt)
    chunks = []
    for vp in range(lay.vpp or 1):
        stage = dict(ignore_virtual=False, vp_stage=vp) if lay.vpp else {}
        model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         pre_process=ps.is_pipeline_first_stage(**stage),
                         post_process=ps.is_pipeline_last_stage(**stage), vp_stage=vp if lay.vpp else None,
                         share_embeddings_and_output_weights=True)  # PP: tied copies on first and last stage
        fix_rope_key_grad(model, ps.get_tensor_model_parallel_group())  # MLA only
        init_weights_by_name(model, SEED)
        chunks.append(DistributedDataParallel(config, ddp_config, model, disable_bucketing=vp > 0))
    return config, chunks


def batches(step: int, dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's micro-batches (1 sequence each) of global batch ``step``: (tokens, labels)."""
    gen = torch.Generator().manual_seed(SEED + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)  # [B, S+1]
    mine = data.chunk(dp_size)[dp_rank]  # [B/dp, S+1]
    return [(row[None, :-1], row[None, 1:]) for row in mine]  # each ([1, S], [1, S])


def forward_step(data_iterator, model):
    """Megatron forward step: per-token LM loss [1, S], averaged by the loss function."""
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ)[None, :]  # [1, S]
    output = model(tokens, position_ids, None, labels=labels)  # [1, S]

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return output, loss_func


def run_batch(chunks, micro, forward_only: bool) -> float | None:
    """One forward(-backward) over the micro-batches; mean loss over the DP group (None off last stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    iters = [iter(micro) for _ in chunks]
    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(micro), seq_length=SEQ,
        micro_batch_size=1, forward_only=forward_only)
    if not ps.is_pipeline_last_stage():
        return None
    loss = torch.stack([d["lm loss"] for d in out]).mean()  # []
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    return loss.item() / ps.get_data_parallel_world_size()


def train(lay: Layout, ckpt: str | None = None) -> dict:
    """Initialise ``lay``, train STEPS Adam steps, evaluate one held-out batch; losses seen by rank 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(lay.tp, lay.pp, virtual_pipeline_model_parallel_size=lay.vpp,
                                 expert_model_parallel_size=lay.ep)
    model_parallel_cuda_manual_seed(SEED)
    config, chunks = build_chunks(lay)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0,
                                                       use_distributed_optimizer=lay.distopt), chunks)
    dp = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    losses = []
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(run_batch(chunks, batches(step, *dp), forward_only=False))
        optimizer.step()
    result = {"losses": losses, "eval": run_batch(chunks, batches(STEPS, *dp), True)}
    if ckpt:
        save_checkpoint(chunks, ckpt)
    return gather_from_last_stage(result)


def gather_from_last_stage(result: dict) -> dict:
    """The result of a last-pipeline-stage rank (all of them agree after the DP all-reduce)."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, result)
    return next(r for r in everyone if r["eval"] is not None)


def save_checkpoint(chunks, path: str) -> None:
    """dist_checkpointing save of the (single) model chunk."""
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist_checkpointing.save(chunks[0].module.sharded_state_dict(), path)


def eval_loaded_checkpoint(path: str) -> float:
    """Build the one-process dense model, load ``path`` into it, return the held-out loss."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(SEED)
    _, chunks = build_chunks(REFERENCES["dense2"])
    model = chunks[0].module
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))
    return run_batch(chunks, batches(STEPS, 0, 1), forward_only=True)


def guarded(fn, *args) -> dict:
    """Run fn, turning an exception into {'error': ...}; always tear Megatron's global state down."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    start = time.perf_counter()
    try:
        return {"ok": True, **fn(*args), "seconds": round(time.perf_counter() - start, 2)}
    except Exception as exc:  # recorded: disabled patches are expected to fail here
        frames = traceback.extract_tb(exc.__traceback__)
        inner = [f for f in frames if "megatron/core" in f.filename][-1:] + frames[-1:]
        where = " -> ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in inner)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300], "where": where}
    finally:
        ps.destroy_model_parallel()
        get_cuda_rng_tracker().reset()


def needed_layout(patch) -> str:
    """The layout a patch's ``is_needed`` names (text before the colon)."""
    return patch.is_needed.split(":")[0]


def run_needed(layout_names: list[str]) -> dict:
    """Each patch whose ``is_needed`` layout is in this launch, switched off by the env var, then on."""
    from megatron_rl.compat import cpu

    results = {}
    for name, patch in cpu.PATCHES.items():
        layout = needed_layout(patch)
        if layout not in layout_names:
            continue
        os.environ[cpu.ENV_DISABLE] = name
        active = cpu.apply()
        results[name] = {"layout": layout, "active": active, **guarded(train, LAYOUTS[layout])}
        del os.environ[cpu.ENV_DISABLE]
        cpu.apply()
        torch.distributed.barrier()
    return results


def worker(rank: int, args: argparse.Namespace) -> None:
    """One rank: all layouts (+ still-needed scenarios), then rank 0's one-process references."""
    from megatron_rl.compat import cpu

    cpu.apply()
    timeout = datetime.timedelta(seconds=args.timeout)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                                         rank=rank, world_size=args.world, timeout=timeout)
    out = {"layouts": {n: guarded(train, LAYOUTS[n], args.ckpt if n == "dense_tp2" else None)
                       for n in args.layouts}}
    if args.needed:
        out["needed"] = run_needed(args.layouts)
    torch.distributed.destroy_process_group()
    if rank == 0:
        out.update(references(args))
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def references(args: argparse.Namespace) -> dict:
    """One-process runs (a fresh world of size 1) of every model the layouts use."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                         rank=0, world_size=1)
    keys = {LAYOUTS[n].model_key() for n in args.layouts}
    refs = {"references": {k: guarded(train, REFERENCES[k]) for k in sorted(keys)}}
    if args.ckpt:
        refs["ckpt_tp1_eval"] = guarded(lambda p: {"eval": eval_loaded_checkpoint(p)}, args.ckpt)
    torch.distributed.destroy_process_group()
    return refs


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--layouts", type=lambda s: [x for x in s.split(",") if x], default=[])
    parser.add_argument("--needed", action="store_true",
                        help="switch off each patch whose is_needed layout is in --layouts, rerun that layout")
    parser.add_argument("--ckpt", default=None, help="save dense_tp2 here and load it at TP=1")
    parser.add_argument("--timeout", type=float, default=60.0, help="gloo collective timeout (s)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    unknown = [n for n in args.layouts if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]!r}; known: {sorted(LAYOUTS)}")
    args.port = free_port()
    torch.multiprocessing.start_processes(worker, args=(args,), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":  # required: dist_checkpointing save starts a multiprocessing manager
    main()
