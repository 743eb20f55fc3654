"""A small blocking client of the rollout server for workers: retries with backoff, per-call timeouts.

    client = RolloutClient("http://node12:8000", timeout=120, retries=3)
    out = client.complete([257, 72, 105], max_tokens=64, temperature=1.0, n=4, seed=1)
    out["choices"][0]["token_ids"], out["choices"][0]["logprobs"]["token_logprobs"]

Connection errors, timeouts and 5xx/429 answers are retried (`retries` times, exponential backoff);
4xx answers are not (the request is wrong) and raise `RolloutError` with the server's reason.
Standard library only (urllib), so workers in sandboxes need no extra packages.

Every endpoint but /health needs the job's token (`Authorization: Bearer`): given, or read from `token_file`
(mode 600, written by the driver with `http_auth.write_token_file`; re-read once when the server answers 401, so a
restarted driver's new token is picked up), else $MEGATRON_RL_ROLLOUT_TOKEN.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

from megatron_rl import http_auth

TOKEN_ENV = "MEGATRON_RL_ROLLOUT_TOKEN"  # = megatron_rl.rollout.server.TOKEN_ENV (not imported: aiohttp)


class RolloutError(RuntimeError):
    """The server rejected the request (4xx) or kept failing after the retries."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RolloutClient:
    """Blocking JSON client of megatron_rl.rollout.server."""

    def __init__(self, base_url: str, timeout: float = 120.0, retries: int = 3, backoff: float = 0.5,
                 token: str | None = None, token_file: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.token_file = token_file or None
        """File holding the token (read now and again after a 401)."""
        self.token = token or (read_token_file(token_file) if token_file else None) or os.environ.get(TOKEN_ENV) or None
        """Bearer token sent with every request (every endpoint but /health needs it); default: `token_file`, else
        $MEGATRON_RL_ROLLOUT_TOKEN."""

    def _once(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers.update(http_auth.bearer(self.token))
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> bytes:
        """Raw response body of a successful call; retries transient failures."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                status, payload = self._once(method, path, body, timeout or self.timeout)
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = e
            else:
                if status < 400:
                    return payload
                if status == 401 and self._token_changed():  # a restarted driver: try its token (once)
                    return self.request(method, path, body, timeout)
                reason = _reason(payload)
                if status < 500 and status != 429:
                    raise RolloutError(f"{method} {path}: {status} {reason}", status)
                last = RolloutError(f"{method} {path}: {status} {reason}", status)
            if attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
        raise RolloutError(f"{method} {path} failed after {self.retries + 1} attempts: {last}")

    def _token_changed(self) -> bool:
        if not self.token_file:
            return False
        try:
            token = read_token_file(self.token_file)
        except OSError:
            return False
        changed, self.token = token != self.token, token
        return changed

    def _json(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        return json.loads(self.request(method, path, body, timeout))

    def complete(self, prompt_token_ids: list[int], timeout: float | None = None, **params) -> dict:
        """/v1/completions with token ids in and token ids + log-probs out."""
        body = {"prompt_token_ids": list(prompt_token_ids), "logprobs": True, "return_token_ids": True, **params}
        return self._json("POST", "/v1/completions", body, timeout)

    def chat(self, messages: list[dict], timeout: float | None = None, **params) -> dict:
        return self._json("POST", "/v1/chat/completions", {"messages": messages, "logprobs": True, **params}, timeout)

    def health(self) -> dict:
        return self._json("GET", "/health")

    def metrics(self) -> dict[str, float]:
        """Prometheus text parsed into {name: value}."""
        text = self.request("GET", "/metrics").decode()
        return {k: float(v) for k, v in (line.split() for line in text.splitlines() if line and line[0] != "#")}

    def update_weights(self, version: int, path: str, policy: str = "continue") -> dict:
        return self._json("POST", "/update_weights", {"version": version, "path": path, "policy": policy})


def read_token_file(path) -> str:
    """The token in `path` (OSError if it cannot be read; ValueError if it is empty)."""
    with open(path) as f:
        token = f.read().strip()
    if not token:
        raise ValueError(f"token file {path} is empty (the driver writes the rollout server's token there)")
    return token


def _reason(payload: bytes) -> str:
    try:
        return json.loads(payload)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return payload[:200].decode(errors="replace")
