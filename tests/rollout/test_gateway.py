"""The token-recording gateway in front of the real rollout engine (tiny random model, tiny HF tokenizer):
a black-box agent's calls become one exact trajectory (tokens and log-probs equal to what the engine
returned, observations masked), a history-editing agent is detected (a new segment), and the shell agent
reaches it through a Unix socket."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_rl.rollout import EngineConfig, RolloutEngine
from megatron_rl.rollout.gateway import EPISODE_TOKEN_ENV, episode_token
from megatron_rl.rollout.server import ServerThread
from tests.rollout.test_rollout_engine import MODEL, _init_single, full_logits

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_rl.tokenizer import HFTokenizer
    from tests.hf_tiny import tiny_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    tiny_tokenizer(folder)
    tok = HFTokenizer(folder)
    import dataclasses

    from megatron_rl.compat.testing import init_weights_by_name
    from megatron_rl.models.gpt import build_gpt
    from megatron_rl.parallel import ParallelConfig

    pgs = _init_single()
    model = build_gpt(dataclasses.replace(MODEL, max_seq_length=1024), ParallelConfig(), pgs)
    init_weights_by_name(model, seed=3)
    model.eval()
    engine = RolloutEngine(model, EngineConfig(num_blocks=256, block_size=8, max_tokens_per_step=256),
                           pgs.tp, pgs.cp, valid_vocab=tok.vocab_size)
    return tok, model, engine


@pytest.fixture
def server(setup, tmp_path):
    tok, _, engine = setup
    srv = ServerThread(engine, tokenizer=tok, gateway=True, token=TOKEN).start()
    yield srv
    srv.stop()


TOKEN = "gateway-test-job-token"
"""The job's token of the `server` fixture."""


def _call(method: str, url: str, body: dict | None = None, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, json.dumps(body).encode() if body is not None else None, headers,
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(url: str, body: dict, token: str | None = TOKEN) -> dict:
    status, out = _call("POST", url, body, token)
    assert status == 200, out
    return out


def _trajectory(url: str, episode: str) -> dict:
    status, out = _call("GET", f"{url}/episodes/{episode}/trajectory")
    assert status == 200, out
    return out


def _agent(url: str, episode: str, edit_at: int | None = None) -> list[dict]:
    """A scripted black-box agent: 3 calls, each answered with a tool result (or, at `edit_at`, after
    rewriting its first user message)."""
    msgs, answers = [{"role": "user", "content": "What is 7 + 5?"}], []
    tools = [{"type": "function", "function": {"name": "calc", "description": "add",
                                               "parameters": {"type": "object", "properties": {}}}}]
    for call in range(3):
        if call == edit_at:
            msgs[0] = {"role": "user", "content": "What is 9 * 3?"}
        out = _post(f"{url}/episodes/{episode}/v1/chat/completions",
                    {"messages": msgs, "tools": tools, "max_tokens": 6, "temperature": 1.0, "seed": 11 + call})
        answers.append(out)
        msgs += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                 {"role": "tool", "content": f"result {call}: 12"}]
    return answers


def test_three_calls_become_one_exact_trajectory(setup, server):
    tok, model, _ = setup
    answers = _agent(server.url, "ep1")
    traj = _trajectory(server.url, "ep1")
    assert traj["splits"] == 0 and len(traj["segments"]) == 1 and all(a["episode"]["exact"] for a in answers)
    seg = traj["segments"][0]
    last = answers[-1]
    assert seg["tokens"] == last["prompt_token_ids"] + last["choices"][0]["token_ids"] and seg["calls"] == 3
    pos = 0
    for a in answers:  # each call's prompt is a prefix of the sequence; its completion follows, masked 1
        ids, lps = a["choices"][0]["token_ids"], [c["logprob"] for c in a["choices"][0]["logprobs"]["content"]]
        p = a["prompt_token_ids"]
        assert seg["tokens"][:len(p)] == p and seg["tokens"][len(p):len(p) + len(ids)] == ids
        assert seg["mask"][pos:len(p)] == [0] * (len(p) - pos)
        assert seg["mask"][len(p):len(p) + len(ids)] == [1] * len(ids)
        assert seg["logprobs"][len(p):len(p) + len(ids)] == lps
        pos = len(p) + len(ids)
    ids, p = answers[-1]["choices"][0]["token_ids"], answers[-1]["prompt_token_ids"]
    logits = full_logits(model, p + ids)[len(p) - 1:-1, :tok.vocab_size]  # [G, V]: padding ids are never sampled
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]  # the model's (full forward)
    torch.testing.assert_close(torch.tensor(seg["logprobs"][-len(ids):]), want, atol=1e-4, rtol=0)
    assert "result 1: 12" in tok.decode(seg["tokens"])


