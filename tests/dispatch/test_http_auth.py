"""The one authentication of every HTTP server, over real sockets (each server started on port 0): the rollout
server, its episode gateway, the fleet's lease queue and the Monitor's Prometheus endpoint all refuse a request
without `Authorization: Bearer <token>`, with a wrong token, or with the token in another header, with 401, a
`WWW-Authenticate: Bearer` header and the same JSON error naming the header; each accepts the right token.
(The agent session's Unix socket, envs.agents.session, is one episode's channel inside its sandbox: no token.)"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from megatron_rl.http_auth import bearer

TOKEN = "contract-test-token"


def _call(url: str, method: str, body: dict | None, headers: dict) -> tuple[int, dict, object]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **headers}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {}, r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


ROLLOUT = "MEGATRON_RL_ROLLOUT_TOKEN"
"""What the rollout server's 401 names (the gateway's chat route also names the episode's token)."""


def _fleet(tmp_path):
    from megatron_rl.dispatch.fleet_server import FleetState, serve
    from megatron_rl.dispatch.lease_queue import LeaseQueue

    httpd = serve(FleetState(LeaseQueue(60.0)), TOKEN, "127.0.0.1")
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    routes = [("GET", "/status", None, "queue.json"), ("POST", "/lease", {"worker": "w", "wait_s": 0}, "queue.json")]
    return url, routes, lambda: (httpd.shutdown(), httpd.server_close())


def _monitor(tmp_path):
    from megatron_rl.monitoring import PrometheusExporter

    exp = PrometheusExporter("127.0.0.1", 0, token=TOKEN)
    exp.update("rl", 0, {"rl/reward_mean": 0.5})
    return f"http://127.0.0.1:{exp.port}", [("GET", "/metrics", None, "prometheus_token")], exp.close


def _rollout(tmp_path):
    import dataclasses

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.models.gpt import build_gpt
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.rollout import EngineConfig, RolloutEngine
    from megatron_rl.rollout.server import ServerThread
    from megatron_rl.tokenizer import HFTokenizer
    from tests.hf_tiny import tiny_tokenizer
    from tests.rollout.test_rollout_engine import MODEL, _init_single

    tiny_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    pgs = _init_single()
    model = build_gpt(dataclasses.replace(MODEL, max_seq_length=256), ParallelConfig(), pgs)
    init_weights_by_name(model, seed=3)
    engine = RolloutEngine(model.eval(), EngineConfig(num_blocks=64, block_size=8), pgs.tp, pgs.cp,
                           valid_vocab=tok.vocab_size)
    srv = ServerThread(engine, tokenizer=tok, gateway=True, token=TOKEN).start()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    routes = [("POST", "/v1/completions", {"prompt_token_ids": [1, 2, 3], "max_tokens": 2}, ROLLOUT),
              ("POST", "/v1/chat/completions", chat, ROLLOUT), ("GET", "/metrics", None, "rollout_token"),
              ("POST", "/update_weights", {"version": 1, "path": str(tmp_path / "none.pt")}, ROLLOUT),
              ("GET", "/episodes/e/trajectory", None, ROLLOUT), ("DELETE", "/episodes/e", None, ROLLOUT),
              ("POST", "/episodes/e/v1/chat/completions", chat, "MEGATRON_RL_GATEWAY_TOKEN")]
    assert _call(srv.url + "/health", "GET", None, {})[0] == 200  # the one open route (liveness probes)
    return srv.url, routes, srv.stop


SERVERS = [pytest.param(_fleet, id="fleet"), pytest.param(_monitor, id="monitor"),
           pytest.param(_rollout, id="rollout+gateway", marks=pytest.mark.slow)]


@pytest.mark.parametrize("start", SERVERS)
def test_every_server_refuses_a_missing_or_wrong_token_with_401_and_accepts_the_right_one(start, tmp_path):
    """Each route: 401 with the one error shape (naming the header and the token's source) for every wrong
    header; the right token reaches the endpoint."""
    url, routes, stop = start(tmp_path)
    wrong = [{}, bearer("wrong"), bearer(TOKEN + "x"), {"Authorization": TOKEN}, {"X-Fleet-Token": TOKEN},
             {"Authorization": f"Bearer {TOKEN}\u00e9"}]  # (urllib sends that one as Latin-1)
    try:
        for method, path, body, source in routes:
            for headers in wrong:
                status, out, h = _call(url + path, method, body, headers)
                assert status == 401, (path, headers, status)
                assert h["WWW-Authenticate"] == "Bearer" and out["error"]["code"] == 401
                msg = out["error"]["message"]
                assert msg.startswith(path) and "'Authorization: Bearer <token>'" in msg and source in msg, msg
            status, out, _ = _call(url + path, method, body, bearer(TOKEN))
            if path == "/update_weights":  # authorised, then refused for its missing file (not 401)
                assert status == 400 and "none.pt" in out["error"]["message"], out
            else:
                assert status == 200, (path, out)
    finally:
        stop()
