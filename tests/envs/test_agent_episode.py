"""Black-box agent episodes: the shell agent runs inside the bubblewrap sandbox, reaches the policy through the
gateway's Unix socket bound into it, and its calls become one exact trajectory (tokens and log-probs equal to what
the generator returned, observations masked); the Harbor task's tests score the workspace it leaves; a history
that the agent edits (drop-oldest) splits the episode and only the exact last segment is trained; the context
budget ends the episode as truncated; the run config refuses what cannot work."""
from __future__ import annotations

from pathlib import Path

import pytest

from envs.episode import drive, open_episode

WRITE_OK = '<tool_call>{"name": "shell", "arguments": {"command": "echo done > ok && ls"}}</tool_call>'
REPO = Path(__file__).resolve().parents[2]
BIG = '<tool_call>{"name": "shell", "arguments": {"command": "seq 1 400"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(hf_tok):
    return hf_tok


def _task(tmp_path):
    """A Harbor task: create /app/ok; its test checks the file."""
    from envs.harbor.loader import load_task_folder

    d = tmp_path / "make-ok"
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "instruction.md").write_text("Create a file named ok in /app.\n")
    (d / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = 60.0\n')
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\n")
    (d / "tests" / "test.sh").write_text("#!/bin/bash\nif [ -f /app/ok ]; then echo 1; else echo 0; fi "
                                         "> /logs/verifier/reward.txt\n")
    return load_task_folder(d)


class Scripted:
    """A policy that answers with the given texts in order (then 'Done.'), recording what it was asked."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.asked, self.given = tok, list(texts), [], []

    def __call__(self, tokens, turn):
        text = self.texts[turn] if turn < len(self.texts) else "Done."
        ids = self.tok.encode(text) + [self.tok.stop_ids[0]]
        out = (ids, [-0.01 * (turn + 1) - 0.001 * k for k in range(len(ids))], [turn] * len(ids))
        self.asked.append(list(tokens))
        self.given.append(out)
        return out


def _env(sandbox, budget_tokens=4096, max_turns=8):
    from envs.base import Budget, make_env

    return make_env("harbor", agent="shell", sandbox=sandbox, budget=Budget(max_turns=max_turns,
                                                                             max_tokens=budget_tokens))


def test_agent_calls_through_the_socket_become_one_exact_trajectory(tok, sandbox, tmp_path):
    task = _task(tmp_path)
    policy = Scripted(tok, [WRITE_OK, '<tool_call>{"name": "shell", "arguments": {"command": "cat ok"}}</tool_call>',
                            '<tool_call>{"name": "shell", "arguments": {"command": "pwd"}}</tool_call>'])
    r = drive(open_episode(_env(sandbox), task, tok, 4096), policy)
    assert r.status == "ok" and r.turns == 4 and r.reward.total == 1.0, (r.status, r.reward)
    assert r.timings["agent.calls"] == 4 and r.timings["agent.splits"] == 0
    # every call's prompt extends the previous call's prompt + completion: one sequence, never re-tokenised
    for prev, (ids, _, _), nxt in zip(policy.asked, policy.given, policy.asked[1:]):
        assert nxt[:len(prev) + len(ids)] == prev + ids
    assert r.tokens == policy.asked[-1] + policy.given[-1][0]
    assert sum(r.loss_mask) == sum(len(g[0]) for g in policy.given)
    trained = [(t, lp) for t, lp, m in zip(r.tokens, r.logprobs, r.loss_mask) if m]
    assert trained == [(t, lp) for ids, lps, _ in policy.given for t, lp in zip(ids, lps)]
    obs = tok.decode([t for t, m in zip(r.tokens[r.prompt_len:], r.loss_mask[r.prompt_len:]) if not m])
    assert "done" in obs and "/work" in obs  # the commands' outputs came back to the model (masked)
    assert r.versions[:r.prompt_len] == [0] * r.prompt_len and max(r.versions) == 3


def test_an_agent_that_does_nothing_scores_zero(tok, sandbox, tmp_path):
    r = drive(open_episode(_env(sandbox), _task(tmp_path), tok, 4096), Scripted(tok, []))
    assert r.status == "ok" and r.turns == 1 and r.reward.total == 0.0 and r.reward.valid


def test_the_callers_first_prompt_is_used_when_it_is_the_agents(tok, sandbox, tmp_path):
    """The loop generates a group's first turn before the agent calls: kept when the prompts match, else
    generated again from the agent's own prompt."""
    task = _task(tmp_path)
    env = _env(sandbox)
    obs = env.reset(task)
    prompt = tok.prompt_ids([{"role": obs.role, "content": obs.text}], obs.tools)
    for given, regenerated in ((prompt, False), (prompt[:-3], True)):
        policy = Scripted(tok, [WRITE_OK] * (1 + regenerated))  # a discarded generation takes a turn
        r = drive(open_episode(_env(sandbox), task, tok, 4096, prompt=given), policy)
        assert policy.asked[0] == given and r.reward.total == 1.0
        assert (policy.asked[1] == prompt) is regenerated
        assert r.turns == 2 and r.tokens[:len(prompt)] == prompt


def test_drop_oldest_history_splits_into_exact_segments_that_are_all_trained(tok, sandbox, tmp_path):
    """With a context budget the agent drops old exchanges: the gateway starts a new segment. The episode's
    sequence is the last segment and the earlier ones come with it; each is exactly what the model saw and
    sampled at one call (token for token), and together they hold every model token once."""
    from envs.harbor.env import HarborEnv

    task = _task(tmp_path)
    env = _env(sandbox)
    env.agent_args = "--history drop-oldest --context-budget 700 --max-output-chars 600"
    policy = Scripted(tok, [BIG, BIG, BIG, WRITE_OK])
    r = drive(open_episode(env, task, tok, 8192), policy)
    assert isinstance(env, HarborEnv) and r.reward.total == 1.0
    assert r.timings["agent.splits"] >= 1 and len(r.segments) == r.timings["agent.splits"]
    last = policy.asked[-1]
    assert r.tokens == last + policy.given[-1][0]  # the last segment: the last prompt exactly as generated from
    assert len(last) < len(policy.asked[-2]) + len(policy.given[-2][0])  # ... which is shorter: history was dropped
    calls = [a + g[0] for a, g in zip(policy.asked, policy.given)]
    for seg in r.segments:
        assert seg["tokens"] in calls and len(seg["tokens"]) == len(seg["loss_mask"]) == len(seg["logprobs"])
        model = [lp for lp, m in zip(seg["logprobs"], seg["loss_mask"]) if m]
        assert model and all(lp < 0 for lp in model) and not any(seg["loss_mask"][:seg["prompt_len"]])
    trained = sum(r.loss_mask) + sum(sum(seg["loss_mask"]) for seg in r.segments)
    assert trained == sum(len(g[0]) for g in policy.given)  # every model token in exactly one segment


def test_head_tail_keeps_the_episode_exact_and_cuts_long_outputs(tok, sandbox, tmp_path):
    env = _env(sandbox)
    env.agent_args = "--history head-tail --max-output-chars 200"
    policy = Scripted(tok, [BIG, WRITE_OK])
    r = drive(open_episode(env, _task(tmp_path), tok, 8192), policy)
    assert r.timings["agent.splits"] == 0 and r.reward.total == 1.0
    obs = tok.decode(policy.asked[1][len(policy.asked[0]) + len(policy.given[0][0]):])
    assert "characters cut" in obs and "\n1\n" in obs and "400" in obs and "\n200\n" not in obs


def test_context_budget_ends_the_episode_truncated(tok, sandbox, tmp_path):
    policy = Scripted(tok, [BIG] * 6)
    r = drive(open_episode(_env(sandbox), _task(tmp_path), tok, 700), policy)
    assert r.status == "truncated" and r.finish_reason == "budget" and r.reward.valid
    assert len(r.tokens) <= 700 and r.timings["agent.rejected"] == 1


def test_the_run_config_refuses_agents_it_cannot_serve(tmp_path):
    """An agent needs the model's chat template (not the byte tokenizer), an environment it can play, and valid
    options; a worker config's agent entry names its agent."""
    import yaml

    from megatron_rl import load_config
    from megatron_rl.config import ConfigError

    base = yaml.safe_load((REPO / "configs" / "demo_cpu.yaml").read_text())
    base["rl"].pop("reward_weights", None)  # per domain once envs.domains is set
    cases = [({"harbor": {"agent": "shell"}}, r"envs.domains.harbor.agent='shell': .*chat template"),
             ({"math": {"agent": "shell"}}, r"envs.domains.math.agent: .*cannot be played by agent 'shell'"),
             ({"harbor": {"agent": "shell", "agent_args": "--history sideways"}}, r"agent_args=.*not valid options"),
             ({"harbor": {"agent_args": "--quiet"}}, r"agent_args=.*no agent is")]
    for domains, message in cases:
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump({**base, "envs": {"domains": domains}}))
        with pytest.raises(ConfigError, match=message):
            load_config(str(path))
    from envs.mixture import DomainConfig, MixtureConfig
    from megatron_rl.dispatch import WorkerConfig

    def worker(**domain) -> WorkerConfig:
        return WorkerConfig(envs=MixtureConfig({name: DomainConfig(**d) for name, d in domain.items()}))

    worker(harbor={"agent": "shell", "agent_args": "--quiet"}).validate()
    for bad, message in (({"harbor": {"agent_args": "--quiet"}}, r"worker.envs.domains.harbor.agent_args"),
                         ({"math": {"agent": "shell"}}, r"worker.envs.domains.math: .*cannot be played")):
        with pytest.raises(ConfigError, match=message):
            worker(**bad).validate()


