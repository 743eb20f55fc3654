"""The rollout HTTP server on 127.0.0.1 (a real aiohttp server in a thread, real sockets, the real engine)."""
from __future__ import annotations

import json
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_rl.models.gpt import ModelConfig, build_gpt
from megatron_rl.parallel import ParallelConfig
from megatron_rl.rollout import EngineConfig, RolloutEngine, SamplingParams
from megatron_rl.rollout.client import RolloutClient, RolloutError
from megatron_rl.rollout.server import ServerThread
from tests.rollout.test_rollout_engine import _init_single

pytestmark = pytest.mark.slow
MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=384, max_seq_length=1024)


def _model(pgs, seed: int):
    from megatron_rl.compat.testing import init_weights_by_name

    model = build_gpt(MODEL, ParallelConfig(), pgs)
    init_weights_by_name(model, seed=seed)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.mul_(3)
    return model.eval()


@pytest.fixture(scope="module")
def pgs():
    return _init_single()


@pytest.fixture(scope="module")
def model(pgs):
    return _model(pgs, 3)


@pytest.fixture()
def server(pgs):
    engine = RolloutEngine(_model(pgs, 3), EngineConfig(num_blocks=256, block_size=16), pgs.tp, pgs.cp)
    srv = ServerThread(engine).start()
    yield srv, RolloutClient(srv.url, timeout=60, retries=1, backoff=0.1, token=srv.token)
    srv.stop()


def _wait_for(cond, timeout: float = 20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_concurrent_clients_get_the_engines_tokens_and_logprobs(server, model, pgs):
    srv, client = server
    prompts = [[257, *range(30 + i, 34 + 2 * i)] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: client.complete(p, max_tokens=12, temperature=0), prompts))
    ref = RolloutEngine(model, EngineConfig(num_blocks=64), pgs.tp, pgs.cp).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=12))
    for out, r in zip(outs, ref):
        (choice,) = out["choices"]
        assert choice["token_ids"] == r.samples[0].token_ids and choice["finish_reason"] == "length"
        torch.testing.assert_close(choice["logprobs"]["token_logprobs"], r.samples[0].logprobs, atol=1e-5, rtol=0)
        assert choice["policy_versions"] == [0] * 12 and out["usage"]["completion_tokens"] == 12
    m = client.metrics()
    assert m["rollout_generated_tokens_total"] == 96 and m["rollout_kv_cache_blocks_used"] == 0
    assert m["rollout_kv_cache_blocks_total"] == 256 and m["rollout_generation_tokens_per_second"] > 0


def test_chat_and_text_prompts_and_n_samples(server):
    _, client = server
    out = client.chat([{"role": "user", "content": "hi"}], max_tokens=5, temperature=1.0, n=3, seed=4)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 5 and isinstance(c["message"]["content"], str) for c in out["choices"])
    assert out["prompt_token_ids"][0] == 257 and len(out["choices"][0]["logprobs"]["content"]) == 5
    text = client._json("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 3})
    assert text["prompt_token_ids"] == [97, 98] and "text" in text["choices"][0]
    assert client.health() == {"status": "ok", "policy_version": 0}


@pytest.mark.parametrize("body,reason", [
    ({"max_tokens": 3}, "missing 'prompt'"),
    ({"prompt_token_ids": [1, 2], "temperature": "hot"}, "'temperature'"),
    ({"prompt_token_ids": [1, 999]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, 2], "top_p": 0}, "top_p"),
    ({"prompt_token_ids": [1, "x"]}, "prompt_token_ids must be"),
    ({"prompt_token_ids": [1], "max_tokens": 5000}, "max_seq_length"),
    ({"messages": "hello"}, "messages"),
])
def test_malformed_requests_get_400_with_a_reason(server, body, reason):
    _, client = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with pytest.raises(RolloutError, match=reason) as err:
        client._json("POST", path, body)
    assert err.value.status == 400


