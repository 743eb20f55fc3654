"""HTTP API of the rollout engine (aiohttp): OpenAI-compatible completions with token-id extensions.

    POST /v1/completions        {"prompt": "text" | [ids], "prompt_token_ids": [ids], "max_tokens": 16,
                                 "temperature", "top_p", "top_k", "n", "seed", "stop": ["text" | [ids]],
                                 "stop_token_ids": [ids], "logprobs": true, "return_token_ids": true}
    POST /v1/chat/completions   {"messages": [{"role", "content"}], ... same sampling fields ...}
    GET  /health                {"status": "ok", "policy_version": v}   (the only endpoint open without the token)
    GET  /metrics               Prometheus text: queue length, running, KV blocks used/total, tokens/s, ...
    POST /update_weights        {"version": v, "path": "state_dict.pt", "policy": "continue" | "abort"}

Authentication: every endpoint but /health needs the job's token (`Authorization: Bearer <token>`, else 401):
generation runs the policy and fills the engine (a stranger could read the model out or starve the workers),
/update_weights replaces it, the gateway's routes (gateway.py) write and read training data. The token is
`create_app(token=...)`, else the environment variable MEGATRON_RL_ROLLOUT_TOKEN (how the driver passes it to a
server process), else a random one generated at start (then nobody outside the process can use the server).
Workers get it from a mode-600 file the driver writes (`http_auth.write_token_file`; GeneratorConfig.token_file).
Bind to the job's node address (`dispatch.net.node_address`), never 0.0.0.0: a server asked for a loopback name
listens on loopback only.

Context compression (optional, per request): "turn_boundaries": [token offsets where each turn starts] and
"compression": {"keep_first", "keep_last", "mode", "marker_token_ids": [ids] | "text", "min_prompt_tokens"}
(compression.py); the response's `prompt_token_ids` are then the compressed ids and `compression` records
what was dropped.

Extensions: each choice carries `token_ids`, `policy_versions` and (with "logprobs") `logprobs` with
`token_logprobs` (completions) or `content` (chat); the response carries `prompt_token_ids`. Text is
encoded with the server's tokenizer (ByteTokenizer by default); token ids always win when given.
Malformed requests get 400 with {"error": {"message": reason}}. A client that disconnects aborts its
request, which frees its KV blocks (handler cancellation is on).

Routing replay (an MoE engine built with `record_routes`): "return_routed_experts": true adds to each choice
`routed_experts`, the experts of every token the request ran (prompt + completion but the last, [P + G - 1,
L_moe, k]) as `data.routes.encode_routes` writes them; asked of an engine that does not record them, the
request gets 400.

The engine runs in one background thread (`EngineLoop`); handlers submit requests under the engine's
lock and await a future resolved by that thread.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass

from aiohttp import web

from megatron_rl import prometheus_text
from megatron_rl.config import ConfigError, from_dict
from megatron_rl.rollout.compression import CompressionConfig
from megatron_rl.rollout.engine import RequestOutput, RolloutEngine
from megatron_rl.rollout.http_api import TOKEN_ENV, BadRequest, requires_token, sampling_from
from megatron_rl.rollout.http_api import error_response as _error
from megatron_rl.rollout.http_api import json_body as _json_body
from megatron_rl.rollout.http_api import token_list as _token_list
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)


class EngineLoop:
    """Steps the engine in a background thread and hands finished requests to awaiting handlers."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._wake = threading.Event()
        self._stop = False
        self.aborted = 0
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="rollout-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self.thread.join(timeout=10)

    def submit(self, prompt: list[int], params: SamplingParams, turn_boundaries: list[int] | None = None,
               compression: CompressionConfig | None = None) -> tuple[str, asyncio.Future]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self.engine.lock:
            rid = self.engine.add_request(prompt, params, turn_boundaries=turn_boundaries, compression=compression)
            self._futures[rid] = (loop, fut)
        self._wake.set()
        return rid, fut

    async def update_weights(self, version: int, path: str, policy: str | None) -> int:
        """Load a weight file (rollout/weight_file.py: read straight into the engine's parameters, under its
        lock) or a torch.save'd state dict (memory-mapped), trainer parameter names, into the engine; returns
        the tensor count. Every engine parameter must be in it (the engine raises naming the missing ones)."""
        return await asyncio.to_thread(lambda: self.engine.update_weights(version, weights_in(path, self.engine),
                                                                          policy, True))

    def abort(self, rid: str) -> None:
        with self.engine.lock:
            self._futures.pop(rid, None)
            if self.engine.abort(rid):
                self.aborted += 1
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            if not self.engine.has_work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the server
                log.exception("rollout engine step failed")
                self._fail_all(e)
                continue
            for out in outs:
                self._resolve(out)

    def _fail_all(self, error: Exception) -> None:
        with self.engine.lock:
            for rid in list(self._futures):
                self.engine.abort(rid)
                loop, fut = self._futures.pop(rid)
                loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_exception(RuntimeError(str(error))))
            self.engine.pop_finished()  # drop the aborted outputs: their futures already failed

    def _resolve(self, out: RequestOutput) -> None:
        entry = self._futures.pop(out.request_id, None)
        if entry is not None:
            loop, fut = entry
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(out))