def test_the_loop_trains_an_episode_on_its_own_prompt_when_it_is_not_the_groups():
    """A split or re-prompted agent episode: the in-process loop's shard row is the episode's own sequence
    (its prompt, then its tokens and mask), not the group's prompt with the episode's tail."""
    from envs.base import RewardResult
    from envs.episode import EpisodeResult
    from megatron_rl.loop.rollout import Group, _fill, _sample_state, trajectory

    group_prompt = [1, 2, 3, 4]
    same = EpisodeResult([1, 2, 3, 4, 9, 9], [0.0] * 4 + [-0.5, -0.25], [0, 0, 0, 0, 1, 1], [0] * 6, 4, 1,
                         RewardResult(1.0, {"tests": 1.0}), "ok", "stop", {"agent.splits": 0.0})
    own = EpisodeResult([1, 7, 7, 8, 8, 5], [0.0] * 5 + [-0.125], [0, 0, 0, 0, 0, 1], [0] * 6, 5, 3,
                        RewardResult(0.0, {"tests": 0.0}), "ok", "stop", {"agent.splits": 1.0})
    g = Group(0, 0, type("T", (), {"domain": "harbor", "id": "t"})(), group_prompt)
    _fill(g, [_sample_state(same, group_prompt), _sample_state(own, group_prompt)])
    rows = [trajectory(g, i, f"e{i}") for i in range(2)]
    for row, r in zip(rows, (same, own)):
        assert row.tokens.tolist() == r.tokens and row.loss_mask.tolist() == r.loss_mask
        assert row.prompt_len == r.prompt_len and row.logprobs.tolist() == r.logprobs
    assert rows[1].timings["agent.splits"] == 1.0 and rows[1].timings["turns"] == 3


