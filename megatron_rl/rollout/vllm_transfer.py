"""The trainer's side of vLLM's weight-transfer API (`engine.vllm.weight_transfer: nccl | gloo`): the HF tensors
of a weight sync in memory, their per-update metadata, and the two-rank process group (this process rank 0, the
vLLM worker rank 1) they are broadcast over.

vLLM 0.32's API (vllm/distributed/weight_transfer): the worker holds a `WeightTransferEngine` made by
`WeightTransferEngineFactory` from `weight_transfer_config.backend` (a registry open to other engines); the
trainer drives four worker RPCs: `init_weight_transfer_engine(init_info)` once (the rendezvous: both sides join
the group at the same time), then per update `start_weight_update()` (layer-wise reload set up),
`update_weights(update_info)` with `{"names", "dtype_names", "shapes"}` while the trainer broadcasts each tensor
from rank 0 in that order (the worker receives each into an empty tensor and `model.load_weights` it), and
`finish_weight_update()` (layer-wise reload finalised). Its own `nccl` engine needs vLLM's `PyNcclCommunicator` on
both sides (the project's venv has no vLLM), so `vllm_worker.py` registers an engine of the same lifecycle and
metadata whose group is a torch process group (`stateless_init_torch_distributed_process_group`): backend nccl on
GPUs, gloo on CPU. This module is the trainer's half of that group, made with torch alone exactly as vLLM makes
the worker's (TCPStore served here, PrefixStore `tcp://host:port`, the backend registered on a ProcessGroup).

    group = TrainerGroup("gloo", timeout_s=600)            # TCPStore on a free port
    send init_info(group) to the worker; group.connect()   # blocks until the worker has joined
    tensors = hf_tensors(named, arch, hf); send update_info(tensors); group.broadcast(tensors)
"""
from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

import torch


class _Collect(dict):
    """An `emit_hf` writer that keeps the tensors in memory (name -> tensor)."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self[name] = tensor.detach()


def hf_tensors(named: Iterable[tuple[str, torch.Tensor]], arch, hf: dict) -> dict[str, torch.Tensor]:
    """Megatron-named tensors -> HF-named tensors, by the converter's tables as the file route's `write_hf`
    (same names, dtypes and shapes; no folder)."""
    from megatron_rl.convert.convert import emit_hf

    out = _Collect()
    emit_hf({n: t.detach() for n, t in named}, arch, hf, out)
    return dict(out)


def update_info(tensors: dict[str, torch.Tensor]) -> dict:
    """vLLM's per-update metadata (NCCLWeightTransferUpdateInfo's fields) in the broadcast order."""
    return {"names": list(tensors), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()]}


class TrainerGroup:
    """Rank 0 of the trainer <-> vLLM worker group (world size 2): serves the TCPStore the worker joins."""

    def __init__(self, backend: str, timeout_s: float, host: str = "127.0.0.1"):
        from torch.distributed import TCPStore

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"process group backend {backend!r}: use gloo or nccl")
        self.backend, self.host, self.timeout = backend, host, timedelta(seconds=timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.store = TCPStore(host, 0, 2, is_master=True, timeout=self.timeout, wait_for_workers=False)
        self.port = self.store.port
        self.pg = None

    def init_info(self) -> dict:
        """What the worker's `init_weight_transfer_engine` takes (vllm_worker.TorchDistInitInfo)."""
        return {"master_address": self.host, "master_port": self.port, "rank_offset": 1, "world_size": 2,
                "backend": self.backend, "timeout_s": self.timeout.total_seconds()}

    def connect(self) -> None:
        """Join the group (blocks until the worker joins, or the timeout), as vLLM's worker does."""
        from torch.distributed import PrefixStore, ProcessGroup

        prefix = PrefixStore(f"tcp://{self.host}:{self.port}", self.store)
        pg = ProcessGroup(prefix, 0, 2)
        if self.backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            backend, kind = ProcessGroupGloo(prefix, 0, 2, timeout=self.timeout), ProcessGroup.BackendType.GLOO
        else:
            from torch.distributed import ProcessGroupNCCL

            opts = ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            backend, kind = ProcessGroupNCCL(prefix, 0, 2, opts), ProcessGroup.BackendType.NCCL
        pg._set_default_backend(kind)
        backend._set_sequence_number_for_group()
        pg._register_backend(self.device, kind, backend)
        self.pg = pg

    def broadcast(self, tensors: dict[str, torch.Tensor]) -> None:
        """Each tensor from rank 0, in `tensors`' order (the order of `update_info`), on the group's device."""
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        for t in tensors.values():
            send = t.detach().to(self.device).contiguous()  # [shape]: a copy only when moved or strided
            self.pg.broadcast([send], opts).wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Drop the group (its peer may be dead: never waits on it)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort() if self.backend == "nccl" else pg.shutdown()
            except Exception:  # noqa: BLE001 - a group whose peer died: nothing more to release
                pass
        self.store = None