# ------------------------------------------------------------------------------------ request parsing
def completion_prompt(body: dict, tokenizer) -> list[int]:
    if body.get("prompt_token_ids") is not None:
        return _token_list(body["prompt_token_ids"], "prompt_token_ids", tokenizer)
    if "prompt" not in body:
        raise BadRequest("missing 'prompt' (text or token ids) or 'prompt_token_ids'")
    return _token_list(body["prompt"], "prompt", tokenizer)


def compression_from(body: dict, tokenizer) -> tuple[list[int] | None, CompressionConfig | None]:
    """Optional `turn_boundaries` (token offsets where turns start) and `compression` (CompressionConfig
    fields; `marker_token_ids` may be text) of a request."""
    raw, bounds = body.get("compression"), body.get("turn_boundaries")
    if raw is None:
        if bounds is not None:
            raise BadRequest("'turn_boundaries' given without 'compression' (e.g. {\"keep_last\": 2})")
        return None, None
    if not isinstance(raw, dict):
        raise BadRequest("field 'compression' must be an object of CompressionConfig fields")
    raw = dict(raw)
    if isinstance(raw.get("marker_token_ids"), str):
        raw["marker_token_ids"] = tokenizer.encode(raw["marker_token_ids"])
    try:
        cfg = from_dict(CompressionConfig, raw, prefix="compression")
        cfg.validate()
    except ConfigError as e:
        raise BadRequest(str(e)) from e
    if not isinstance(bounds, list):
        raise BadRequest("'compression' needs 'turn_boundaries': a list of token offsets where each turn starts")
    return bounds, cfg


def chat_prompt(body: dict, tokenizer) -> list[int]:
    """Token ids of a chat: '<role>: content' lines after BOS, then 'assistant: ' (a minimal template)."""
    if body.get("prompt_token_ids") is not None:
        return _token_list(body["prompt_token_ids"], "prompt_token_ids", tokenizer)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("missing 'messages': a non-empty list of {role, content}")
    if getattr(tokenizer, "has_chat_template", False):
        try:
            return tokenizer.prompt_ids(msgs, body.get("tools"))
        except Exception as e:  # the template rejected the chat (roles out of order, bad tool schema)
            raise BadRequest(f"the model's chat template cannot render these messages: {e}") from None
    ids = [tokenizer.bos_id]
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRequest(f"messages[{i}] must be an object with string 'role' and 'content'")
        ids += tokenizer.encode(f"{m['role']}: {m['content']}\n")
    return ids + tokenizer.encode("assistant: ")


# ------------------------------------------------------------------------------------ responses
def _choice(s, chat: bool, body: dict, tokenizer) -> dict:
    text = tokenizer.decode(s.token_ids)
    c = {"index": s.index, "finish_reason": s.finish_reason, "token_ids": s.token_ids,
         "policy_versions": s.policy_versions}
    if chat:
        c["message"] = {"role": "assistant", "content": text}
    else:
        c["text"] = text
    if body.get("return_routed_experts"):
        from megatron_rl.data.routes import encode_routes

        c["routed_experts"] = encode_routes(s.routed_experts)  # [P + G - 1, L_moe, k]
    if body.get("logprobs"):
        if chat:
            c["logprobs"] = {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(s.token_ids, s.logprobs)]}
        else:
            c["logprobs"] = {"token_ids": s.token_ids, "token_logprobs": s.logprobs}
    return c


def render(out: RequestOutput, chat: bool, body: dict, tokenizer, model_name: str) -> dict:
    gen = sum(len(s.token_ids) for s in out.samples)
    res = {"id": out.request_id, "object": "chat.completion" if chat else "text_completion",
           "created": int(time.time()), "model": model_name, "prompt_token_ids": out.prompt_token_ids,
           "choices": [_choice(s, chat, body, tokenizer) for s in out.samples],
           "usage": {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": gen,
                     "total_tokens": len(out.prompt_token_ids) + gen}}
    if out.compression is not None:
        res["compression"] = out.compression.to_dict()
    return res