def test_a_completion_that_stopped_on_another_stop_token_stays_exact(tok):
    """SmolLM2 stops on <|im_start|> as well as <|im_end|>: the agent sends the reply back, the template closes
    the turn with <|im_end|>; the call continues the segment after the model's own stop token."""
    from envs.agents.recorder import Recorder

    start, end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert len(start) == len(end) == 1

    class TwoStops:
        stop_ids = [start[0], end[0]]

        def __getattr__(self, name):
            return getattr(tok, name)

    rec = Recorder(TwoStops())
    msgs = [{"role": "user", "content": "Say hi."}]
    for stop in (start, end):
        ep = f"e{stop[0]}"
        prompt, exact, text = rec.prompt(ep, msgs, None)
        ids = tok.encode("hi") + stop
        rec.record(ep, prompt, exact, text, ids, [-0.5] * len(ids), [0] * len(ids))
        nxt, exact, _ = rec.prompt(ep, msgs + [{"role": "assistant", "content": tok.decode(ids)},
                                               {"role": "user", "content": "Again."}], None)
        assert exact and nxt[:len(prompt) + len(ids)] == prompt + ids  # the model's tokens, its stop token included
        # the template's system message, the user's, the assistant's (its closing tag or the model's own), the new
        # user's: never a doubled closing tag
        assert nxt.count(end[0]) == 4


