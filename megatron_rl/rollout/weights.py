"""Moving weights from the trainer to rollout engines with torch.distributed, in buckets.

    # on every rank of `group` (the source passes its tensors, the others None):
    for name, tensor in broadcast_named_tensors(named if rank == src else None, src, group):
        ...

The source first broadcasts the metadata (names, shapes, dtypes), then the tensors packed into flat
buckets of at most `bucket_bytes` (one dtype per bucket), so that a large model moves in a few large
collectives with bounded extra memory. `shard_for_tp` cuts a full (unsharded) tensor down to this rank's
tensor-parallel slice using the parameter's Megatron attributes, so a source with a different TP layout
(or a gathered checkpoint) can feed an engine with TP > 1.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def broadcast_named_tensors(named: Iterable[tuple[str, Tensor]] | None, src: int, group=None,
                            bucket_bytes: int = 64 << 20, device=None) -> Iterator[tuple[str, Tensor]]:
    """Yield every (name, tensor) of the source rank `src` (global rank) on all ranks of `group`; receivers'
    buffers on `device` (the backend's: the rank's GPU under NCCL; None: the CPU)."""
    is_src = named is not None
    tensors = dict(named) if is_src else {}
    box = [metadata(tensors) if is_src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    yield from broadcast_known(box[0], tensors if is_src else None, src, group, bucket_bytes, device=device)


def metadata(tensors: dict[str, Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each tensor, the entries `broadcast_known` takes."""
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors.items()]


def broadcast_known(meta: list, tensors: dict[str, Tensor] | None, src: int, group=None,
                    bucket_bytes: int = 64 << 20, scratch: dict | None = None, device=None
                    ) -> Iterator[tuple[str, Tensor]]:
    """Yield the tensors `meta` names (known on every rank of `group`) from `src`, which passes `tensors`.

    scratch: a dict kept by the caller across calls; buckets then reuse its flat buffers (one per dtype)
    instead of allocating (and page-faulting) new ones, and the tensors yielded are views into them, valid
    until the next one is drawn (copy them out, as `load_named_tensors` does). device: where the flat buffers
    live (the backend's device; None: the CPU)."""
    is_src = tensors is not None
    for bucket in _buckets(meta, bucket_bytes):
        dtype, numel = DTYPES[bucket[0][2]], sum(_numel(s) for _, s, _ in bucket)
        flat = _flat(scratch, dtype, numel, device)  # [numel]
        if is_src:
            parts = [tensors[n].detach().reshape(-1).to(dtype) for n, _, _ in bucket]
            flat = torch.cat(parts) if flat is None else torch.cat(parts, out=flat)
        elif flat is None:
            flat = torch.empty(numel, dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        yield from _unpack(flat, bucket)


def _flat(scratch: dict | None, dtype: torch.dtype, numel: int, device=None) -> Tensor | None:
    """A [numel] view of scratch's buffer of `dtype` (grown when too small); None without scratch."""
    if scratch is None:
        return None
    buf = scratch.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = scratch[dtype] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _buckets(meta: list, bucket_bytes: int) -> list[list]:
    """Consecutive runs of metadata entries of one dtype, each under bucket_bytes (or one tensor)."""
    out: list[list] = []
    size = 0
    for entry in meta:
        nbytes = _numel(entry[1]) * DTYPES[entry[2]].itemsize
        if not out or out[-1][0][2] != entry[2] or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return out


def _unpack(flat: Tensor, bucket: list) -> Iterator[tuple[str, Tensor]]:
    offset = 0
    for name, shape, _ in bucket:
        n = _numel(shape)
        yield name, flat[offset:offset + n].view(shape)
        offset += n


def shard_for_tp(full: Tensor, param: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """This rank's slice of the unsharded `full` for Megatron parameter `param` (honours partition_stride)."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False) or full.shape == param.shape:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    parts = full.chunk(stride, dim=dim)  # stride x [..., full_dim / stride, ...]
    return torch.cat([p.chunk(tp_size, dim=dim)[tp_rank] for p in parts], dim=dim)
