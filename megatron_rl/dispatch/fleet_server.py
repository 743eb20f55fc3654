"""The driver's HTTP endpoint of the fleet queue: workers lease episodes, heartbeat, report what they published.

    POST /lease      {worker, job, host, pid, max, wait_s} -> {lease: {...}} | {stop: reason} | {}  (long poll)
    POST /heartbeat  {worker, leases: [id]}                 -> {lost: [id], stop: bool}
    POST /commit     {worker, lease}                        -> {ok: bool}   (may it publish the lease's shard?)
    POST /done       {worker, lease, published: [id], failed: {id: reason}} -> {accepted: bool}
    GET  /status                                            -> workers, counters

Every request carries the fleet token (`Authorization: Bearer <token>`, the scheme of every server:
`megatron_rl.http_auth`; else 401; the token is in the fleet folder's queue.json, mode 600). Errors are
`{"error": {"message", "code"}}`. A
/lease waits up to `wait_s` for work, so a warm worker gets a new batch's episodes within milliseconds of
`put` (no polling loop on either side). The registry of workers (last heard, job id, leases) lives here;
`Fleet` decides who is lost and who is surplus.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_rl import http_auth
from megatron_rl.config import to_dict
from megatron_rl.dispatch.lease_queue import LeaseQueue

log = logging.getLogger(__name__)

TOKEN_SOURCE = "the fleet token: 'token' in <fleet>/queue.json (mode 600)"
"""Where a worker finds the token (named in a 401's message)."""


class FleetState:
    """The queue plus the worker registry, under one condition variable."""

    def __init__(self, queue: LeaseQueue):
        self.queue = queue
        self.cond = threading.Condition()
        self.workers: dict[str, dict] = {}
        """worker id -> {job, host, pid, last_seen, leases: set, joined}."""
        self.surplus: set[str] = set()
        """Workers told to stop (the fleet shrank, or the run is over)."""
        self.told_stop: set[str] = set()
        """Workers that have heard "stop" (close() waits for every live worker to hear it)."""
        self.joined_jobs: set[str] = set()
        """Jobs a worker of which has talked to this queue."""
        self.ended_jobs: set[str] = set()
        """Jobs the scheduler reported ended: a process of theirs still talking (Slurm's kill grace) is told to
        stop and gets no lease."""
        self.closing = False
        self.size = 0
        """Wanted fleet size; a worker that asks for work while more are active is told to stop."""

    def _seen(self, body: dict, now: float) -> dict:
        w = self.workers.get(body["worker"])
        if w is None:
            w = self.workers[body["worker"]] = {"job": str(body.get("job", "")), "host": body.get("host", ""),
                                                "pid": body.get("pid", 0), "leases": set(), "joined": now}
            self.joined_jobs.add(w["job"])
            log.info("fleet: worker %s joined (job %s on %s)", body["worker"], w["job"], w["host"])
        w["last_seen"] = now
        return w

    def unaware(self, silent_s: float) -> list[str]:
        """Workers heard from within `silent_s` that have not been told to stop yet."""
        now = time.monotonic()
        return [k for k, w in self.workers.items() if k not in self.told_stop and now - w["last_seen"] < silent_s]

    def active(self) -> list[str]:
        return [k for k in self.workers if k not in self.surplus]

    def lease(self, body: dict) -> dict:
        deadline = time.monotonic() + min(float(body.get("wait_s", 10.0)), 60.0)
        with self.cond:
            while True:
                now = time.monotonic()
                w = self._seen(body, now)
                if str(body.get("job", "")) in self.ended_jobs:
                    self.surplus.add(body["worker"])  # never counts towards the size again
                    self.told_stop.add(body["worker"])
                    return {"stop": "its job ended"}
                if self.closing or body["worker"] in self.surplus:
                    self.told_stop.add(body["worker"])
                    return {"stop": "run over" if self.closing else "fleet shrank"}
                if len(self.active()) > self.size:
                    self.surplus.add(body["worker"])
                    self.told_stop.add(body["worker"])
                    log.info("fleet: worker %s stops (fleet size %d)", body["worker"], self.size)
                    return {"stop": "fleet shrank"}
                le = self.queue.lease(body["worker"], int(body.get("max", 8)), now)
                if le is not None:
                    w["leases"].add(le.id)
                    meta = self.queue.batches[le.batch].meta
                    return {"lease": {"id": le.id, "batch": le.batch, "attempt": le.attempt,
                                      "episodes": [to_dict(e) for e in le.episodes], **meta}}
                if now >= deadline:
                    return {}
                self.cond.wait(deadline - now)

    def heartbeat(self, body: dict) -> dict:
        with self.cond:
            if str(body.get("job", "")) in self.ended_jobs:  # not registered again: it is gone
                self.told_stop.add(body["worker"])
                return {"lost": list(body.get("leases", [])), "stop": True}
            now = time.monotonic()
            w = self._seen(body, now)
            lost = self.queue.heartbeat(body["worker"], list(body.get("leases", [])), now)
            w["leases"] -= set(lost)
            stop = self.closing or body["worker"] in self.surplus
            if stop:
                self.told_stop.add(body["worker"])
            return {"lost": lost, "stop": stop}

    def commit(self, body: dict) -> dict:
        with self.cond:
            if str(body.get("job", "")) in self.ended_jobs:
                return {"ok": False}
            now = time.monotonic()
            self._seen(body, now)
            return {"ok": self.queue.commit(body["worker"], body["lease"], now)}

    def done(self, body: dict) -> dict:
        with self.cond:
            w = self._seen(body, time.monotonic())
            w["leases"].discard(body["lease"])
            ok = self.queue.complete(body["lease"], list(body.get("published", [])), dict(body.get("failed", {})))
            self.cond.notify_all()
            return {"accepted": ok}

    def status(self) -> dict:
        with self.cond:
            now = time.monotonic()
            return {"size": self.size, "closing": self.closing, "pending": self.queue.pending(),
                    "counters": dict(self.queue.counters),
                    "workers": {k: {"job": w["job"], "host": w["host"], "pid": w["pid"], "leases": sorted(w["leases"]),
                                    "idle_s": round(now - w["last_seen"], 3), "surplus": k in self.surplus}
                                for k, w in self.workers.items()}}


def serve(state: FleetState, token: str, host: str) -> ThreadingHTTPServer:
    """Start the endpoint on `host`, a free port, in a daemon thread; returns the server (server_address)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # the driver's log is for events, not requests
            pass

        def _reply(self, code: int, obj: dict) -> None:
            http_auth.reply_json(self, code, obj)

        def _error(self, code: int, message: str) -> None:
            self._reply(code, http_auth.error_body(code, message))

        def do_GET(self):
            if not http_auth.authorised(self, token, TOKEN_SOURCE):
                return
            if self.path != "/status":
                return self._error(404, f"no endpoint {self.path[:100]}")
            self._reply(200, state.status())

        def do_POST(self):
            if not http_auth.authorised(self, token, TOKEN_SOURCE):
                return
            routes = {"/lease": state.lease, "/heartbeat": state.heartbeat, "/commit": state.commit,
                      "/done": state.done}
            if self.path not in routes:
                return self._error(404, f"no endpoint {self.path[:100]}")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not isinstance(body, dict) or not isinstance(body.get("worker"), str):
                    raise ValueError("'worker' (a string) is required")
                self._reply(200, routes[self.path](body))
            except (ValueError, KeyError, TypeError) as e:
                self._error(400, f"{type(e).__name__}: {e}")

    httpd = ThreadingHTTPServer((host, 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="fleet-queue", daemon=True).start()
    return httpd
