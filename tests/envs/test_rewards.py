"""Reward functions, composition, answer extraction and the LLM-judge client against a real local HTTP server."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import envs  # noqa: F401  (registers built-ins)
from envs.base import EnvError, RewardComponent, RewardContext, RewardOutput, RewardSpec, Task, make_env
from envs.rewards import (
    REWARDS,
    JudgeClient,
    JudgeConfig,
    JudgeError,
    check_rule,
    extract_boxed,
    extract_code,
    extract_final_answer,
    parse_json_answer,
    parse_judge_score,
    parse_number,
    reward,
    run_reward,
)
from envs.tasks import load_domain


def ctx(response: str, payload: dict | None = None, **kw) -> RewardContext:
    return RewardContext(task=Task("t", "math", "q", payload or {}), response=response, **kw)


# ---------------------------------------------------------------------------------------- extraction
def test_extraction_helpers():
    assert extract_boxed("a \\boxed{\\frac{1}{2}} then \\boxed{x^{2}+1}") == "x^{2}+1"
    assert extract_boxed("\\boxed{unclosed {") is None and extract_boxed("none") is None
    assert extract_final_answer("<answer> 42 </answer>") == ("42", "answer_tag")
    assert extract_final_answer("so\n**Final Answer:** 7\n") == ("7", "answer_line")
    assert extract_final_answer("nothing") == (None, "none")
    two = "```\nprint(1)\n```\ntext\n```python\ndef f(): pass\n```\n```python\ndef g(): pass\n```"
    assert extract_code(two) == "def g(): pass"
    assert extract_code("```py\ndef h():\n    return 1") == "def h():\n    return 1"  # cut off mid-block
    assert extract_code("def k(): return 2") == "def k(): return 2" and extract_code("no code here") is None
    assert [parse_number(s) for s in ("1,234.5", "$12", "-7%", "(45)", "3e2", "2.5 USD", "abc", True, None)] == \
        [1234.5, 12.0, -7.0, -45.0, 300.0, 2.5, None, None, None]
    assert parse_json_answer('<answer>{"a": 1}</answer>') == {"a": 1}
    assert parse_json_answer('Sure: {"a": {"b": 2}} done') == {"a": {"b": 2}}
    assert parse_json_answer("[1]") is None and parse_json_answer("{" * 5000) is None


def test_format_and_rule_checks():
    fmt = REWARDS.get("format")
    assert fmt(ctx("<answer>1</answer>")).score == 1.0
    assert fmt(ctx("<answer>1</answer><answer>2</answer>")).score == 0.0
    assert fmt(ctx("x \\boxed{3}"), kind="boxed").score == 1.0
    assert fmt(ctx("```python\nx=1\n```"), kind="code_fence").score == 1.0
    assert fmt(ctx("abc"), kind="regex", pattern=r"^a.c$").score == 1.0
    with pytest.raises(ValueError, match="unknown format kind"):
        fmt(ctx(""), kind="xml")
    ans = {"value": "1,050", "unit": "USD Millions", "explanation": "sum of a and b"}
    assert check_rule(ans, {"type": "number", "field": "value", "expected": 1049, "rel_tol": 0.001})[0]
    assert not check_rule(ans, {"type": "number", "field": "value", "expected": 1040, "rel_tol": 0.001})[0]
    assert check_rule(ans, {"type": "unit", "field": "unit", "allowed": ["usd millions"]})[0]
    assert not check_rule(ans, {"type": "required", "fields": ["value", "source"]})[0]
    assert check_rule(ans, {"type": "contains", "field": "explanation", "text": "SUM"})[0]
    with pytest.raises(ValueError, match="unknown rule type"):
        check_rule(ans, {"type": "regex"})


def test_math_verify_reward():
    mv = REWARDS.get("math_verify")
    gold = {"answer": "\\frac{1}{2}"}
    assert mv(ctx("\\boxed{0.5}", gold)).score == 1.0
    assert mv(ctx("Answer: 1/2", gold)).score == 1.0
    assert mv(ctx("\\boxed{2}", gold)).score == 0.0
    out = mv(ctx("one half", gold))
    assert out.score == 0.0 and "no final answer" in out.reason and out.provenance["math_verify"] != "unknown"


@pytest.mark.slow
def test_math_verify_deadline_holds_in_a_thread_without_blocking_others():
    """A tower of powers made math-verify hold the GIL for a minute (its own timeout is off outside the main
    thread): now the worker process is killed at the deadline, the answer scores 0 with the reason, and the
    caller's other threads run meanwhile."""
    import time

    from envs.math.verify_pool import default_pool

    mv = REWARDS.get("math_verify")
    assert mv(ctx("\\boxed{2}", {"answer": "2"})).score == 1.0  # a warm worker: its start is not timed
    ticks, stop, out = [0], threading.Event(), {}

    def count():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    def score():
        t0 = time.monotonic()
        out["r"] = mv(ctx("\\boxed{9^{9^{9^{9}}}}", {"answer": "1"}), timeout_s=1.0)
        out["s"] = time.monotonic() - t0

    killed = default_pool().killed
    counter = threading.Thread(target=count, daemon=True)
    worker = threading.Thread(target=score, daemon=True)
    counter.start()
    worker.start()
    worker.join(timeout=10)
    stop.set()
    counter.join()
    assert not worker.is_alive() and out["s"] < 3.0, out
    r = out["r"]
    assert r.score == 0.0 and r.valid and "no answer within 1 s" in r.reason and r.provenance["timeout_s"] == 1.0
    assert default_pool().killed == killed + 1
    assert ticks[0] > 200  # the other thread kept running during the second it waited
    assert mv(ctx("\\boxed{0.5}", {"answer": "\\frac{1}{2}"})).score == 1.0  # a fresh worker serves next