def test_invalid_json_gets_400(server):
    srv, _ = server
    req = urllib.request.Request(srv.url + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"Authorization": f"Bearer {srv.token}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400 and "not valid JSON" in json.loads(err.value.read())["error"]["message"]


def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server):
    srv, client = server
    body = json.dumps({"prompt_token_ids": [257, 5, 6], "max_tokens": 1000, "temperature": 1.0}).encode()
    sock = socket.create_connection((srv.host, srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer %s\r\n" % srv.token.encode() +
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert _wait_for(lambda: client.metrics()["rollout_kv_cache_blocks_used"] > 0)
    sock.close()
    assert _wait_for(lambda: client.metrics()["rollout_kv_cache_blocks_used"] == 0, timeout=10)
    m = client.metrics()
    assert m["rollout_aborted_requests_total"] == 1 and m["rollout_requests_in_flight"] == 0
    assert m["rollout_generated_tokens_total"] < 1000  # it was stopped, not run to the end


def test_update_weights_endpoint(server, pgs, tmp_path):
    _, client = server
    new = _model(pgs, 4)
    state = {k: v.detach() for k, v in new.state_dict().items() if not k.endswith("_extra_state")}
    torch.save(state, tmp_path / "w.pt")
    assert client.update_weights(1, str(tmp_path / "w.pt"))["policy_version"] == 1
    out = client.complete([257, 40, 41], max_tokens=4, temperature=0)
    assert out["choices"][0]["policy_versions"] == [1] * 4 and client.health()["policy_version"] == 1
    ref = RolloutEngine(new, EngineConfig(num_blocks=16)).generate(
        [[257, 40, 41]], SamplingParams(temperature=0, max_new_tokens=4))
    assert out["choices"][0]["token_ids"] == ref[0].samples[0].token_ids
    with pytest.raises(RolloutError, match="update_weights") as err:
        client.update_weights(2, str(tmp_path / "missing.pt"))
    assert err.value.status == 400


def test_update_weights_from_a_weight_file_reads_into_the_engines_parameters(pgs, tmp_path):
    """What `RolloutServerProcess.push` sends (a weight file, rollout/weight_file.py): the server reads it into
    its engine's own parameters and generates as the new model; one missing parameter is refused, named."""
    from megatron_rl.rollout.weight_file import write_weights

    engine = RolloutEngine(_model(pgs, 3), EngineConfig(num_blocks=64, block_size=16), pgs.tp, pgs.cp)
    srv = ServerThread(engine).start()
    client = RolloutClient(srv.url, timeout=60, retries=1, backoff=0.1, token=srv.token)
    new = _model(pgs, 5)
    named = [(k, v.detach()) for k, v in new.state_dict().items() if not k.endswith("_extra_state")]
    write_weights(tmp_path / "w.bin", named)
    params = dict(engine.model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    assert client.update_weights(1, str(tmp_path / "w.bin"))["policy_version"] == 1
    assert {n: p.data_ptr() for n, p in params.items()} == ptrs
    assert all(torch.equal(params[n], t) for n, t in named if n in params)
    out = client.complete([257, 40, 41], max_tokens=4, temperature=0)
    ref = RolloutEngine(new, EngineConfig(num_blocks=16)).generate(
        [[257, 40, 41]], SamplingParams(temperature=0, max_new_tokens=4))
    assert out["choices"][0]["token_ids"] == ref[0].samples[0].token_ids
    write_weights(tmp_path / "w.bin", [(n, t) for n, t in named if n != "decoder.final_layernorm.weight"])
    with pytest.raises(RolloutError, match=r"unwritten.*decoder.final_layernorm.weight"):
        client.update_weights(2, str(tmp_path / "w.bin"))
    srv.stop()


def test_every_endpoint_but_health_needs_the_job_token(server, tmp_path, monkeypatch):
    """Anyone on the cluster network could replace the policy through /update_weights, run it (read the model
    out, starve the workers) or read its metrics: without the job's token (missing or wrong) every endpoint but
    /health answers 401, and nothing runs."""
    srv, client = server
    monkeypatch.delenv("MEGATRON_RL_ROLLOUT_TOKEN", raising=False)
    assert len(srv.token) >= 32
    for token in (None, "wrong", srv.token + "x", srv.token[:-1]):
        intruder = RolloutClient(srv.url, timeout=30, retries=0, token=token)
        calls = {"update_weights": lambda c=intruder: c.update_weights(7, str(tmp_path / "evil.pt")),
                 "completions": lambda c=intruder: c.complete([257, 40], max_tokens=2, temperature=0),
                 "chat": lambda c=intruder: c.chat([{"role": "user", "content": "hi"}], max_tokens=2),
                 "metrics": intruder.metrics}
        for name, call in calls.items():
            with pytest.raises(RolloutError) as err:
                call()
            assert err.value.status == 401 and "token" in str(err.value), name
        assert intruder.health()["policy_version"] == 0
    assert client.metrics()["rollout_generated_tokens_total"] == 0  # nothing ran for the intruders
    assert len(client.complete([257, 40], max_tokens=2, temperature=0)["choices"][0]["token_ids"]) == 2
    monkeypatch.setenv("MEGATRON_RL_ROLLOUT_TOKEN", srv.token)  # how the driver hands it to its clients
    with pytest.raises(RolloutError) as err:
        RolloutClient(srv.url, retries=0).update_weights(7, str(tmp_path / "missing.pt"))
    assert err.value.status == 400  # authenticated: it got as far as the missing file


def test_server_binds_the_node_address_not_all_interfaces():
    from megatron_rl.loop.dispatched import node_address

    assert node_address("localhost") == "127.0.0.1"  # loopback only: warned, and loopback it stays
    assert node_address("127.0.0.1") == "127.0.0.1"
    assert node_address("10.1.2.3") == "10.1.2.3"
    assert node_address("no-such-host.invalid") == "127.0.0.1"  # never 0.0.0.0


def _listening_addresses(port: int) -> set[str]:
    """The IPv4/IPv6 addresses this machine listens on at TCP `port`, from /proc/net/tcp{,6} (no traffic sent)."""
    import ipaddress

    out = set()
    for name, width in (("tcp", 4), ("tcp6", 16)):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state != "0A" or int(hexport, 16) != port:  # 0A = LISTEN
                continue
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))  # each 32-bit word is little-endian
            out.add(str(ipaddress.ip_address(raw)))
    return out


@pytest.mark.parametrize("which", ["rollout_server", "fleet_queue"])
def test_a_server_configured_for_localhost_listens_on_loopback_only(pgs, tmp_path, which):
    """serve_host=localhost under Slurm (the workers are told to use localhost): the rollout server and the fleet
    queue listen on loopback only (the kernel's socket table; they bound 0.0.0.0, so every interface answered)."""
    from megatron_rl.dispatch import DispatchConfig, WorkerConfig
    from megatron_rl.dispatch.fleet import Fleet, FleetConfig
    from megatron_rl.dispatch.fleet_server import FleetState, serve
    from megatron_rl.dispatch.lease_queue import LeaseQueue
    from megatron_rl.loop.config import EpisodesConfig
    from megatron_rl.loop.dispatched import server_hosts

    if which == "rollout_server":
        bind, public = server_hosts(EpisodesConfig(runner="dispatch", serve_host="localhost",
                                                   dispatch=DispatchConfig(executor="slurm")))
        engine = RolloutEngine(_model(pgs, 3), EngineConfig(num_blocks=16, block_size=16), pgs.tp, pgs.cp)
        srv = ServerThread(engine, host=bind).start()
        port, close = srv.port, srv.stop
    else:
        bind, public = Fleet(FleetConfig(executor="slurm", serve_host="localhost"), WorkerConfig(), tmp_path)._hosts()
        httpd = serve(FleetState(LeaseQueue(60.0)), "t", bind)
        port = httpd.server_address[1]

        def close():
            httpd.shutdown()
            httpd.server_close()
    assert bind == "127.0.0.1" and public == "localhost"
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # it is up
        assert _listening_addresses(port) == {"127.0.0.1"}  # never 0.0.0.0: no other interface answers
    finally:
        close()


def test_the_token_file_is_private_and_never_written_through_a_planted_link(tmp_path):
    import os
    import stat

    from megatron_rl.http_auth import write_token_file
    from megatron_rl.rollout.client import read_token_file

    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    path = tmp_path / "rollout_token"
    os.symlink(target, f"{path}.{os.getpid()}.tmp")  # planted where the writer stages the file
    write_token_file(path, "tok-1")
    assert read_token_file(path) == "tok-1" and target.read_text() == "untouched"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not path.is_symlink()
    client = RolloutClient("http://127.0.0.1:9", token_file=str(path))
    assert client.token == "tok-1"
    write_token_file(path, "tok-2")  # a restarted driver: the client picks it up after a 401
    assert client._token_changed() and client.token == "tok-2" and not client._token_changed()
