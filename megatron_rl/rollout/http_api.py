"""Request parsing and error replies shared by the rollout server (`server.py`) and the episode gateway
(`gateway.py`): a module of its own, so that neither imports the other's helpers. The token check and the error
body are the project's one scheme (`megatron_rl.http_auth`), wrapped for aiohttp."""
from __future__ import annotations

import json

from aiohttp import web

from megatron_rl import http_auth
from megatron_rl.config import ConfigError
from megatron_rl.rollout.sampling import SamplingParams

TOKEN_ENV = "MEGATRON_RL_ROLLOUT_TOKEN"
"""Environment variable holding the job's token (the rollout server, its gateway and their clients)."""
TOKEN_SOURCE = f"the job's token: ${TOKEN_ENV}, or the mode-600 <run>/rollout_token the driver writes"
"""Where a client finds the token (named in a 401's message)."""


class BadRequest(ValueError):
    """A client error: answered with 400 and this message."""


_SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "n": int, "seed": int}


def token_list(value, what: str, tokenizer) -> list[int]:
    """A list of token ids, or text encoded with the tokenizer."""
    if isinstance(value, str):
        return tokenizer.encode(value)
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise BadRequest(f"{what} must be a string or a list of integer token ids")


def sampling_from(body: dict, tokenizer) -> SamplingParams:
    """SamplingParams from an OpenAI-style body; BadRequest names the bad field."""
    kw = {}
    for name, typ in _SAMPLING_FIELDS.items():
        if body.get(name) is not None:
            value = body[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (typ is int and value != int(value)):
                raise BadRequest(f"field {name!r} must be a number of type {typ.__name__}, got {value!r}")
            kw[name] = typ(value)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise BadRequest(f"field 'max_tokens' must be an integer, got {max_tokens!r}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list):
        raise BadRequest("field 'stop' must be a string or a list of strings / token-id lists")
    stop_ids = body.get("stop_token_ids") or []
    stop = [token_list(s, "each stop entry", tokenizer) for s in stop]
    params = SamplingParams(max_new_tokens=max_tokens, stop=stop,
                            stop_token_ids=token_list(stop_ids, "stop_token_ids", tokenizer), **kw)
    try:
        params.validate()
    except ConfigError as e:
        raise BadRequest(str(e)) from e
    return params


def error_response(status: int, message: str) -> web.Response:
    """The JSON error reply every endpoint gives: {error: {message, code}}."""
    return web.json_response(http_auth.error_body(status, message), status=status)


async def json_body(request: web.Request) -> dict:
    """The request's JSON object; BadRequest when it is not one."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def has_token(request: web.Request, token: str) -> bool:
    """Whether the request carries `Authorization: Bearer <token>` (constant-time comparison)."""
    return http_auth.bearer_ok(request.headers.get(http_auth.HEADER), token)


def unauthorised(request: web.Request, source: str = TOKEN_SOURCE) -> web.Response:
    """The 401 of every server (http_auth.refusal); `source`: where the token comes from."""
    status, headers, body = http_auth.refusal(request.path, source)
    return web.json_response(body, status=status, headers=headers)


def requires_token(handler):
    """Wrap an endpoint: a request without the app's bearer token gets 401."""

    async def checked(request: web.Request) -> web.Response:
        if not has_token(request, request.app["token"]):
            return unauthorised(request)
        return await handler(request)

    return checked