@pytest.mark.slow
def test_math_verify_concurrent_threads_get_their_own_workers():
    import concurrent.futures

    mv = REWARDS.get("math_verify")
    answers = [(f"\\boxed{{{i}}}", str(i if i % 2 else i + 1)) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda a: mv(ctx(a[0], {"answer": a[1]})).score, answers))
    assert got == [float(i % 2) for i in range(8)]


# --------------------------------------------------------------------------------------- composition
def test_reward_spec_composition_weights_and_provenance():
    spec = RewardSpec([RewardComponent("correct", "answer_match", 1.0),
                       RewardComponent("format", "format", 0.25, {"kind": "answer_tag"})])
    r = spec.compute(ctx("<answer>12.0</answer>", {"answer": 12}))
    assert r.total == 1.25 and r.components == {"correct": 1.0, "format": 1.0} and r.valid
    assert r.weights == {"correct": 1.0, "format": 0.25}
    assert r.provenance["correct"] == {"version": "1", "fn": "answer_match"}
    r = spec.with_weights({"format": 0.0}).compute(ctx("<answer>13</answer>", {"answer": 12}))
    assert r.total == 0.0 and r.components == {"correct": 0.0, "format": 1.0}
    assert "does not match" in r.reasons["correct"]
    assert spec.components[1].weight == 0.25  # with_weights copies
    with pytest.raises(EnvError, match=r"unknown reward component\(s\) \['style'\]; known: \['correct', 'format'\]"):
        spec.with_weights({"style": 1.0})
    with pytest.raises(EnvError, match="duplicate"):
        RewardSpec([RewardComponent("a", "format"), RewardComponent("a", "format")])


def test_failing_reward_function_is_invalid_not_a_crash():
    @reward("test_explodes", version="7")
    def explodes(c: RewardContext) -> RewardOutput:
        raise KeyError("boom")

    out = run_reward(explodes, ctx("x"), {})
    assert out.score == 0.0 and out.status == "error" and not out.valid and "KeyError" in out.reason
    assert out.provenance["version"] == "7"

    @reward("test_nan")
    def nan(c: RewardContext) -> RewardOutput:
        return RewardOutput(float("nan"), "oops")

    assert run_reward(nan, ctx("x"), {}).score == 0.0
    r = RewardSpec([RewardComponent("a", "format", 1.0), RewardComponent("b", "test_explodes", 1.0)]).compute(
        ctx("<answer>1</answer>"))
    assert r.total == 1.0 and r.status == "error" and not r.valid


# ----------------------------------------------------------------------------------------- the judge
class _JudgeHandler(BaseHTTPRequestHandler):
    """A judge model stand-in over real HTTP: scores 9 when the graded response cites the line items used
    (the word 'Revenue'), else 2. Records every request; fails with 500 while `fail` > 0."""

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.requests.append((self.path, body))
        if srv.fail > 0:
            srv.fail -= 1
            self.send_error(500, "overloaded")
            return
        if self.path == "/v1/completions":
            prompts = body["prompt"]
            # answer out of order: the client must sort choices by index
            choices = [{"index": i, "text": self._verdict(p)} for i, p in reversed(list(enumerate(prompts)))]
            resp = {"model": "judge-7b-2024-06", "choices": choices}
        elif self.path == "/v1/chat/completions":
            resp = {"model": "judge-7b-2024-06",
                    "choices": [{"message": {"role": "assistant",
                                             "content": self._verdict(body["messages"][0]["content"])}}]}
        else:
            self.send_error(404)
            return
        data = json.dumps(resp).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    @staticmethod
    def _verdict(prompt: str) -> str:
        response = prompt.split("Response to grade:", 1)[1]
        return "The response cites the items.\nScore: 9" if "Revenue" in response else "Vague.\nScore: 2"

    def log_message(self, *args):
        pass


