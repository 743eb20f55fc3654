"""The one authentication of the project's HTTP servers, and their JSON error body.

Every server (the rollout server and its episode gateway, the fleet's lease queue, the Monitor's Prometheus
endpoint) takes `Authorization: Bearer <token>`, compares it in constant time, and answers a request without it,
or with another token, with 401, a `WWW-Authenticate: Bearer` header and the error body naming the header and
where the token comes from. Every JSON error is `{"error": {"message": ..., "code": status}}`.

    if not bearer_ok(request.headers.get(HEADER), token):
        status, headers, body = refusal(path, "the job's token: $MEGATRON_RL_ROLLOUT_TOKEN")
    urllib.request.Request(url, headers=bearer(token))          # a client

Standard library only: the rollout client and fleet workers run in sandboxes. `http.server` servers reply
through `reply_json`; the aiohttp ones wrap `refusal` (rollout/http_api.py).
"""
from __future__ import annotations

import hmac
import json
import os

HEADER = "Authorization"
"""The request header carrying the token: `Authorization: Bearer <token>`."""
UNAUTHORISED = 401
"""The status of a request without the token or with a wrong one, on every server."""


def bearer(token: str) -> dict[str, str]:
    """The header a client sends."""
    return {HEADER: f"Bearer {token}"}


def bearer_ok(value: str | None, token: str) -> bool:
    """Whether a request's `Authorization` header value is `Bearer <token>` (constant time; a header with
    characters outside ASCII is a mismatch, never an exception)."""
    got = (value or "").encode(errors="replace")
    return hmac.compare_digest(got, f"Bearer {token}".encode())


def error_body(status: int, message: str) -> dict:
    """The JSON error every endpoint of every server gives."""
    return {"error": {"message": message, "code": status}}


def refusal(path: str, source: str) -> tuple[int, dict[str, str], dict]:
    """(status, headers, body) of a refused request to `path`; `source` says where the token comes from."""
    message = f"{path[:100]} needs the header '{HEADER}: Bearer <token>' ({source})"
    return UNAUTHORISED, {"WWW-Authenticate": "Bearer"}, error_body(UNAUTHORISED, message)


def reply_json(handler, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
    """Send `obj` as the JSON reply of an `http.server.BaseHTTPRequestHandler`."""
    data = json.dumps(obj).encode()
    handler.send_response(status)
    for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
        handler.send_header(k, v)
    handler.end_headers()
    handler.wfile.write(data)


def authorised(handler, token: str, source: str) -> bool:
    """Whether an `http.server` request carries the token; if not, the 401 has been sent."""
    if bearer_ok(handler.headers.get(HEADER), token):
        return True
    status, headers, body = refusal(handler.path, source)
    reply_json(handler, status, body, headers)
    return False


def write_token_file(path, token: str) -> None:
    """Write the job's token to `path`, readable by its owner only (mode 600), atomically."""
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    if os.path.lexists(tmp):  # a leftover (or someone's planted file or link): never write through it
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