def test_an_agent_that_edits_its_history_is_detected_and_split(server):
    answers = _agent(server.url, "ep2", edit_at=2)
    traj = _trajectory(server.url, "ep2")
    assert [a["episode"]["exact"] for a in answers] == [True, True, False] and traj["splits"] == 1
    first, second = traj["segments"]
    assert first["calls"] == 2 and second["calls"] == 1
    assert second["tokens"] == answers[2]["prompt_token_ids"] + answers[2]["choices"][0]["token_ids"]
    assert sum(second["mask"]) == len(answers[2]["choices"][0]["token_ids"])  # the edited history is not trained


def test_shell_agent_reaches_the_gateway_through_a_unix_socket(setup, tmp_path):
    _, _, engine = setup
    tok = setup[0]
    sock = tmp_path / "gw.sock"
    srv = ServerThread(engine, tokenizer=tok, gateway=True, unix_path=str(sock), token=TOKEN).start()
    try:
        (tmp_path / "task.md").write_text("List the files here.")
        cmd = [sys.executable, str(REPO / "envs" / "agents" / "shell_agent.py"), "--socket", str(sock), "--episode",
               "e", "--task", str(tmp_path / "task.md"), "--max-turns", "2", "--max-tokens", "8"]
        env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_RL_ROLLOUT_TOKEN", EPISODE_TOKEN_ENV)}
        refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert "gateway answered 401" in refused.stderr + refused.stdout  # a socket is no pass: the token is
        assert srv.app["gateway"].trajectory("e")["segments"] == []
        env[EPISODE_TOKEN_ENV] = episode_token(TOKEN, "e")  # what the agent of episode e is handed
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        turns = json.loads(proc.stdout.splitlines()[-1])["turns"]
        traj = srv.app["gateway"].trajectory("e")
        assert turns >= 1 and sum(s["calls"] for s in traj["segments"]) == turns
    finally:
        srv.stop()


CHAT = {"messages": [{"role": "user", "content": "What is 7 + 5?"}], "max_tokens": 3, "temperature": 1.0, "seed": 1}


def test_every_gateway_route_needs_the_job_token(server):
    """Appending a turn to, reading or deleting an episode's recorded trajectory (training data) without the job's
    token (missing, wrong) is refused with 401 and changes nothing; with it, each works."""
    url = server.url
    _post(f"{url}/episodes/victim/v1/chat/completions", CHAT)
    before = _trajectory(url, "victim")
    for token in (None, "wrong", TOKEN + "x"):
        calls = [("POST", f"{url}/episodes/victim/v1/chat/completions", CHAT),
                 ("GET", f"{url}/episodes/victim/trajectory", None), ("DELETE", f"{url}/episodes/victim", None),
                 ("POST", f"{url}/episodes/new/v1/chat/completions", CHAT)]
        for method, route, body in calls:
            status, out = _call(method, route, body, token)
            assert status == 401 and "token" in out["error"]["message"], (method, route, token)
    assert _trajectory(url, "victim") == before and _trajectory(url, "new")["segments"] == []
    assert _call("DELETE", f"{url}/episodes/victim")[0] == 200
    assert _trajectory(url, "victim")["segments"] == []


def test_an_episode_token_opens_only_that_episodes_chat(server):
    """The token an agent of one episode holds cannot write another episode, nor read or delete any recording."""
    url, mine = server.url, episode_token(TOKEN, "mine")
    assert len(_post(f"{url}/episodes/mine/v1/chat/completions", CHAT, token=mine)["choices"]) == 1
    for method, route, body in [("POST", f"{url}/episodes/other/v1/chat/completions", CHAT),
                                ("GET", f"{url}/episodes/mine/trajectory", None),
                                ("DELETE", f"{url}/episodes/mine", None)]:
        assert _call(method, route, body, mine)[0] == 401, (method, route)
    assert _trajectory(url, "other")["segments"] == [] and _trajectory(url, "mine")["segments"][0]["calls"] == 1
