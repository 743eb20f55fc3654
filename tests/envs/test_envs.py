"""Environments, task suites and the domain sampler, with the real bubblewrap sandbox."""
from __future__ import annotations

import base64
import concurrent.futures
import importlib
import json

import pytest

import megatron_rl.envs  # noqa: F401  (registers the built-in environments and sandbox backends)
from megatron_rl.config import ConfigError, from_dict, undocumented_fields
from megatron_rl.envs.base import (
    ENVIRONMENTS,
    Budget,
    EnvError,
    RewardComponent,
    RewardSpec,
    SingleTurnEnvironment,
    Task,
    Workspace,
    make_env,
    parse_tool_calls,
)
from megatron_rl.envs.countdown import generate_tasks
from megatron_rl.envs.sampler import DomainSampler
from megatron_rl.envs.sandbox import SandboxConfig
from megatron_rl.envs.sandbox.base import SANDBOXES, Limits, Sandbox
from megatron_rl.envs.tasks import (
    TaskFileError,
    builtin_task_files,
    load_domain,
    load_task_file,
    load_tasks,
    write_tasks,
)
from megatron_rl.registry import RegistryError

BUILTINS = ["code", "countdown", "docqa", "math", "terminal", "tool_use"]


@pytest.fixture(scope="module")
def sandbox():
    sb = SANDBOXES.get("bwrap")()
    yield sb
    sb.close()


class Recording(Sandbox):
    """The real sandbox, recording each call (to show where code runs)."""

    name = "recording"

    def __init__(self, inner: Sandbox):
        self.inner, self.calls = inner, []

    def run(self, command, files=None, limits=None, stdin=None, collect=None):
        self.calls.append((command, dict(files or {})))
        return self.inner.run(command, files=files, limits=limits, stdin=stdin, collect=collect)


def task(domain: str, tid: str) -> Task:
    return next(t for t in load_domain(domain) if t.id == tid)


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# ------------------------------------------------------------------------------------ registry, config
def test_builtins_registered_and_unknown_name_lists_known():
    assert set(BUILTINS) <= set(ENVIRONMENTS.names())
    with pytest.raises(RegistryError) as e:
        make_env("chess")
    msg = str(e.value)
    assert "'chess'" in msg and all(n in msg for n in BUILTINS)


def test_third_party_environment_via_entry_point(tmp_path, monkeypatch):
    (tmp_path / "mrl_thirdparty_env.py").write_text(
        "from megatron_rl.envs.base import RewardComponent, RewardSpec, SingleTurnEnvironment\n\n"
        "class EchoEnv(SingleTurnEnvironment):\n    name = 'echo'\n\n"
        "    def reward_spec(self):\n        return RewardSpec([RewardComponent('match', 'answer_match')])\n")
    dist = tmp_path / "mrl_thirdparty-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mrl-thirdparty\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[megatron_rl.environments]\necho = mrl_thirdparty_env:EchoEnv\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ENVIRONMENTS, "_entry_points_loaded", False)
    try:
        env = make_env("echo")
        env.reset(Task("e1", "echo", "Say 7.", {"answer": 7}))
        assert env.step("<answer>7</answer>").reward == 1.0
    finally:
        ENVIRONMENTS._items.pop("echo", None)


def test_mixture_config_documented_validated_and_loaded_from_dict():
    from megatron_rl.envs.mixture import DomainConfig, MixtureConfig

    assert undocumented_fields(MixtureConfig) == [] and undocumented_fields(DomainConfig) == []
    cfg = from_dict(MixtureConfig, {"domains": {"countdown": {}, "math": {"weight": 0.5, "max_turns": 3,
                                                                          "reward_weights": {"format": 0.0}}}})
    assert cfg.domains["math"].weight == 0.5 and cfg.budget("math", 512).max_turns == 3
    assert cfg.budget("countdown", 512).max_tokens == 512 and cfg.budget("countdown", 256).max_tokens == 256
    with pytest.raises(ConfigError, match="envs.domains.chess: not a registered environment; known:"):
        MixtureConfig({"chess": DomainConfig()}).validate()
    with pytest.raises(ConfigError, match=r"envs.domains.math.reward_weights: unknown reward component"):
        MixtureConfig({"math": DomainConfig(reward_weights={"style": 1.0})}).validate()
    with pytest.raises(ConfigError, match="no domain has a weight > 0"):
        MixtureConfig({"math": DomainConfig(weight=0.0)}).validate()
    easy = MixtureConfig({"math": DomainConfig(tier="easy")}).tasks("heldout")["math"]
    assert easy and {t.payload["tier"] for t in easy} == {"easy"}
    with pytest.raises(ConfigError, match=r"envs.domains.arithmetic.tier='easy': no train task"):
        MixtureConfig({"arithmetic": DomainConfig(tier="easy")}).validate()
    with pytest.raises(ConfigError, match="wieght"):
        from_dict(MixtureConfig, {"domains": {"math": {"wieght": 2}}})


