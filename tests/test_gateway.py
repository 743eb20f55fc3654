"""The token-recording gateway in front of the real rollout engine (tiny random model, tiny HF tokenizer):
a black-box agent's calls become one exact trajectory (tokens and log-probs equal to what the engine
returned, observations masked), a history-editing agent is detected (a new segment), and the shell agent
reaches it through a Unix socket."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_rl.rollout import EngineConfig, RolloutEngine
from megatron_rl.rollout.server import ServerThread
from tests.test_rollout_engine import MODEL, _init_single, full_logits

REPO = Path(__file__).resolve().parents[1]


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
    srv = ServerThread(engine, tokenizer=tok, gateway=True).start()
    yield srv
    srv.stop()


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


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
    traj = json.loads(urllib.request.urlopen(f"{server.url}/episodes/ep1/trajectory").read())
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
    traj = json.loads(urllib.request.urlopen(f"{server.url}/episodes/ep2/trajectory").read())
    assert [a["episode"]["exact"] for a in answers] == [True, True, False] and traj["splits"] == 1
    first, second = traj["segments"]
    assert first["calls"] == 2 and second["calls"] == 1
    assert second["tokens"] == answers[2]["prompt_token_ids"] + answers[2]["choices"][0]["token_ids"]
    assert sum(second["mask"]) == len(answers[2]["choices"][0]["token_ids"])  # the edited history is not trained


def test_shell_agent_reaches_the_gateway_through_a_unix_socket(setup, tmp_path):
    _, _, engine = setup
    tok = setup[0]
    sock = tmp_path / "gw.sock"
    srv = ServerThread(engine, tokenizer=tok, gateway=True, unix_path=str(sock)).start()
    try:
        (tmp_path / "task.md").write_text("List the files here.")
        proc = subprocess.run([sys.executable, str(REPO / "envs" / "agents" / "shell_agent.py"), "--socket", str(sock),
                               "--episode", "e", "--task", str(tmp_path / "task.md"), "--max-turns", "2",
                               "--max-tokens", "8"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        turns = json.loads(proc.stdout.splitlines()[-1])["turns"]
        traj = srv.app["gateway"].trajectory("e")
        assert turns >= 1 and sum(s["calls"] for s in traj["segments"]) == turns
    finally:
        srv.stop()