# ------------------------------------------------------------------------------------ the app
@dataclass
class ServerState:
    loop: EngineLoop
    """The engine thread."""
    tokenizer: object
    """Text <-> ids for text prompts and the 'text' field of responses."""
    model_name: str
    """Reported in responses."""


async def _generate(request: web.Request, chat: bool) -> web.Response:
    st: ServerState = request.app["state"]
    try:
        body = await _json_body(request)
        prompt = (chat_prompt if chat else completion_prompt)(body, st.tokenizer)
        params = sampling_from(body, st.tokenizer)
        if body.get("return_routed_experts") and getattr(st.loop.engine.cache, "routes", None) is None:
            raise BadRequest("return_routed_experts: this engine does not record MoE routes (a dense model, or "
                             "built without record_routes: rl.trainer.routing_replay=off)")
        bounds, compression = compression_from(body, st.tokenizer)
        rid, fut = st.loop.submit(prompt, params, bounds, compression)
    except ValueError as e:  # BadRequest, or the engine's checks (vocabulary, length, pool size)
        return _error(400, str(e))
    try:
        out = await fut
    except asyncio.CancelledError:  # the client went away: free its blocks now
        st.loop.abort(rid)
        raise
    return web.json_response(render(out, chat, body, st.tokenizer, st.model_name))


async def completions(request: web.Request) -> web.Response:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.Response:
    return await _generate(request, chat=True)


async def health(request: web.Request) -> web.Response:
    st: ServerState = request.app["state"]
    return web.json_response({"status": "ok", "policy_version": st.loop.engine.version})


def metrics_text(loop: EngineLoop) -> str:
    s = loop.engine.stats()
    elapsed = max(time.monotonic() - loop.started, 1e-9)
    rows = {"queue_length": s["queue_length"], "running_sequences": s["running"],
            "requests_in_flight": s["requests_in_flight"], "kv_cache_blocks_used": s["kv_blocks_used"],
            "kv_cache_blocks_total": s["kv_blocks_total"], "generated_tokens_total": s["generated_tokens"],
            "prompt_tokens_total": s["prompt_tokens"], "generation_tokens_per_second": s["generated_tokens"] / elapsed,
            "preemptions_total": s["preemptions"], "aborted_requests_total": loop.aborted,
            "policy_version": s["policy_version"]}
    gauges = {"kv_cache_blocks_total"}  # the pool's size, not a count of events
    return prometheus_text.render(prometheus_text.Sample(f"rollout_{k}", v, kind="gauge" if k in gauges else None)
                                  for k, v in rows.items())


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=metrics_text(request.app["state"].loop).encode(),
                        headers={"Content-Type": prometheus_text.CONTENT_TYPE})


async def update_weights(request: web.Request) -> web.Response:
    st: ServerState = request.app["state"]
    try:
        body = await _json_body(request)
        if not isinstance(body.get("version"), int) or not isinstance(body.get("path"), str):
            raise BadRequest("update_weights needs integer 'version' and string 'path' (a torch.save'd state dict)")
        n = await st.loop.update_weights(body["version"], body["path"], body.get("policy"))
    except FileNotFoundError as e:
        return _error(400, f"update_weights: {e}")
    except (ValueError, KeyError, RuntimeError) as e:
        return _error(400, str(e))
    log.info("update_weights: policy version %d, %d tensors from %s", body["version"], n, body["path"])
    return web.json_response({"status": "ok", "policy_version": body["version"], "tensors": n})


def create_app(engine: RolloutEngine, tokenizer=None, model_name: str = "megatron-rl-policy",
               loop: EngineLoop | None = None, token: str | None = None, gateway: bool = False) -> web.Application:
    """The aiohttp app; `loop` defaults to an EngineLoop (tp_serve.TPEngineLoop for tensor parallelism).
    `token`: the bearer token of every endpoint but /health (default: $MEGATRON_RL_ROLLOUT_TOKEN, else random).
    `gateway`: also serve the token-recording episode gateway (`gateway.py`; needs a chat-template tokenizer)."""
    app = web.Application(client_max_size=64 << 20)
    app["token"] = token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)
    loop = loop or EngineLoop(engine)
    vocab = engine.model.vocab_size if engine.model is not None else engine.hf["vocab_size"]  # vllm: no model here
    app["state"] = ServerState(loop, tokenizer or ByteTokenizer(vocab), model_name)
    app.router.add_post("/v1/completions", requires_token(completions))
    app.router.add_post("/v1/chat/completions", requires_token(chat_completions))
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", requires_token(metrics))
    app.router.add_post("/update_weights", requires_token(update_weights))
    if gateway:
        from megatron_rl.rollout.gateway import add_routes

        add_routes(app, app["state"].tokenizer)

    async def on_startup(app):
        loop.start()

    async def on_cleanup(app):
        loop.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