def test_mixture_config_builds_environments_for_concurrent_episodes_on_a_sandbox_pool():
    from megatron_rl.envs.mixture import DomainConfig, MixtureConfig

    cfg = MixtureConfig({"countdown": DomainConfig(max_turns=2, reward_weights={"format": 0.0}),
                         "math": DomainConfig(weight=0.0)})
    tasks = cfg.tasks("train")
    sampler = DomainSampler(tasks, {d: c.weight for d, c in cfg.domains.items()}, seed=0)
    sandbox = SandboxConfig(workers=2).build()
    try:
        drawn = sampler.sample(8)
        assert {t.domain for t in drawn} == {"countdown"} and all(t.split == "train" for t in drawn)
        assert cfg.build_env("countdown", 512, sandbox=sandbox).budget.max_turns == 2

        def episode(i: int):
            env = cfg.build_env("countdown", 512, sandbox=sandbox)  # one env per concurrent episode, one pool
            env.reset(drawn[i])
            answer = drawn[i].payload["solution"] if i % 2 == 0 else "1 + 1"
            return env.step(f"<answer>{answer}</answer>")

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            results = list(ex.map(episode, range(8)))
        assert [r.reward for r in results] == [1.0, 0.0] * 4  # format weighs 0 here
        assert all(r.reward_result.components["format"] == 1.0 for r in results)
    finally:
        sandbox.close()


# ------------------------------------------------------------------------------------------ task files
def test_shipped_suites_load_with_both_splits():
    counts = {}
    for d in BUILTINS:
        train, held = load_domain(d, split="train"), load_domain(d, split="heldout")
        assert train and held, d
        assert all(t.domain == d for t in train + held)
        counts[d] = len(train) + len(held)
    assert min(counts.values()) >= 14 and counts["countdown"] >= 256


@pytest.mark.parametrize("domain", ["code", pytest.param("math", marks=pytest.mark.slow), "tool_use", "terminal",
                                    "docqa"])
def test_shipped_suites_match_their_builders(domain, tmp_path):
    """The shipped JSONL is exactly what envs/<domain>/build_tasks.py makes (math's builder also recomputes
    every answer with sympy and checks it with math-verify; docqa's computes answers from its tables)."""
    builder = importlib.import_module(f"envs.{domain}.build_tasks")
    built = builder.build()
    for split in ("train", "heldout"):
        write_tasks(tmp_path / f"{split}.jsonl", [t for t in built if t.split == split])
        shipped = next(p for p in builtin_task_files(domain) if p.name == f"{split}.jsonl")
        assert (tmp_path / f"{split}.jsonl").read_bytes() == shipped.read_bytes(), (domain, split)


