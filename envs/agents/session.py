"""The policy's side of one black-box agent episode: the Unix socket its agent calls, and what was recorded.

    session = AgentSession(tok, max_tokens=4096)
    sandbox.run(cmd, sockets={"gateway.sock": session.bind})   # in a thread: the agent runs in the sandbox
    call = session.next_call(timeout_s=600)    # an agent call: its exact prompt ids (or None: the agent exited)
    session.answer(call, ids, logprobs, versions)   # the completion goes back to the agent
    session.trajectory()                       # the recorder's segments (envs.agents.recorder)

The agent program speaks OpenAI chat completions (`POST .../chat/completions` with messages and tools) over
HTTP on the socket; `serve` answers each call only when the episode's driver has generated its completion,
so the agent's calls become the episode's turns and whoever drives the episode (the in-process loop's engine,
a rollout worker's HTTP generator) owns generation. A call whose prompt would leave fewer than
`MIN_TURN_TOKENS` of the episode's budget is refused (400, `context_length_exceeded`) and the episode is
marked truncated.

THREAT MODEL: the agent and everything it runs are untrusted (the policy's choices) and run in the sandbox;
the socket is its only channel out (no network). Requests are parsed defensively: a malformed body gets a
400, never an exception in the driver; the body is capped at `MAX_BODY` bytes; a call waits at most
`call_timeout_s`. What the agent sends is rendered with the model's chat template exactly as it would be for
any prompt; it cannot change another episode (one session, one socket, one episode).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socketserver
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler

from megatron_rl.envs.agents.recorder import Recorder, chat_response

MIN_TURN_TOKENS = 8
"""A call is not answered with fewer tokens than this left in the episode's budget (as envs.episode)."""
MAX_BODY = 8 << 20
"""Largest request body accepted (bytes)."""
EPISODE = "episode"
"""The recorder's key: one session holds one episode."""
log = logging.getLogger(__name__)


@dataclass
class Call:
    """One chat call of the agent, waiting for its completion."""

    prompt: list[int]
    """The call's exact prompt token ids."""
    exact: bool
    """Whether it extends the episode's current segment."""
    text: str
    """The rendered chat (the recorder's record needs it)."""
    status: int = 503
    """HTTP status of the answer (503 until answered: the episode ended first)."""
    reply: dict = field(default_factory=lambda: {"error": {"message": "the episode ended", "type": "ended"}})
    """The answer's JSON body."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set when the answer is ready."""


class AgentSession:
    """See the module docstring."""

    def __init__(self, tok, max_tokens: int, call_timeout_s: float = 900.0, model: str = "policy"):
        self.rec, self.tok, self.max_tokens = Recorder(tok), tok, max_tokens
        self.call_timeout_s, self.model = call_timeout_s, model
        self.calls: queue.Queue[Call | None] = queue.Queue()
        self.pending: list[Call] = []
        self.truncated = False
        self.rejected = 0
        """Calls answered with an error (malformed, unrenderable, over budget)."""
        self.lock = threading.Lock()
        self.server: socketserver.UnixStreamServer | None = None
        self.path: str | None = None

    # ------------------------------------------------------------------------------- the socket
    def bind(self, path: str) -> None:
        """Listen on a Unix socket at `path` (the sandbox calls this with its host path) and serve it."""
        srv = _Server(path, _Handler)
        srv.session = self
        self.server, self.path = srv, path
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                         name="agent-gateway").start()

    def close(self) -> None:
        """Stop serving; calls still waiting get a 503."""
        with self.lock:
            for c in self.pending:
                c.done.set()
            self.pending.clear()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.server = None

    # ------------------------------------------------------------------------------- the driver's side
    def next_call(self, timeout_s: float) -> Call | None:
        """The agent's next call, or None when the agent has exited (or stayed silent for `timeout_s`)."""
        try:
            return self.calls.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def agent_exited(self) -> None:
        self.calls.put(None)

    def answer(self, call: Call, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Record the completion and send it to the waiting agent."""
        self.rec.record(EPISODE, call.prompt, call.exact, call.text, ids, logprobs, versions)
        stop = bool(ids) and int(ids[-1]) in set(self.tok.stop_ids)
        call.reply = chat_response(f"chatcmpl-{uuid.uuid4().hex[:12]}", self.model, call.prompt,
                                   self.tok.decode(ids), list(ids), list(logprobs), list(versions),
                                   "stop" if stop else "length", call.exact, self.splits())
        call.status = 200
        with self.lock:
            if call in self.pending:
                self.pending.remove(call)
        call.done.set()

    def segments(self) -> list[dict]:
        return self.rec.trajectory(EPISODE)["segments"]

    def splits(self) -> int:
        return self.rec.trajectory(EPISODE)["splits"]

    # ------------------------------------------------------------------------------- the agent's side
    def request(self, body: dict) -> tuple[int, dict]:
        """Handle one chat call (on the server's thread): wait for its completion, or refuse it."""
        msgs, tools = body.get("messages"), body.get("tools")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            return self._reject(400, "missing 'messages': a non-empty list of {role, content}")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            return self._reject(400, "'tools' must be a list of tool objects")
        try:
            prompt, exact, text = self.rec.prompt(EPISODE, msgs, tools)
        except Exception as e:  # the template rejected the chat (or odd content)
            return self._reject(400, f"the model's chat template cannot render these messages: {str(e)[:200]}")
        if len(prompt) + MIN_TURN_TOKENS > self.max_tokens:
            self.truncated = True
            return self._reject(400, f"the episode's context budget of {self.max_tokens} tokens is spent "
                                     f"(this prompt has {len(prompt)})", "context_length_exceeded")
        call = Call(prompt, exact, text)
        with self.lock:
            self.pending.append(call)
        self.calls.put(call)
        call.done.wait(self.call_timeout_s)
        return call.status, call.reply

    def _reject(self, status: int, message: str, kind: str = "invalid_request_error") -> tuple[int, dict]:
        self.rejected += 1
        return status, {"error": {"message": message, "type": kind}}


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    session: AgentSession

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up early (or sends garbage) is the agent's problem: logged, never printed."""
        log.debug("agent gateway: a request failed", exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if not self.path.split("?")[0].rstrip("/").endswith("/chat/completions"):
            return self._send(404, {"error": {"message": f"no route {self.path[:100]}; POST .../chat/completions"}})
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 < n <= MAX_BODY:
                return self._send(413 if n > MAX_BODY else 400, {"error": {"message": f"body of {n} bytes"}})
            body = json.loads(self.rfile.read(n))
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            return self._send(400, {"error": {"message": f"bad JSON body: {str(e)[:100]}"}})
        self._send(*self.server.session.request(body))

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def address_string(self) -> str:
        return "agent"

    def log_message(self, *args) -> None:
        """Quiet: the agent's calls are the episode's turns, counted elsewhere."""
