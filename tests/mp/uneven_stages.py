"""Rank script: uneven pipeline stages (5 layers, which pp x vpp = 2 or 4 does not divide) vs the one-process run.

    torchrun --nproc_per_node 2 tests/mp/uneven_stages.py --dir CKPT

Layouts: pp2 with parallel.first_stage_layers=2 (2 + 3 layers), and DeepSeek-V3 in miniature (MLA, MoE, one MTP
layer) at pp2 x vpp2 with parallel.pipeline_layout 'Et|tt|tt|mL' (the shape of DeepSeek-V3's published layout:
the last chunk holds only the MTP layer and the loss). Each runs three GRPO steps (tests/mp/trainer_parity.py)
and then computes the log-probs of a fourth batch; the second layout saves a checkpoint after step 1. Rank 0 then
runs the one-process references in a fresh one-rank world and loads that checkpoint there (an even, one-stage
layout): the loaded weights must equal the uneven run's at the save, and the next step its step 2.
(tests/trainer/test_trainer_multiproc.py runs it inside trainer_parity.py's launch: --also uneven_stages:CKPT.)
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from tests.mp.launch import emit
from tests.mp.trainer_parity import STEPS, batch, build, compare, full_weights, single_rank_world

LAYOUTS = {  # name -> (ParallelConfig kwargs, num_layers, model kind of trainer_parity.model_config)
    "pp2_first2": (dict(pp=2, first_stage_layers=2), 5, False),
    "pp2_vpp2_layout_dsv3_mtp": (dict(pp=2, vpp=2, pipeline_layout="Et|tt|tt|mL"), 5, "mtp"),
}
SAVES = "pp2_vpp2_layout_dsv3_mtp"


def reset_rng() -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().reset()


def logprobs(trainer, cols) -> list[float]:
    """Log-probs of every token of `cols` under the current policy, [T] on every rank."""
    mbs, _ = trainer.prepare(cols)
    places = trainer._token_places(cols, mbs)
    trainer._store_logprobs(trainer.policy, mbs, "lp")
    return trainer._gather(cols, mbs, places, lambda mb: mb["lp"].reshape(-1), "lp").cpu().tolist()


def synced(policy) -> dict[str, torch.Tensor]:
    """What the engine's weight sync sends: every rank's tensors under their global names (tp=1: whole)."""
    mine = {n: t.detach().clone() for n, t in policy.global_named_tensors()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for d in everyone for k, v in d.items()}


def run(name: str, parallel: dict, ckpt: str | None, ctx=None) -> dict:
    from megatron.core import parallel_state

    from megatron_rl.trainer.checkpoint import save_checkpoint

    _, layers, kind = LAYOUTS[name]
    reset_rng()
    trainer = build(parallel, layers, kind, False, ctx=ctx)
    metrics, saved = [], None
    for s in range(STEPS):
        metrics.append(trainer.step(batch(s)))
        if ckpt and s == 1:
            save_checkpoint(trainer.policy, ckpt, reference=trainer.reference, extra={"data_step": 2})
            saved = full_weights(trainer.policy)
    out = {"layout": name, "metrics": metrics, "weights": full_weights(trainer.policy),
           "synced": synced(trainer.policy), "logprobs": logprobs(trainer, batch(STEPS)),
           "seconds": 0.0, "saved": saved,
           "chunks": [len(c.module.decoder.layers) for c in trainer.policy.chunks]}
    if ctx is None:  # this layout's own groups (a given ctx is the one-rank world, kept)
        parallel_state.destroy_model_parallel()
    return out


def resumed(ckpt: str, ctx) -> dict:
    from megatron_rl.trainer.checkpoint import load_checkpoint

    _, layers, kind = LAYOUTS[SAVES]
    reset_rng()
    trainer = build({}, layers, kind, False, ctx=ctx)
    extra = load_checkpoint(trainer.policy, ckpt, reference=trainer.reference)
    loaded = full_weights(trainer.policy)
    loss = trainer.step(batch(extra["data_step"]))["loss"]
    return {"loaded": loaded, "loss": loss, "weights": full_weights(trainer.policy)}


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return max(float((x - b[k][0]).abs().max()) for k, v in a.items() for x in v)


def world_part(path: str) -> tuple[dict, list[dict]]:
    """Every rank, in the launch's world of 2: both layouts (the second saving at `path`); (state, records of
    this rank: rank 1's layers per chunk)."""
    results = {n: run(n, par, path if n == SAVES else None) for n, (par, _, _) in LAYOUTS.items()}
    rank = dist.get_rank()
    return results, [] if rank == 0 else [{"rank": rank, "chunks": {n: r["chunks"] for n, r in results.items()}}]


def one_process_part(results: dict, ctx, path: str) -> list[dict]:
    """Rank 0 in a one-rank world (`ctx`): each layout against its one-process run, then the checkpoint loaded
    into one stage."""
    records = []
    for name, res in results.items():
        ref = run(name, {}, None, ctx=ctx)
        record = compare(res, ref)
        lp_diff = max(abs(a - b) for a, b in zip(res["logprobs"], ref["logprobs"]))
        sync = {"sync_names_differ": sorted(set(res["synced"]) ^ set(ref["synced"])),
                "sync_tensors": len(ref["synced"]),
                "sync_diff": max(float((t - ref["synced"][k]).abs().max()) for k, t in res["synced"].items()
                                 if k in ref["synced"])}
        records.append({**record, **sync, "logprob_diff": lp_diff, "logprobs": len(res["logprobs"]),
                        "chunks": res["chunks"], "rank": 0})
    back = resumed(path, ctx)
    uneven = results[SAVES]
    return records + [{"kind": "resume_one_process", "loaded_diff": _max_diff(back["loaded"], uneven["saved"]),
                       "loss": back["loss"], "unbroken": uneven["metrics"][2]["loss"],
                       "weight_diff": _max_diff(back["weights"], uneven["weights"]),
                       "moved": _max_diff(back["loaded"], uneven["weights"])}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    results, mine = world_part(args.dir)
    rank = dist.get_rank()
    dist.destroy_process_group()
    for record in mine:
        emit(record)
    if rank == 0:
        for record in one_process_part(results, single_rank_world(), args.dir):
            emit(record)


if __name__ == "__main__":  # required: dist_checkpointing save starts a multiprocessing manager
    torch.set_num_threads(1)
    main()
