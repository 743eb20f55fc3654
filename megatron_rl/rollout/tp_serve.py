"""Serving a tensor-parallel engine over HTTP: TP rank 0 runs the server, every rank runs the same schedule.

    # on every rank of the TP group (same model, same EngineConfig):
    engine = RolloutEngine.build(model_cfg, engine_cfg, parallel, pgs)
    serve_tp(engine, pgs.tp, host=node_address(name), port=8000, token=job_token)   # returns when stopped

The engine's TP collectives (vocab all-gather, sampled-token broadcast) need every rank to run the same
step over the same requests. So on rank 0 the HTTP handlers never touch the engine: they validate (and
compress) a request, then queue a command. Before each engine step the loop thread on rank 0 broadcasts
the queued commands — add (prompt, sampling params, request id, compression record), abort, weight
update, stop — with `broadcast_object_list` over the TP group; every rank (rank 0 included) applies them
in that order and then steps if it has work, so the schedules, seeds and sequence ids are identical. When
idle, rank 0 still broadcasts an empty command list every `idle_s` so followers never sit in a collective
long enough to time out. A weight update's tensors (full, unsharded; loaded on rank 0 from the path in
the request) go out with the engine's bucketed broadcast and each rank cuts its TP slice.

Not covered: a rank failing a step alone (e.g. out of memory on one device) desynchronises the group; the
error is logged and the group must be restarted.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass

import torch.distributed as dist

from megatron_rl.rollout.compression import CompressionConfig
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.rollout.server import EngineLoop, ServerThread

log = logging.getLogger(__name__)


@dataclass
class _Update:
    version: int
    """New policy version."""
    policy: str | None
    """'continue' / 'abort' / None (the engine default)."""
    state: dict | None = None
    """The state dict (rank 0 only; never pickled into the command broadcast)."""
    done: tuple | None = None
    """(event loop, future) of the waiting handler (rank 0 only)."""


def apply_commands(engine: RolloutEngine, commands: list[tuple], src: int, group) -> list:
    """Apply broadcast commands in order on this rank; returns (command, result or exception) pairs."""
    results = []
    for cmd in commands:
        try:
            if cmd[0] == "add":
                _, rid, prompt, params, record = cmd
                results.append((cmd, engine.add_prepared(prompt, params, rid, record)))
            elif cmd[0] == "abort":
                results.append((cmd, engine.abort(cmd[1])))
            elif cmd[0] == "update":
                upd: _Update = cmd[1]
                named = upd.state.items() if upd.state is not None else None
                if group is None:  # a single rank: load directly
                    results.append((cmd, engine.update_weights(upd.version, named, upd.policy)))
                else:
                    results.append((cmd, engine.update_weights_from_broadcast(upd.version, src, group, named,
                                                                              upd.policy)))
        except Exception as e:  # noqa: BLE001 - identical on every rank (same inputs); reported to the caller
            log.exception("rollout TP command %s failed", cmd[0])
            results.append((cmd, e))
    return results


def _wire(cmd: tuple) -> tuple:
    """The command as broadcast: a weight update without its tensors and the handler's future."""
    return ("update", _Update(cmd[1].version, cmd[1].policy)) if cmd[0] == "update" else cmd


class TPEngineLoop(EngineLoop):
    """EngineLoop of TP rank 0: requests become broadcast commands applied by all ranks in lock-step."""

    def __init__(self, engine: RolloutEngine, group, idle_s: float = 0.5):
        super().__init__(engine)
        self.group, self.idle_s = group, idle_s
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self._pending: list[tuple] = []
        self._pending_lock = threading.Lock()
        self._rids = itertools.count()

    def _queue(self, cmd: tuple) -> None:
        with self._pending_lock:
            self._pending.append(cmd)
        self._wake.set()

    def submit(self, prompt: list[int], params: SamplingParams, turn_boundaries: list[int] | None = None,
               compression: CompressionConfig | None = None) -> tuple[str, asyncio.Future]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        prompt, record = self.engine.compress(prompt, turn_boundaries, compression)
        params.validate()
        self.engine._check_prompt(prompt, params)  # bad input fails here with 400, before any broadcast
        rid = f"tp-{next(self._rids)}"
        self._futures[rid] = (loop, fut)
        self._queue(("add", rid, prompt, params, record))
        return rid, fut

    def abort(self, rid: str) -> None:
        self._futures.pop(rid, None)
        self.aborted += 1
        self._queue(("abort", rid))

    async def update_weights(self, version: int, path: str, policy: str | None) -> int:
        import torch

        state = await asyncio.to_thread(torch.load, path, map_location="cpu", weights_only=True)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue(("update", _Update(version, policy, state, (loop, fut))))
        return await fut

    def stop(self) -> None:
        self._queue(("stop",))
        super().stop()

    def _run(self) -> None:
        while True:
            if not self.engine.has_work and not self._pending:
                self._wake.wait(timeout=self.idle_s)
                self._wake.clear()
            with self._pending_lock:
                cmds, self._pending = self._pending, []
            stop = any(c[0] == "stop" for c in cmds)
            if self.group is not None:
                dist.broadcast_object_list([[_wire(c) for c in cmds]], src=self.src, group=self.group)
            for cmd, res in apply_commands(self.engine, [c for c in cmds if c[0] != "stop"], self.src, self.group):
                self._after(cmd, res)
            if stop:
                return
            if self.engine.has_work:
                self._step()

    def _after(self, cmd: tuple, res) -> None:
        if cmd[0] == "update":
            loop, fut = cmd[1].done
            if isinstance(res, Exception):
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_exception(res))
            else:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(res))
        elif cmd[0] == "add" and isinstance(res, Exception):
            entry = self._futures.pop(cmd[1], None)
            if entry is not None:
                loop, fut = entry
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_exception(res))

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - see the module docstring
            log.exception("rollout engine step failed (TP rank 0)")
            self._fail_all(e)
            return
        for out in outs:
            self._resolve(out)


def follow(engine: RolloutEngine, group) -> None:
    """Loop of TP ranks > 0: receive rank 0's commands, apply them, step; returns on 'stop'."""
    src = dist.get_global_rank(group, 0)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        cmds = box[0]
        apply_commands(engine, [c for c in cmds if c[0] != "stop"], src, group)
        if any(c[0] == "stop" for c in cmds):
            return
        if engine.has_work:
            try:
                engine.step()
            except Exception:  # noqa: BLE001 - see the module docstring
                log.exception("rollout engine step failed (TP follower)")


def serve_tp(engine: RolloutEngine, group, host: str = "127.0.0.1", port: int = 0, ready=None,
             until: threading.Event | None = None, **app_kw) -> None:
    """Serve on TP rank 0 (until `until` is set; `ready(url)` is called once listening), follow elsewhere.

    With group None (a single rank) it serves with the same command loop and no broadcasts.
    """
    if group is not None and group.rank() != 0:
        return follow(engine, group)
    loop = TPEngineLoop(engine, group)
    srv = ServerThread(engine, host, port, loop=loop, **app_kw).start()
    try:
        if ready is not None:
            ready(srv.url)
        (until or threading.Event()).wait()
    finally:
        srv.stop()
