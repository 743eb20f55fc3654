"""The token-recording gateway: OpenAI chat completions for a black-box agent, one exact trajectory per episode.

    POST /episodes/<episode>/v1/chat/completions   {"messages": [...], "tools": [...], sampling fields}
    GET  /episodes/<episode>/trajectory            the recorded segments (token ids, log-probs, mask, versions)
    DELETE /episodes/<episode>                     forget it

Authentication (the recorded trajectories are training data): the chat route needs the job's token or the
episode's own token (`episode_token(job_token, episode)`: what an agent playing that one episode is given, in
$MEGATRON_RL_GATEWAY_TOKEN; it cannot reach another episode with it); reading and deleting a trajectory need the
job's token. Anything else gets 401 (`megatron_rl.http_auth`, the scheme of every server). The per-episode Unix
socket of `envs.agents.session` (one socket, one episode, bound into that episode's sandbox only) is a separate
server and needs none.

An agent program (running in a sandbox, reaching the gateway through a Unix socket bound into it) uses an
OpenAI client with `base_url = http://gateway/episodes/<episode>/v1`. For every call the gateway records the
exact prompt token ids, the completion's token ids, behaviour log-probs and policy versions.

Exactness is the `Recorder`'s (`envs.agents.recorder`): a call whose rendered chat extends the episode's text
appends only the new tokens; one that does not (an edited history) starts a new segment, counted in `splits`.

The assistant message returned is the completion's text; `<tool_call>{json}</tool_call>` blocks in it are also
returned as OpenAI `tool_calls` (the text keeps them, so an agent that sends the message back unchanged keeps
the episode exact). Needs a tokenizer with a chat template (`HFTokenizer`).
"""
from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from megatron_rl.envs.agents.recorder import Recorder, chat_response
from megatron_rl.rollout.http_api import TOKEN_SOURCE, BadRequest, has_token, sampling_from, unauthorised
from megatron_rl.rollout.http_api import error_response as _error
from megatron_rl.rollout.http_api import json_body as _json_body

EPISODE_TOKEN_ENV = "MEGATRON_RL_GATEWAY_TOKEN"
"""Environment variable an agent reads its episode token from (envs/agents/shell_agent.py)."""
CHAT_SOURCE = f"{TOKEN_SOURCE}; or the episode's own token, ${EPISODE_TOKEN_ENV} of its agent"
"""Where a caller of the chat route finds a token (named in a 401's message)."""


def episode_token(job_token: str, episode: str) -> str:
    """The token that opens the chat route of `episode` only (an HMAC of the episode under the job's token)."""
    return hmac.new(job_token.encode(), b"gateway-episode:" + episode.encode(), hashlib.sha256).hexdigest()


def _authorised(request: web.Request, episode_ok: bool) -> bool:
    job = request.app["token"]
    return has_token(request, job) or (episode_ok and has_token(request, episode_token(job, request.match_info[
        "episode"])))


# ------------------------------------------------------------------------------------ routes
async def chat(request: web.Request) -> web.Response:
    if not _authorised(request, episode_ok=True):
        return unauthorised(request, CHAT_SOURCE)
    st, rec, episode = request.app["state"], request.app["gateway"], request.match_info["episode"]
    try:
        body = await _json_body(request)
        msgs, tools = body.get("messages"), body.get("tools")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("missing 'messages': a non-empty list of {role, content}")
        try:
            prompt, exact, text = rec.prompt(episode, msgs, tools)
        except Exception as e:  # the template rejected the chat
            raise BadRequest(f"the model's chat template cannot render these messages: {e}") from None
        params = sampling_from(body, st.tokenizer)
        params.stop_token_ids = sorted({*params.stop_token_ids, *st.tokenizer.stop_ids})
        rid, fut = st.loop.submit(prompt, params)
    except ValueError as e:
        return _error(400, str(e))
    out = await fut
    s = out.samples[0]
    rec.record(episode, prompt, exact, text, s.token_ids, s.logprobs, s.policy_versions)
    return web.json_response(chat_response(
        rid, st.model_name, prompt, st.tokenizer.decode(s.token_ids), s.token_ids, s.logprobs, s.policy_versions,
        s.finish_reason, exact, rec.trajectory(episode)["splits"]))


async def trajectory(request: web.Request) -> web.Response:
    if not _authorised(request, episode_ok=False):
        return unauthorised(request)
    return web.json_response(request.app["gateway"].trajectory(request.match_info["episode"]))


async def forget(request: web.Request) -> web.Response:
    if not _authorised(request, episode_ok=False):
        return unauthorised(request)
    request.app["gateway"].forget(request.match_info["episode"])
    return web.json_response({"status": "ok"})


def add_routes(app: web.Application, tokenizer) -> Recorder:
    """Mount the gateway on a rollout server app (create_app(..., gateway=True))."""
    rec = app["gateway"] = Recorder(tokenizer)
    app.router.add_post("/episodes/{episode}/v1/chat/completions", chat)
    app.router.add_get("/episodes/{episode}/trajectory", trajectory)
    app.router.add_delete("/episodes/{episode}", forget)
    return rec
