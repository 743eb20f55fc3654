"""HF folders: read tensors lazily from (sharded) safetensors, write sharded safetensors with an index.

Reading parses each shard's safetensors header once and reads only the tensors asked for, each with one
positioned read (`os.pread`) into memory of its own: no memory map, so pages of tensors already copied into
the model do not stay resident (a memory-mapped read left the whole file in the process's RSS until the
reader closed: the import's peak was ~1x the model above its own weights). A converter thus holds one
layer's tensors at a time (benchmarks/import_memory.py). Writing buffers tensors up to `max_shard_bytes`, then
flushes a shard; shard names get their `-of-N` suffix and the index is written at the end.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from megatron_rl.convert.arch.base import ConvertError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def read_config(path: Path) -> dict:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise ConvertError(f"{cfg} not found: an HF model folder needs config.json")
    return json.loads(cfg.read_text())


class HFReader:
    """Lazy access to the tensors of an HF folder (index + shards, or one model.safetensors)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = read_config(self.path)
        self._open: dict[str, SafetensorsFile] = {}
        self.weight_map = self._weight_map()
        from megatron_rl.convert.arch.deepseek_v3 import drop_absent_mtp

        self.config = drop_absent_mtp(self.config, self.weight_map)  # (a DeepSeek-V3 saved by transformers)

    def _weight_map(self) -> dict[str, str]:
        if (self.path / INDEX).is_file():
            return json.loads((self.path / INDEX).read_text())["weight_map"]
        if (self.path / SINGLE).is_file():
            return {k: SINGLE for k in self._shard(SINGLE, "").entries}
        raise ConvertError(f"{self.path} has neither {INDEX} nor {SINGLE} (only safetensors are read)")

    def _shard(self, shard: str, name: str) -> SafetensorsFile:
        if shard not in self._open:
            if not (self.path / shard).is_file():
                raise ConvertError(f"shard {shard} (holding {name!r}, listed in {INDEX}) is missing from {self.path}")
            self._open[shard] = SafetensorsFile(self.path / shard)
        return self._open[shard]

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self.weight_map:
            raise ConvertError(f"tensor {name!r} is missing from {self.path} (checkpoint of another model?)")
        return self._shard(self.weight_map[name], name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`; FP8 block-scaled weights (`name` + `_scale_inv` present) come dequantized."""
        t = self._file(name).read(name)
        scale = name + "_scale_inv"
        if scale in self.weight_map:
            t = dequantize_fp8_blocks(t, self._file(scale).read(scale), fp8_block(self.config),
                                      _torch_dtype(self.config))
        return t

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""safetensors dtype names -> torch dtypes."""


class SafetensorsFile:
    """One .safetensors file read tensor by tensor with positioned reads (the format: an 8-byte little-endian
    header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            n = int.from_bytes(os.pread(self.fd, 8, 0), "little")
            header = json.loads(os.pread(self.fd, n, 8))
        except (ValueError, OSError) as e:
            os.close(self.fd)
            raise ConvertError(f"{path}: not a safetensors file ({type(e).__name__}: {e})") from e
        header.pop("__metadata__", None)
        self.entries, self.data_start = header, 8 + n

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        if e["dtype"] not in _ST_DTYPES:
            raise ConvertError(f"{self.path}: tensor {name!r} has dtype {e['dtype']}, not one the converter reads")
        begin, end = e["data_offsets"]
        buf = bytearray(end - begin)
        got = os.preadv(self.fd, [buf], self.data_start + begin)
        if got != len(buf):
            raise ConvertError(f"{self.path}: tensor {name!r} is truncated ({got} of {len(buf)} bytes)")
        if not buf:
            return torch.empty(e["shape"], dtype=_ST_DTYPES[e["dtype"]])
        return torch.frombuffer(buf, dtype=_ST_DTYPES[e["dtype"]]).reshape(e["shape"])

    def close(self) -> None:
        os.close(self.fd)


def fp8_block(hf: dict) -> tuple[int, int]:
    """Block shape of an FP8 block-scaled checkpoint (DeepSeek-V3: quantization_config.weight_block_size)."""
    q = hf.get("quantization_config") or {}
    if q.get("quant_method") != "fp8" or len(q.get("weight_block_size") or []) != 2:
        raise ConvertError(f"quantization_config {q} is not supported: only FP8 with a 2-D weight_block_size "
                           f"(DeepSeek-V3's block-scaled e4m3) is dequantized on import")
    return tuple(q["weight_block_size"])


def _torch_dtype(hf: dict) -> torch.dtype:
    from megatron_rl.convert.arch.base import hf_dtype

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[hf_dtype(hf)]


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """w [out, in] (float8) * scale_inv [ceil(out / bo), ceil(in / bi)] broadcast over each block, in fp32."""
    bo, bi = block
    out, inn = w.shape
    want = (-(-out // bo), -(-inn // bi))
    if tuple(scale_inv.shape) != want:
        raise ConvertError(f"FP8 scale_inv of shape {list(scale_inv.shape)} does not fit a weight of shape "
                           f"{[out, inn]} in blocks of {list(block)} (expected {list(want)})")
    s = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inn]  # [out, in]
    return (w.float() * s).to(dtype)


class HFWriter:
    """Write tensors into `model-0000i-of-0000N.safetensors` shards and `model.safetensors.index.json`."""

    def __init__(self, path: str | Path, max_shard_bytes: int = 5 * 2**30):
        self.path, self.max_shard_bytes = Path(path), max_shard_bytes
        self.path.mkdir(parents=True, exist_ok=True)
        self._buf: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buf[name] = tensor.detach().contiguous().clone()  # own storage: safetensors refuses shared ones
        self._bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self._buf, str(self.path / f"part-{len(self._shards):05d}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._buf))
        self._buf, self._bytes = {}, 0

    def finish(self) -> list[str]:
        """Flush, name the shards -of-N, write the index; returns the tensor names written."""
        if self._buf:
            self._flush()
        n, weight_map = len(self._shards), {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.path / f"part-{i:05d}.safetensors", self.path / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return list(weight_map)


def side_files(path: Path) -> list[Path]:
    """Files of an HF folder other than weights and config.json (tokenizer, generation config...)."""
    return sorted(p for p in Path(path).iterdir() if p.is_file() and p.name not in ("config.json", INDEX)
                  and not p.name.endswith(_WEIGHT_SUFFIXES))


def copy_side_files(src: Path, dst: Path) -> list[str]:
    dst.mkdir(parents=True, exist_ok=True)
    files = side_files(src) if Path(src).is_dir() else []
    for f in files:
        shutil.copy2(f, dst / f.name)
    return [f.name for f in files]
