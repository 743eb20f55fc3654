"""Process plumbing for the converters: distributed start-up, atomic output folders, progress, logits."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.convert.arch.base import ConvertError
from megatron_rl.distributed import group_leader, group_rank, group_size

TMP_TAG_ENV = "MRL_CONVERT_TMP_TAG"
"""Set by the command that starts the local ranks: the suffix of the temporary output folder (its pid)."""


def layout_config(tp: int = 1, pp: int = 1, ep: int = 1, stages: dict | None = None, model=None):
    """The converter's ParallelConfig, validated (against `model`, a ModelConfig, when given) before any rank
    starts. `stages`: an uneven split of the layers over the pp ranks (ParallelConfig's first_stage_layers /
    last_stage_layers / pipeline_layout; one chunk per rank: no virtual stages)."""
    from megatron_rl.config import ConfigError, from_dict
    from megatron_rl.parallel import ParallelConfig

    try:
        parallel = from_dict(ParallelConfig, {"tp": tp, "pp": pp, "ep": ep, **(stages or {})}, prefix="parallel")
        if model is not None:
            model.check_parallel(parallel)
    except ConfigError as e:
        raise ConvertError(f"{e} (convert: --tp/--pp/--ep, --first-stage-layers / --last-stage-layers / "
                           f"--pipeline-layout)") from None
    return parallel


def start(tp: int = 1, pp: int = 1, ep: int = 1, stages: dict | None = None):
    """DistContext for the layout (`layout_config`); in a single process it reuses an already started one of the
    same layout."""
    from megatron.core import parallel_state

    from megatron_rl.distributed import attach_distributed, init_distributed

    parallel = layout_config(tp, pp, ep, stages)
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise ConvertError(f"this process already runs layout tp,pp,ep={have}; asked for {(tp, pp, ep)}")
        return attach_distributed(parallel)
    ctx = init_distributed(parallel, timeout_minutes=10)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)  # the attention RNG tracker must exist even without dropout
    return ctx


# `group` below: the converter's ranks (`DistContext.world`, or `world_group()` at the entry point), None
# when torch.distributed is not started (one process).
def is_rank0(group) -> bool:
    return group_rank(group) == 0


def gather_report(report: dict, group) -> dict:
    """Rank 0's report, with the verify result of the rank that held the logits (last pipeline stage)."""
    if group_size(group) == 1:
        return report
    reports: list = [None] * group_size(group)
    dist.all_gather_object(reports, report, group=group)
    held = [r["verify"] for r in reports if "max_abs_logit_diff" in r.get("verify", {})]
    return {**reports[0], **({"verify": held[0]} if held else {})}


def barrier(group) -> None:
    if group_size(group) > 1:
        dist.barrier(group=group)


def tmp_path(out: Path, group) -> Path:
    """`<out>.tmp-<pid>`: the launching command's pid under local ranks (same on all ranks), else this process's (the
    group's first rank's)."""
    tag = os.environ.get(TMP_TAG_ENV)
    if tag is None:
        tag = str(os.getpid())
        if group_size(group) > 1:
            box = [tag]
            dist.broadcast_object_list(box, src=group_leader(group), group=group)
            tag = box[0]
    return out.with_name(f"{out.name}.tmp-{tag}")


@contextlib.contextmanager
def atomic_dir(out: str | Path, group):
    """Yield a temporary folder that becomes `out` on success and is removed on any error (collective over
    `group`, whose first rank creates and renames it)."""
    out = Path(out).absolute()
    if out.exists():
        raise ConvertError(f"output {out} already exists; choose a new path or remove it")
    tmp = tmp_path(out, group)
    if is_rank0(group):
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(group)
    try:
        yield tmp
        barrier(group)
        if is_rank0(group):
            os.replace(tmp, out)
        barrier(group)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def release_freed_memory() -> None:
    """Give the C heap's freed memory back to the OS (glibc `malloc_trim`; a no-op elsewhere). A converted
    tensor's temporaries (the HF parts, the fused tensor made of them: a layer's worth) are freed after each copy,
    but glibc's growing mmap threshold keeps such blocks in its heap, so without this they stay resident on top
    of the model (~42 MB for SmolLM2-135M: benchmarks/import_memory.py)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        try:
            _LIBC = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)


_LIBC = None


def progress(items, desc: str, enabled: bool = True):
    """tqdm when installed, else a one-line counter on stderr."""
    items = list(items)
    if not enabled:
        return items
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr, leave=False)
    except ImportError:
        return _simple_progress(items, desc)


def _simple_progress(items, desc):
    for i, x in enumerate(items):
        print(f"\r{desc}: {i + 1}/{len(items)}", end="", file=sys.stderr, flush=True)
        yield x
    print(file=sys.stderr)


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor, ctx) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, V] on the last pipeline stage (None elsewhere); TP slices gathered."""
    pp, tp = ctx.pgs.pp, ctx.pgs.tp
    stage, stages = dist.get_rank(pp), dist.get_world_size(pp)
    b, s = tokens.shape
    model.eval()
    if stage > 0:
        hidden = torch.empty(s, b, model.config.hidden_size, dtype=model.config.params_dtype)  # [s, b, h]
        dist.recv(hidden, dist.get_global_rank(pp, stage - 1))
        model.set_input_tensor(hidden)
    out = model(tokens, torch.arange(s).expand(b, s), None)
    if stage < stages - 1:
        dist.send(out.contiguous(), dist.get_global_rank(pp, stage + 1))
        return None
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(tp))]
    dist.all_gather(parts, out.contiguous(), group=tp)
    return torch.cat(parts, dim=-1).float()  # [b, s, V]