ATTACK = r"""
import json, os, socket
try:
    os.unlink('/.sandbox/gateway.sock'); print('UNLINKED')
except OSError as e:
    print('unlink refused', e.errno)
def send(raw):
    s = socket.socket(socket.AF_UNIX); s.connect('/.sandbox/gateway.sock'); s.sendall(raw)
    print('status', s.recv(64).split(b' ')[1].decode()); s.close()
send(b'POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\n\r\n{{{{{')
body = json.dumps({'messages': 'all of them'}).encode()
send(b'POST /v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n' % len(body) + body)
send(b'POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n')
open('ok', 'w').write('x')
"""


def test_model_commands_cannot_replace_or_crash_the_gateway(tok, sandbox, tmp_path):
    """The model's own command (run by the agent, inside the sandbox) removes the socket, sends malformed and
    oversized calls: refused with 4xx, the episode goes on and stays exact, the reward is the tests'."""
    import json

    cmd = "python3 - <<'EOF'\n" + ATTACK + "EOF"
    call = "<tool_call>" + json.dumps({"name": "shell", "arguments": {"command": cmd}}) + "</tool_call>"
    policy = Scripted(tok, [call])
    r = drive(open_episode(_env(sandbox), _task(tmp_path), tok, 8192), policy)
    seen = tok.decode(policy.asked[1]).split("<tool_response")[-1]  # the command's output
    assert "unlink refused" in seen and "UNLINKED" not in seen
    assert seen.count("status 400") == 2 and "status 413" in seen
    assert r.status == "ok" and r.reward.total == 1.0 and r.timings["agent.splits"] == 0
    assert r.timings["agent.rejected"] == 1  # the malformed chat (the unparsable bodies never reach the session)


def test_summary_history_asks_the_policy_and_continues_from_its_summary(tok, sandbox, tmp_path):
    """`--history summary`: over the budget, the agent sends the outputs with a summary request (still the same
    exact segment), then continues from the first message and the policy's own summary (a new segment)."""
    from envs.agents.shell_agent import SUMMARY_ASK

    class Summarizer(Scripted):
        def __call__(self, tokens, turn):
            if SUMMARY_ASK[:40] in tok.decode(tokens[-400:]):  # the agent asked for a summary
                self.texts.insert(turn, "SUMMARY-OK: printed 1 to 400 twice; next: create ok.")
            return super().__call__(tokens, turn)

    env = _env(sandbox)
    env.agent_args = "--history summary --context-budget 900 --max-output-chars 600"
    policy = Summarizer(tok, [BIG, BIG, BIG, WRITE_OK, WRITE_OK])
    r = drive(open_episode(env, _task(tmp_path), tok, 8192), policy)
    asked = [i for i, t in enumerate(policy.asked) if SUMMARY_ASK[:40] in tok.decode(t[-400:])]
    assert asked and r.reward.total == 1.0 and r.timings["agent.splits"] >= 1
    i = asked[0]
    # the summary request extends the exact sequence: the previous call's prompt + completion, then new tokens
    assert policy.asked[i][:len(policy.asked[i - 1]) + len(policy.given[i - 1][0])] == \
        policy.asked[i - 1] + policy.given[i - 1][0]
    after = tok.decode(policy.asked[i + 1])
    assert "SUMMARY-OK" in after and "\n399\n" not in after  # the summary replaced the old outputs
    assert r.tokens == policy.asked[-1] + policy.given[-1][0]