@pytest.fixture()
def judge_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _JudgeHandler)
    srv.requests, srv.fail = [], 0
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _client(srv, tmp_path, **kw) -> JudgeClient:
    cfg = JudgeConfig(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", model="judge-7b",
                      cache_dir=str(tmp_path / "cache"), timeout_s=10, retry_backoff_s=0.01, **kw)
    return cfg.build()


def test_judge_batches_requests_and_caches_on_disk(judge_server, tmp_path):
    client = _client(judge_server, tmp_path, batch_size=2)
    prompts = [f"Rubric: r\nResponse to grade:\n{t}" for t in ("Revenue up", "dunno", "Revenue and costs")]
    verdicts = client.judge(prompts)
    assert [v.score for v in verdicts] == [0.9, 0.2, 0.9] and not any(v.cached for v in verdicts)
    assert [len(b["prompt"]) for _, b in judge_server.requests] == [2, 1]  # batched: 2 requests for 3 prompts
    assert all(p == "/v1/completions" and b["model"] == "judge-7b" for p, b in judge_server.requests)
    again = client.judge(prompts)
    assert [v.score for v in again] == [0.9, 0.2, 0.9] and all(v.cached for v in again)
    fresh = _client(judge_server, tmp_path, batch_size=2)  # a new process: the cache is on disk
    assert all(v.cached for v in fresh.judge(prompts[::-1]))
    assert len(judge_server.requests) == 2
    mixed = fresh.judge([prompts[0], "Response to grade:\nRevenue new"])
    assert [v.cached for v in mixed] == [True, False] and len(judge_server.requests) == 3
    other = _client(judge_server, tmp_path, model_version="v2")  # another judge version: no stale answers
    other.judge(prompts[:1])
    assert len(judge_server.requests) == 4


def test_judge_chat_api_and_failures(judge_server, tmp_path):
    chat = _client(judge_server, tmp_path, api="chat", batch_size=4)
    v = chat.judge(["Response to grade:\nRevenue", "Response to grade:\nnope"])
    assert [x.score for x in v] == [0.9, 0.2] and {p for p, _ in judge_server.requests} == {"/v1/chat/completions"}
    judge_server.fail = 1  # one 500, then a retry succeeds
    assert chat.judge(["Response to grade:\nRevenue 2"])[0].score == 0.9
    judge_server.fail = 10
    flaky = _client(judge_server, tmp_path, max_retries=1)
    with pytest.raises(JudgeError, match="failed"):
        flaky.judge(["Response to grade:\nsomething new"])
    dead = JudgeConfig(base_url="http://127.0.0.1:9/v1", model="m", cache_dir=str(tmp_path / "c2"),
                       max_retries=0, timeout_s=2).build()
    with pytest.raises(JudgeError):
        dead.judge(["x"])
    assert JudgeConfig().build() is None
    with pytest.raises(ValueError, match="api must be"):
        JudgeConfig(base_url="http://x/v1", model="m", api="grpc").build()
    assert parse_judge_score("Score: 7\n... final Score = 10") is None and parse_judge_score("great") is None


def test_docqa_with_judge_component(judge_server, tmp_path):
    judge = _client(judge_server, tmp_path)
    env = make_env("docqa", judge=judge)
    assert [(c.name, c.weight) for c in env.spec.components] == [("rules", 0.8), ("judge", 0.2)]
    t = next(t for t in load_domain("docqa") if t.id == "docqa-northwind-rev-growth")
    env.reset(t)
    good = '<answer>{"value": 20.0, "unit": "%", "explanation": "Revenue FY2023 1488.0 / Revenue FY2022 1240.0 - 1"}'
    r = env.step(good + "</answer>")
    assert r.reward == pytest.approx(0.8 + 0.2 * 0.9) and r.reward_result.components["judge"] == 0.9
    prov = r.reward_result.provenance["judge"]
    assert prov["judge_model"] == "judge-7b" and prov["judge_reported_model"] == "judge-7b-2024-06"
    assert len(prov["rubric_sha256"]) == 16 and prov["cached"] == 0
    assert len(judge_server.requests) == 1 and len(judge_server.requests[0][1]["prompt"]) == 2  # 2 criteria, 1 batch
    env.reset(t)
    assert env.step(good + "</answer>").reward_result.provenance["judge"]["cached"] == 2
    assert len(judge_server.requests) == 1  # the same answer again: served from the cache
    env.reset(t)
    r = env.step('<answer>{"value": 20, "unit": "%", "explanation": "it grew"}</answer>')
    assert r.reward == pytest.approx(0.8 + 0.2 * 0.2)
    judge_server.fail, judge.config.max_retries = 100, 0
    env.reset(t)
    r = env.step('<answer>{"value": 21, "unit": "%", "explanation": "new"}</answer>')
    assert r.info["status"] == "error" and not r.reward_result.valid
    assert "judge endpoint" in r.reward_result.reasons["judge"]
