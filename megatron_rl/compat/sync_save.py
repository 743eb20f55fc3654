"""Megatron-Core's synchronous checkpoint save without a spawned `multiprocessing.Manager` process.

`dist_checkpointing.save` with its default `torch_dist` strategy (an async strategy used synchronously:
`AsyncSaveShardedStrategy.save` is `async_save` + `AsyncRequest.execute_sync`) hands its writer a results queue from
`filesystem_async._get_write_results_queue`: a queue of a `Manager` started with the *spawn* method, once per
process, so that an asynchronous save's writer process can pass its results back. In a synchronous save the writer
runs in the calling process, which puts its results into that queue and reads them back right after; the manager
only costs: a fresh interpreter that re-imports the caller's `__main__` module (3-3.5 CPU-s in every rank of
`megatron-rl train`, whose main module imports torch and Megatron; measured with megatron-core 0.16.1), a process
that lives until the rank exits, and the `if __name__ == "__main__"` guard every saving script needed.

`install()` wraps `AsyncSaveShardedStrategy.save` (the synchronous path only) so that, while it runs, the writer gets
a plain in-process `queue.Queue`; `async_save` (an asynchronous save, never used by this project) keeps Megatron's
manager queue. The files written are the same: the write itself (one forked writer process per bucket) is Megatron's.
`tests/compat/test_sync_save.py` checks the save makes no manager and loads back equal, and that Megatron's own
queue is still a spawned manager's (when a release stops that, the patch can go).
"""
from __future__ import annotations

import functools
import queue
import threading

_LOCK = threading.RLock()
_INSTALLED: list = []


def _in_process_queue(orig_save):
    """`save` with `filesystem_async._get_write_results_queue` answering a fresh `queue.Queue` while it runs."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    @functools.wraps(orig_save)
    def save(self, sharded_state_dict, checkpoint_dir):
        with _LOCK:  # one synchronous save at a time per process (a save is a collective anyway)
            real = filesystem_async._get_write_results_queue
            filesystem_async._get_write_results_queue = queue.Queue
            try:
                return orig_save(self, sharded_state_dict, checkpoint_dir)
            finally:
                filesystem_async._get_write_results_queue = real

    return save


def install() -> None:
    """Patch the synchronous save (idempotent; imports Megatron's dist_checkpointing strategies)."""
    from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy

    if _INSTALLED:
        return
    orig = AsyncSaveShardedStrategy.save
    AsyncSaveShardedStrategy.save = _in_process_queue(orig)
    _INSTALLED.append(orig)


def uninstall() -> None:
    """Restore Megatron's `save` (tests)."""
    from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy

    if _INSTALLED:
        AsyncSaveShardedStrategy.save = _INSTALLED.pop()