class ServerThread:
    """Runs the app on host:port in a background thread (for tests and for in-process embedding)."""

    def __init__(self, engine: RolloutEngine, host: str = "127.0.0.1", port: int = 0, unix_path: str | None = None,
                 **app_kw):
        """`unix_path`: listen on this Unix socket instead of host:port (a sandbox reaches it through a bind
        mount, with no network)."""
        self.app = create_app(engine, **app_kw)
        self.host, self.port, self.unix_path = host, port, unix_path
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._serve, name="rollout-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def token(self) -> str:
        """The bearer token of every endpoint but /health."""
        return self.app["token"]

    def start(self) -> ServerThread:
        self.thread.start()
        if not self._ready.wait(timeout=30):
            raise RuntimeError("rollout server did not start within 30 s")
        return self

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        runner = web.AppRunner(self.app, handler_cancellation=True)
        self._loop.run_until_complete(runner.setup())
        site = web.UnixSite(runner, self.unix_path) if self.unix_path else web.TCPSite(runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        if not self.unix_path:
            self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(runner.cleanup())

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self.thread.join(timeout=15)


def main(argv: list[str] | None = None) -> int:
    """Serve a policy: ModelConfig/EngineConfig from --config (a JSON/YAML file with `model` and `engine`
    sections, e.g. a run's config.yaml) or the defaults; random weights unless --weights."""
    from megatron_rl.distributed import init_distributed
    from megatron_rl.parallel import ParallelConfig

    p = argparse.ArgumentParser(prog="python -m megatron_rl.rollout.server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (see --port-file)")
    p.add_argument("--port-file", help="write the bound port here once listening (atomically)")
    p.add_argument("--config", help="JSON/YAML with `model` and `engine` sections (other sections are ignored)")
    p.add_argument("--weights", help="weight file (rollout/weight_file.py) or torch.save'd state dict, trainer names")
    p.add_argument("--version", type=int, default=0, help="policy version of --weights")
    p.add_argument("--vocab-size", type=int, default=384, help="without --config: the default model's vocabulary")
    p.add_argument("--record-routes", action="store_true",
                   help="MoE routing replay: record each token's experts (return_routed_experts requests)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model_cfg, engine_cfg, tok = _server_configs(args.config, args.vocab_size)
    ctx = init_distributed(ParallelConfig(), source="single")
    engine = RolloutEngine.build(model_cfg, engine_cfg, ParallelConfig(), ctx.pgs, valid_vocab=tok.vocab_size,
                                 record_routes=args.record_routes)
    if args.weights:  # every parameter, or it names the missing
        engine.update_weights(args.version, weights_in(args.weights, engine), complete=True)
    asyncio.run(_serve_forever(create_app(engine, tok), args.host, args.port, args.port_file))
    return 0


def weights_in(path: str, engine):
    """(name, tensor) of the weights at `path`: a weight file read into the engine's own tensors, or a
    torch.save'd state dict, memory-mapped."""
    import torch

    from megatron_rl.rollout.weight_file import is_weight_file, read_weights_into

    if is_weight_file(path):
        model = engine.model
        return read_weights_into(path, {**dict(model.named_buffers()), **dict(model.named_parameters())})
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()


def _server_configs(path: str | None, vocab_size: int):
    from megatron_rl.config import from_dict, read_yaml_mapping
    from megatron_rl.models.gpt import ModelConfig
    from megatron_rl.rollout.engine import EngineConfig
    from megatron_rl.tokenizer import TokenizerConfig

    if not path:
        return ModelConfig(vocab_size=vocab_size), EngineConfig(), ByteTokenizer(vocab_size)
    data = read_yaml_mapping(path)
    model = from_dict(ModelConfig, data.get("model", {}))
    if model.init:
        from megatron_rl.convert.source import resolve

        resolve(model)  # the resolve step: the checkpoint's shape
    tok = from_dict(TokenizerConfig, data.get("tokenizer", {})).build(model)
    return model, from_dict(EngineConfig, data.get("engine", {})), tok


async def _serve_forever(app: web.Application, host: str, port: int, port_file: str | None) -> None:
    import os
    import signal

    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("rollout server listening on %s:%d", host, site._server.sockets[0].getsockname()[1])
    if port_file:
        tmp = f"{port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(site._server.sockets[0].getsockname()[1]))
        os.replace(tmp, port_file)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
