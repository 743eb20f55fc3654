"""A synchronous Megatron checkpoint save starts no spawned manager process (megatron_rl/compat/sync_save.py) and
writes a checkpoint that loads back equal; Megatron's own results queue still comes from one (the patch's reason)."""
from __future__ import annotations

import multiprocessing
import queue

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_rl.compat import cpu, sync_save


@pytest.fixture()
def one_rank(tmp_path):
    """A one-rank gloo world in this process (with compat.cpu's torch.cuda stubs on a CPU machine: the save calls
    torch.cuda.synchronize), torn down after the test; one an earlier test of this process left is reused."""
    stubs = cpu.PATCHES["cuda_runtime_stubs"]
    had = stubs.applied or torch.cuda.is_available()
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    assert dist.get_world_size() == 1, "this test needs a one-rank world"
    if not had:
        stubs.apply()
    yield
    if not had:
        stubs.revert()
    if started:
        dist.destroy_process_group()


def _state(value: torch.Tensor) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", value)}


def test_sync_save_starts_no_manager_and_loads_back_equal(tmp_path, one_rank, monkeypatch):
    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh rank
    saved = torch.arange(12, dtype=torch.float32).view(3, 4)
    sync_save.install()
    try:
        (tmp_path / "ckpt").mkdir()
        dist_checkpointing.save(_state(saved.clone()), str(tmp_path / "ckpt"))
        assert filesystem_async._get_write_results_queue is not queue.Queue  # restored after the save
    finally:
        sync_save.uninstall()
    assert filesystem_async._results_queue is None  # Megatron's manager queue was never made
    assert multiprocessing.active_children() == []  # nor any process left (the forked writers were joined)
    loaded = dist_checkpointing.load(_state(torch.zeros(3, 4)), str(tmp_path / "ckpt"))
    assert torch.equal(loaded["w"], saved)


def test_the_patch_is_still_needed_megatron_queue_comes_from_a_spawned_manager(monkeypatch):
    """When a Megatron release stops making its results queue in a spawned manager, this fails and the patch can go
    (as each patch of compat/cpu.py)."""
    asked = []

    class FakeContext:
        def __init__(self, method):
            asked.append(method)

        def Manager(self):  # noqa: N802 (multiprocessing's name)
            asked.append("Manager")
            return self

        def Queue(self):  # noqa: N802
            asked.append("Queue")
            return "a manager's queue"

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    monkeypatch.setattr(filesystem_async.mp, "get_context", FakeContext)
    assert filesystem_async._get_write_results_queue() == "a manager's queue"
    assert asked == ["spawn", "Manager", "Queue"]


def test_install_is_idempotent_and_uninstall_restores_megatrons_save():
    from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy

    sync_save.uninstall()  # in case a save earlier in this process installed it
    megatrons = AsyncSaveShardedStrategy.save
    sync_save.install()
    sync_save.install()
    try:
        assert AsyncSaveShardedStrategy.save is not megatrons
        assert AsyncSaveShardedStrategy.save.__wrapped__ is megatrons
    finally:
        sync_save.uninstall()
    assert AsyncSaveShardedStrategy.save is megatrons