def test_malformed_task_files_name_file_and_line(tmp_path):
    good = json.dumps({"id": "a", "prompt": "p"})
    cases = {
        "badjson.jsonl": (f"{good}\n\n{{not json\n", ":3: invalid JSON"),
        "noprompt.jsonl": (f'{good}\n{{"id": "b"}}\n', ":2: missing required field 'prompt'"),
        "typo.jsonl": ('{"id": "a", "prompt": "p", "payloda": {}}\n', ":1: unknown field(s) ['payloda']"),
        "notobj.jsonl": ("[1, 2]\n", ":1: a task must be an object"),
        "split.jsonl": ('{"id": "a", "prompt": "p", "split": "dev"}\n', ":1: split 'dev'"),
        "domain.jsonl": ('{"id": "a", "prompt": "p", "domain": "code"}\n', "differs from the suite's domain 'math'"),
        "payload.jsonl": ('{"id": "a", "prompt": "p", "payload": [1]}\n', ":1: 'payload' must be an object"),
        "bad.yaml": ("- id: a\n  prompt: p\n- id: b\n  prompt: x: y\n", ":4: invalid YAML"),
        "noid.yaml": ("- id: a\n  prompt: p\n- prompt: q\n", ":3: missing required field 'id'"),
        "tasks.txt": ("x", "unknown task file type"),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(TaskFileError) as e:
            load_task_file(path, domain="math")
        assert str(path) in str(e.value) and expected in str(e.value), (name, str(e.value))
    with pytest.raises(TaskFileError, match="task file not found"):
        load_task_file(tmp_path / "missing.jsonl", "math")
    (tmp_path / "one.jsonl").write_text(good + "\n")
    (tmp_path / "two.jsonl").write_text("\n" + good + "\n")
    with pytest.raises(TaskFileError, match=r"two.jsonl:2: duplicate task id 'a' \(first at .*one.jsonl:1\)"):
        load_tasks([tmp_path / "one.jsonl", tmp_path / "two.jsonl"], domain="math")


def test_yaml_tasks_and_split_from_file_name(tmp_path):
    (tmp_path / "heldout.yaml").write_text("- id: 1\n  prompt: What is 1+1?\n  payload: {answer: '2'}\n")
    (tmp_path / "train.jsonl").write_text(json.dumps({"id": "x", "prompt": "q", "payload": {"answer": "3"}}) + "\n")
    tasks = load_tasks([tmp_path / "heldout.yaml", tmp_path / "train.jsonl"], domain="math")
    assert [(t.id, t.split, t.payload["answer"]) for t in tasks] == [("1", "heldout", "2"), ("x", "train", "3")]
    assert tasks[0].source.endswith("heldout.yaml:1")
    assert [t.id for t in load_tasks([tmp_path / "heldout.yaml", tmp_path / "train.jsonl"], "math", "train")] == ["x"]


# ------------------------------------------------------------------------------------------ countdown
def test_countdown_generator_is_deterministic_and_matches_shipped_file(tmp_path):
    a, b = generate_tasks(20, seed=3), generate_tasks(20, seed=3)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    assert [t.to_dict() for t in generate_tasks(20, seed=4)] != [t.to_dict() for t in a]
    write_tasks(tmp_path / "train.jsonl", generate_tasks(256, 0, "train"))
    shipped = [p for p in builtin_task_files("countdown") if p.name == "train.jsonl"][0]
    assert (tmp_path / "train.jsonl").read_bytes() == shipped.read_bytes()
    for t in a:  # every generated task is solvable with its numbers (checked as text here, value in sandbox below)
        assert len(t.payload["numbers"]) in (3, 4) and 1 <= t.payload["target"] <= 1000


def test_countdown_rewards_and_evaluation_in_sandbox(sandbox):
    rec = Recording(sandbox)
    env = make_env("countdown", sandbox=rec)
    t = Task("cd", "countdown", "p", {"numbers": [3, 5, 25], "target": 60})

    def score(text):
        env.reset(t)
        r = env.step(text)
        return r.reward, r.reward_result.reasons["correct"], r.info["status"]

    assert score("<think>25-5=20, 20*3=60</think>\n<answer>(25 - 5) * 3</answer>")[0] == pytest.approx(1.1)
    assert rec.calls and rec.calls[-1][1]["expr.txt"] == "(25 - 5) * 3"  # the value was computed in the sandbox
    assert score("<answer>(25 - 5) * 3 = 60</answer>")[0] == pytest.approx(1.1)
    assert score("(25 - 5) * 3")[0] == 0.0  # no answer tag: no format, no correctness
    total, reason, _ = score("<answer>25 + 5 * 3</answer>")
    assert total == pytest.approx(0.1) and "= 40, target 60" in reason
    total, reason, _ = score("<answer>(25 - 5) * 3 * 3</answer>")
    assert total == pytest.approx(0.1) and "not available" in reason
    n = len(rec.calls)
    total, reason, status = score("<answer>__import__('os').system('id')</answer>")
    assert total == pytest.approx(0.1) and "may only contain" in reason and status == "ok"
    assert len(rec.calls) == n  # rejected as text, never run anywhere
    assert score("<answer>(25 - 5) * (3</answer>")[1].startswith("could not evaluate")
    assert score("<answer>" + "(" * 150 + "3" + ")" * 150 + "</answer>")[0] == pytest.approx(0.1)
    t = Task("cd2", "countdown", "p", {"numbers": [5, 5, 2], "target": 10})
    total, reason, _ = score("<answer>2 / (5 - 5)</answer>")
    assert total == pytest.approx(0.1) and "division by zero" in reason


class Stalling(Recording):
    """The real sandbox, but its first `stalls` runs hit the wall-clock limit, as on a loaded host."""

    def __init__(self, inner: Sandbox, stalls: int):
        super().__init__(inner)
        self.stalls = stalls

    def run(self, command, files=None, limits=None, stdin=None, collect=None):
        result = super().run(command, files=files, limits=limits, stdin=stdin, collect=collect)
        if len(self.calls) <= self.stalls:
            result.violations.append("wall")
        return result


@pytest.mark.parametrize("stalls", [1, 2, 3])
def test_countdown_runs_a_checked_expression_again_when_the_machine_stalls_it(sandbox, stalls):
    """A checked expression evaluates in milliseconds, so a limit it hits is the host's load: it is run again, and
    the reward is the expression's (never a 0 that depends on the load); after EVAL_RUNS hits the sample is a
    sandbox_error (dropped and counted by the loop), never a valid 0."""
    from megatron_rl.envs.countdown.env import EVAL_RUNS

    rec = Stalling(sandbox, stalls)
    env = make_env("countdown", sandbox=rec)
    env.reset(Task("cd", "countdown", "p", {"numbers": [3, 5, 25], "target": 60}))
    r = env.step("<answer>(25 - 5) * 3</answer>").reward_result
    if stalls < EVAL_RUNS:
        assert r.valid and r.components["correct"] == 1.0 and len(rec.calls) == stalls + 1, r
    else:
        assert r.status == "sandbox_error" and len(rec.calls) == EVAL_RUNS, r
        assert f"sandbox limit hit: wall in {EVAL_RUNS} runs" in r.reasons["correct"]


def test_countdown_owns_its_compact_prompt_and_reference_answer_format(sandbox):
    """The warm-up's reference responses and the byte-level prompt are countdown's own format, reached through
    the environment's interface (generic code no longer writes `<answer>` or reads countdown's payload)."""
    from megatron_rl.prompts import compact_prompt

    env = make_env("countdown", sandbox=sandbox)
    t = Task("cd", "countdown", "p", {"numbers": [3, 5, 25], "target": 60, "solution": "(25 - 5) * 3"})
    assert compact_prompt(t) == env.compact_prompt(t) == "3 5 25 -> 60\n"
    scores = []
    for corrupt in (False, True):
        env.reset(t)
        scores.append(env.step(env.reference_response(t, corrupt)).reward_result.components["correct"])
    assert scores == [1.0, 0.0]
    assert env.reference_response(Task("x", "countdown", "p", {"numbers": [1], "target": 1})) is None
    math = make_env("math")
    m = Task("m", "math", "What is 2 + 2?", {"answer": "4", "solution": "4"})
    assert math.reference_response(m) is None and compact_prompt(m) == "What is 2 + 2?\n"


# ------------------------------------------------------------------------------------------------ code
def test_code_correct_partial_and_broken_solutions(sandbox):
    env = make_env("code", sandbox=sandbox)
    env.spec.components[0].params["per_test_s"] = 0.5  # the hanging solution below costs one such timeout
    t = task("code", "code-is_prime")

    def run(text):
        env.reset(t)
        r = env.step(text)
        return r.reward, r.reward_result.reasons["tests"]

    assert run("Here:\n```python\n" + t.payload["canonical_solution"] + "```\n")[0] == 1.0
    # wrong for 2 only: a fraction of the tests
    partial = "```python\ndef is_prime(n):\n    return n > 2 and all(n % i for i in range(2, int(n**0.5) + 1))\n```"
    assert run(partial)[0] == pytest.approx(5 / 6)
    assert run("I cannot do this.") == (0.0, "no code found (put it in a ```python block)")
    reward, reason = run("```python\ndef is_prime(n):\n    while True: pass\n```")
    assert reward == 0.0 and "timed out" in reason
    reward, reason = run("```python\nraise SystemExit(0)\n```")
    assert reward == 0.0 and "failed to load" in reason
    reward, reason = run("```python\nimport os\nos._exit(0)\n```")
    assert reward == 0.0 and "no result" in reason
    # forging the result line does not work: it needs the per-run nonce
    forged = ("```python\nimport sys\nsys.__stdout__.write('\\n' + 'f' * 32 + '[[true, \"\"]]' * 6 + '\\n')\n"
              "def is_prime(n): return False\n```")
    assert run(forged)[0] == pytest.approx(3 / 6)
    # non-UTF-8 output and bytes in the response never crash
    env.reset(t)
    r = env.step(b"```python\nimport sys\nsys.stdout.buffer.write(b'\\xff\\xfe')\ndef is_prime(n): return 1\n```\xff")
    assert r.done and r.reward_result.valid and 0 < r.reward < 1


@pytest.mark.slow
def test_code_suite_canonical_solutions_pass(sandbox):
    """The hand-written tasks; the generated ones are checked in tests/envs/test_suites.py (a sample; all when slow)."""
    env = make_env("code", sandbox=sandbox)
    for t in (t for t in load_domain("code") if "family" not in t.payload):
        env.reset(t)
        r = env.step("```python\n" + t.payload["canonical_solution"] + "```")
        assert r.reward == 1.0, (t.id, r.reward_result.reasons)


# ------------------------------------------------------------------------------------------------ math
@pytest.mark.slow
def test_math_answers_and_format():
    env = make_env("math")  # needs no sandbox
    t = task("math", "math-frac-1")  # 3/4 + 5/6 = 19/12

    def run(text):
        env.reset(t)
        r = env.step(text)
        return round(r.reward, 6), r.reward_result.components

    assert run("3/4 + 5/6 = 9/12 + 10/12, so \\boxed{\\frac{19}{12}}") == (1.1, {"correct": 1.0, "format": 1.0})
    assert run("Working...\nAnswer: 19/12")[0] == 1.1
    assert run("\\boxed{1.5833333333}")[0] == 1.1
    assert run("\\boxed{\\frac{8}{7}}") == (0.1, {"correct": 0.0, "format": 1.0})
    assert run("The answer is 19/12.") == (0.0, {"correct": 0.0, "format": 0.0})
    assert run("\\boxed{" + "(" * 300 + "}")[0] == 0.1
    assert run("\\boxed{\\frac{19}{12}")[0] == 0.0  # unbalanced braces: no answer
    t2 = task("math", "math-set-2")
    env.reset(t2)
    assert env.step("x = \\pm 3 so \\boxed{\\{3, -3\\}}").reward == pytest.approx(1.1)


# -------------------------------------------------------------------------------------------- tool use
def test_tool_use_episode_end_to_end(sandbox):
    env = make_env("tool_use", sandbox=sandbox)
    t = task("tool_use", "tool-sales-0-units")
    obs = env.reset(t)
    assert "sales.csv" in obs.text and {s["function"]["name"] for s in obs.tools} >= {"calculator", "run_python"}
    r = env.step("Let me look. " + call("read_file", path="sales.csv"))
    assert not r.done and r.observation.role == "tool" and "id,region,product,units,price" in r.observation.text
    code = ("import csv\nrows = [r for r in csv.DictReader(open('sales.csv')) if r['product'] == 'gadget']\n"
            "open('gadget_units.txt', 'w').write(str(sum(int(r['units']) for r in rows)))\nprint(len(rows))")
    r = env.step(call("run_python", code=code))
    assert "exit code: 0" in r.observation.text
    r = env.step(call("list_files") + call("read_file", path="gadget_units.txt")
                 + call("calculator", expression="2**3"))
    text = r.observation.text
    assert "gadget_units.txt" in text and f"\n{t.payload['answer']}\n" in text and "\n8\n" in text
    r = env.step(f"The total is <answer>{t.payload['answer']}</answer>")
    assert r.done and r.reward == pytest.approx(1.1) and r.info["status"] == "ok" and r.info["turn"] == 4
    env.reset(t)
    r = env.step("<answer>12345</answer>")
    assert r.done and r.reward == pytest.approx(0.1)


def test_tool_use_bad_calls_become_error_observations(sandbox):
    env = make_env("tool_use", sandbox=sandbox, budget=Budget(max_turns=3))
    env.reset(task("tool_use", "tool-calc-mod-0"))
    bad = ("<tool_call>{not json}</tool_call>"
           '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
           '<tool_call>{"name": "calculator", "arguments": {"expression": 7}}</tool_call>'
           '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>')
    r = env.step(bad)
    errs = r.observation.text.split("\n")
    assert not r.done and len(errs) == 4 and all(e.startswith("<tool_error>") for e in errs)
    assert "not valid JSON" in errs[0] and "unknown tool 'rm_rf'; available tools: calculator" in errs[1]
    assert "expression: 7 is not of type 'string'" in errs[2]
    assert "'expression' is a required property" in errs[3] and "('expr' was unexpected)" in errs[3]
    assert r.observation.hidden["tool_errors"] == 4
    r = env.step('<tool_call>{"name": "calculator", "arguments": "[1]"}</tool_call>' +
                 call("calculator", expression="9**9**9") + call("read_file", path="../../etc/passwd") +
                 call("write_file", path="/abs", content="x") + '<tool_call>{"name": "list_files"')
    text = r.observation.text
    assert "'arguments' must be a JSON object" in text and "result too large" in text
    assert "error: no such file '../../etc/passwd'" in text and "invalid path '/abs'" in text
    assert "only 4 tool calls run per turn" in text
    r = env.step(call("calculator", expression="1/0"))
    assert r.done and r.info["status"] == "truncated" and r.reward == 0.0  # turn budget spent, no answer
    # per-tool status and latency of the episode (what rollout workers put in the shards' timings)
    s = env.tool_summary()
    assert s["tool.rm_rf.calls"] == 1 and s["tool.rm_rf.errors"] == 1
    assert s["tool._unparsed_.calls"] == 2 and s["tool._unparsed_.errors"] == 2  # not JSON, arguments not an object
    # 4 calls: 2 with bad arguments (errors); "too large" and 1/0 are answers the tool itself returned
    assert s["tool.calculator.calls"] == 4 and s["tool.calculator.errors"] == 2
    assert s["tool.read_file.calls"] == 1 and all(s[k] >= 0 for k in s if k.endswith(".latency_s"))
    env.reset(task("tool_use", "tool-calc-mod-0"))
    assert env.tool_summary() == {}
    env.step(call("calculator", expression="2+3"))
    assert env.tool_summary()["tool.calculator.calls"] == 1 and env.tool_summary()["tool.calculator.errors"] == 0


def test_parse_tool_calls_keeps_order_and_never_raises():
    calls = parse_tool_calls('<tool_call>{"name":"a","arguments":"{\\"x\\": 1}"}</tool_call> <tool_call>[</tool_call>'
                             + "<tool_call>" + "[" * 100000 + "</tool_call>")
    assert calls[0].name == "a" and calls[0].arguments == {"x": 1} and calls[1].error and calls[2].error


# -------------------------------------------------------------------------------------------- terminal
def test_terminal_fixes_failing_test_over_three_turns(sandbox):
    env = make_env("terminal", sandbox=sandbox)
    t = task("terminal", "terminal-fix-median")
    obs = env.reset(t)
    assert "stats.py" in obs.text and "test_hidden" not in json.dumps(obs.tools)
    r = env.step(call("shell", command="python3 -m unittest 2>&1 | tail -3"))
    assert "FAILED (failures=1)" in r.observation.text
    fix = ("cat > stats.py <<'EOF'\ndef median(xs):\n    s = sorted(xs)\n    n = len(s)\n"
           "    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\nEOF\n"
           "python3 -m unittest 2>&1 | tail -1")
    r = env.step(call("shell", command=fix))
    assert r.observation.text.endswith("OK\n[exit code 0]\n</tool_response>")
    r = env.step("Fixed the even-length case.")
    assert r.done and r.reward == 1.0 and r.info["turn"] == 3, r.reward_result.reasons
    # the workspace was carried across turns; giving up leaves the test failing
    env.reset(t)
    assert env.step("I give up.").reward == 0.0


@pytest.mark.slow
def test_terminal_workspace_carries_files_and_survives_odd_output(sandbox):
    env = make_env("terminal", sandbox=sandbox, budget=Budget(max_turns=6))
    env.limits = Limits(wall_s=1.5, cpu_s=1.5)
    env.reset(task("terminal", "terminal-dep-clamp"))
    r = env.step(call("shell", command="mkdir -p d && echo one > d/a.txt && rm main.py && printf '\\377\\376ok'"))
    assert "\ufffd" in r.observation.text and "ok" in r.observation.text
    assert set(env.workspace.files) == {"d/a.txt"}
    r = env.step(call("shell", command="cat d/a.txt; ln -s /etc/passwd link; sleep 30"))
    assert "wall" in r.observation.text and "could not be collected" in r.observation.text
    assert set(env.workspace.files) == {"d/a.txt"}  # a killed command changes nothing
    r = env.step(call("shell", command="ln -s /etc/passwd link; echo $HOME; ls"))
    assert "link" in r.observation.text and "link" not in env.workspace.files  # symlinks are not carried
    r = env.step(call("shell", command="head -c 3000000 /dev/zero > big.bin"))
    assert "over its size limit" in r.observation.text or "could not be collected" in r.observation.text
    assert "big.bin" not in env.workspace.files
    r = env.step("done")
    assert r.done and r.reward == 0.0 and r.reward_result.valid


def test_workspace_rejects_malicious_manifest():
    ws = Workspace(files={"a": b"1"})
    evil = {"../escape": "eA==", "/abs": "eA==", ".mrl_x": "eA==", "ok/b.txt": base64.b64encode(b"hi").decode()}
    assert ws._take_back(json.dumps(evil).encode(), set()) is None and ws.files == {"ok/b.txt": b"hi"}
    assert "corrupt" in ws._take_back(b"\xff not json", set()) and ws.files == {"ok/b.txt": b"hi"}
    assert "corrupt" in ws._take_back(b'{"x": "not base64!"}', set())
    assert "corrupt" in ws._take_back(b"[1, 2]", set())
    assert ws.write("../x", "y") and ws.write("a/../../x", "y") and ws.write("", "y")
    assert Workspace(max_bytes=4).write("f", "12345") is not None


@pytest.mark.slow
def test_terminal_suite_is_solvable_and_not_trivially_passed(sandbox):
    env = make_env("terminal", sandbox=sandbox)
    for t in load_domain("terminal"):
        env.reset(t)
        assert env.step("nothing").reward == 0.0, t.id
        env.reset(t)
        for c in t.payload["reference_commands"]:
            env.step(call("shell", command=c))
        r = env.step("done")
        assert r.reward == 1.0, (t.id, r.reward_result.reasons)


# ----------------------------------------------------------------------------------------------- docqa
def test_docqa_rule_checks_without_judge():
    env = make_env("docqa")
    t = task("docqa", "docqa-northwind-rev-growth")
    assert "| Revenue | 1,240.0 | 1,488.0 |" in env.reset(t).text
    assert [c.name for c in env.spec.components] == ["rules"]

    def run(text):
        env.reset(t)
        return env.step(text)

    r = run('<answer>{"value": 20.0, "unit": "%", "explanation": "1488.0 / 1240.0 - 1 = 20%"}</answer>')
    assert r.reward == 1.0
    r = run('```json\n{"value": "20.04%", "unit": "percent", "explanation": "growth"}\n```')
    assert r.reward == 1.0
    r = run('<answer>{"value": 248, "unit": "USD millions", "explanation": "1488 - 1240"}</answer>')
    assert r.reward == pytest.approx(1 / 3) and "vs 20.0" in r.reward_result.reasons["rules"]
    assert run("Revenue grew by 20%.").reward == 0.0
    assert run('<answer>{"value": [1], "unit": null}</answer>').reward == 0.0


# ------------------------------------------------------------------------------------ episode contract
class _Broken(SingleTurnEnvironment):
    name = "broken"

    def reward_spec(self):
        return RewardSpec([RewardComponent("x", "format", 1.0)])

    def _act(self, action):
        raise RuntimeError("bug")


def test_episode_contract_budgets_and_errors(sandbox):
    env = make_env("tool_use", sandbox=sandbox, budget=Budget(max_turns=10, max_tokens=60),
                   token_counter=lambda s: len(s.split()))
    t = task("tool_use", "tool-calc-mod-0")
    with pytest.raises(EnvError, match="before reset"):
        env.step("x")
    env.reset(t)
    r = env.step(call("calculator", expression="2**64 % 1000007"), action_tokens=50)
    assert r.done and r.info["status"] == "truncated" and r.info["tokens"] >= 60
    with pytest.raises(EnvError, match="after done"):
        env.step("x")
    with pytest.raises(EnvError, match="is for domain 'math'"):
        env.reset(task("math", "math-arith-1"))
    broken = _Broken()
    broken.reset(Task("b", "broken", "p"))
    r = broken.step("anything")
    assert r.done and r.info["status"] == "error" and "bug" in r.info["error"] and not r.reward_result.valid


def test_sandbox_failure_marks_episode_not_model(sandbox):
    broken = SANDBOXES.get("bwrap")(prespawn=False)
    broken.close()  # a closed backend raises on run(): an infrastructure failure, not the model's
    env = make_env("terminal", sandbox=broken)
    t = task("terminal", "terminal-fix-median")
    env.reset(t)
    r = env.step(call("shell", command="ls"))
    assert "sandbox is unavailable (not your fault)" in r.observation.text
    r = env.step("done")
    assert r.info["status"] == "sandbox_error" and not r.reward_result.valid
    code = make_env("code", sandbox=broken)
    code.reset(task("code", "code-gcd"))
    r = code.step("```python\ndef gcd(a, b): return 1\n```")
    assert r.info["status"] == "sandbox_error" and "sandbox setup failed" in r.reward_result.reasons["tests"]


def test_observation_truncation_keeps_head_and_tail(sandbox):
    env = make_env("terminal", sandbox=sandbox, budget=Budget(max_observation_chars=500))
    env.reset(task("terminal", "terminal-dep-clamp"))
    r = env.step(call("shell", command="seq 1 2000"))
    assert len(r.observation.text) < 600 and "characters cut" in r.observation.text
    assert r.observation.text.endswith("2000\n[exit code 0]\n</tool_response>")


# --------------------------------------------------------------------------------------------- sampler
def _tasks(domain: str, n: int) -> list[Task]:
    return [Task(f"{domain}-{i}", domain, "p") for i in range(n)]


def test_sampler_deterministic_weighted_and_covers_epochs():
    tasks = {"a": _tasks("a", 5), "b": _tasks("b", 3), "c": _tasks("c", 4)}
    s1, s2 = DomainSampler(tasks, {"a": 3, "b": 1, "c": 0}, seed=7), DomainSampler(tasks, {"a": 3, "b": 1, "c": 0}, 7)
    seq = [t.id for t in s1.sample(4000)]
    assert seq == [t.id for t in s2.sample(4000)]
    assert seq != [t.id for t in DomainSampler(tasks, {"a": 3, "b": 1, "c": 0}, seed=8).sample(4000)]
    n_a = sum(i.startswith("a") for i in seq)
    assert not any(i.startswith("c") for i in seq) and 2850 < n_a < 3150
    a_ids = [i for i in seq if i.startswith("a")]
    for e in range(3):  # each epoch of a domain is a permutation of its tasks, differently shuffled
        assert sorted(a_ids[5 * e : 5 * e + 5]) == [f"a-{i}" for i in range(5)]
    assert a_ids[:5] != a_ids[5:10] or a_ids[5:10] != a_ids[10:15]


def test_sampler_resume_continues_exactly():
    tasks = {"a": _tasks("a", 5), "b": _tasks("b", 3)}
    ref = DomainSampler(tasks, {"a": 1, "b": 2}, seed=1)
    expected = [t.id for t in ref.sample(90)]
    s = DomainSampler(tasks, {"a": 1, "b": 2}, seed=1)
    head = [t.id for t in s.sample(37)]
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON round trip (driver checkpoint)
    assert state["positions"]["a"]["index"] + state["positions"]["b"]["index"] > 0
    resumed = DomainSampler(tasks, {"a": 1, "b": 2}, seed=999)
    resumed.load_state_dict(state)
    assert head + [t.id for t in resumed.sample(53)] == expected
    changed = DomainSampler({"a": _tasks("a", 6), "b": tasks["b"]}, {"a": 1, "b": 2}, seed=1)
    with pytest.raises(EnvError, match="task suite of domain 'a' changed"):
        changed.load_state_dict(state)
    changed.load_state_dict(state, strict=False)
    b = state["positions"]["b"]
    assert changed.positions == {"a": [0, 0], "b": [b["epoch"], b["index"]]}


def test_sampler_bad_weights_and_metrics():
    tasks = {"a": _tasks("a", 2), "b": []}
    with pytest.raises(EnvError, match=r"unknown domain\(s\) \['z'\]"):
        DomainSampler(tasks, {"z": 1})
    with pytest.raises(EnvError, match="no tasks"):
        DomainSampler(tasks, {"a": 1, "b": 1})
    with pytest.raises(EnvError, match="finite and >= 0"):
        DomainSampler(tasks, {"a": -1})
    s = DomainSampler(tasks, {"a": 1, "b": 0})
    from megatron_rl.envs.base import RewardResult

    s.record(tasks["a"][0], RewardResult(1.1, {"correct": 1.0, "format": 1.0}))
    bad = RewardResult(0.1, {"correct": 0.0, "format": 1.0}, status="sandbox_error")
    s.record(tasks["a"][1], bad, status=bad.status, turns=3)
    m = s.metrics.summary(reset=True)
    # the sandbox_error episode is counted, never scored: the reward statistics are the valid episode's
    assert m["a/count"] == 2 and m["a/reward_mean"] == pytest.approx(1.1) and m["a/reward_std"] == pytest.approx(0.0)
    assert m["a/correct_mean"] == 1.0 and m["a/status_sandbox_error"] == 0.5 and m["a/infra_error_frac"] == 0.5
    assert m["a/turns_mean"] == 2.0
    s.record(tasks["a"][0], 0.0, status="timeout")  # a float reward with a failed status counts too
    assert s.metrics.summary(reset=True)["a/infra_error_frac"] == 1.0
    assert s.metrics.summary() == {}

