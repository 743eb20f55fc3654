"""A flat weight file for pushing weights to a separate rollout server on the same node, read straight into
the engine's parameters.

    write_weights(path, named)                       # the driver: one sequential write of the raw bytes
    engine.update_weights(v, read_weights_into(path, params), ...)   # the server: positioned reads

Layout: the magic `MRLW1\\n`, an 8-byte little-endian header length, a JSON header (a list of
[name, shape, dtype, offset, nbytes], offsets from the data's start, each 64-byte aligned), then, from the
next 64-byte boundary, each tensor's raw bytes. Unlike `torch.save` (a zip with a CRC per record, then
`torch.load` memory-mapping it and the engine copying from the mapped pages) the bytes are written once
from the tensor's memory and read once, with `readinto`, into the engine parameter of that name when its
shape and dtype match and it lives in host memory (else into a new host tensor, which the engine's load
copies or rejects, naming it).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from megatron_rl.rollout.weights import DTYPES

MAGIC = b"MRLW1\n"
"""The first bytes of a weight file (a `torch.save`'d state dict starts otherwise: a zip or a pickle)."""
_ALIGN = 64


def is_weight_file(path) -> bool:
    """Whether `path` is a flat weight file (else a `torch.save`'d state dict)."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def write_weights(path, named: Iterable[tuple[str, Tensor]]) -> int:
    """Write `named` to `path` (replaced atomically through `path`.tmp); returns the bytes of tensor data."""
    tensors = [(n, t.detach().contiguous().cpu()) for n, t in named]  # host views (copies only off the host)
    header, offset = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header.append([name, list(t.shape), str(t.dtype), offset, nbytes])
        offset += -(-nbytes // _ALIGN) * _ALIGN
    head = json.dumps(header).encode()
    start = _data_start(len(head))
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + len(head).to_bytes(8, "little") + head)
        for (_, t), (_, _, _, off, nbytes) in zip(tensors, header):
            f.seek(start + off)
            if nbytes:
                f.write(_bytes(t))
    os.replace(tmp, path)
    return sum(e[4] for e in header)


def _data_start(head_len: int) -> int:
    """Where the tensor data starts: after the magic, the length and the header, 64-byte aligned."""
    return -(-(len(MAGIC) + 8 + head_len) // _ALIGN) * _ALIGN


def read_header(f) -> list:
    """The header entries of an open weight file, offsets from the file's start (ValueError on another file)."""
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError(f"{getattr(f, 'name', f)} is not a weight file (no {MAGIC!r} magic)")
    n = int.from_bytes(f.read(8), "little")
    header, start = json.loads(f.read(n)), _data_start(n)
    return [[name, shape, dtype, start + off, nbytes] for name, shape, dtype, off, nbytes in header]


def read_weights_into(path, params: dict[str, Tensor]) -> Iterator[tuple[str, Tensor]]:
    """Yield (name, tensor) for each tensor of the file at `path`; a host parameter of `params` with that name,
    shape and dtype is read into in place (and yielded), others get a new host tensor."""
    with open(path, "rb", buffering=0) as f:
        for name, shape, dtype, offset, nbytes in read_header(f):
            p = params.get(name)
            fits = p is not None and p.device.type == "cpu" and list(p.shape) == shape and \
                str(p.dtype) == dtype and p.is_contiguous()
            t = p.data if fits else torch.empty(shape, dtype=DTYPES[dtype])
            f.seek(offset)
            view = memoryview(_bytes(t)) if nbytes else memoryview(b"")
            got = 0
            while got < nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise ValueError(f"weight file {path} ends inside tensor {name!r} ({got} of {nbytes} bytes)")
                got += n
            yield name, t


def _bytes(t: Tensor):
    """The raw bytes of a contiguous host tensor, as a writable numpy array sharing its memory."""
    return t.reshape(-1).view(torch.uint8).numpy()
