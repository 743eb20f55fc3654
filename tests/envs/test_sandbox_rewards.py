"""Reward forging, tried as an attacker would: through the environments' public path
(`make_env(...).step(...)`) with the real bubblewrap sandbox. Every wrong answer here must score 0."""
from __future__ import annotations

import json
import sys

import pytest

import megatron_rl.envs  # noqa: F401  (registers the built-ins)
from megatron_rl.envs.base import Budget, make_env
from megatron_rl.envs.sandbox.base import Sandbox
from megatron_rl.envs.sandbox.bwrap import BwrapSandbox
from megatron_rl.envs.tasks import load_domain


@pytest.fixture(scope="module")
def sandbox():
    with BwrapSandbox() as sb:
        yield sb


def task(domain: str, tid: str):
    return next(t for t in load_domain(domain) if t.id == tid)


def code_reward(sandbox, tid: str, solution: str) -> tuple[float, str]:
    env = make_env("code", sandbox=sandbox)
    env.reset(task("code", tid))
    r = env.step("```python\n" + solution + "\n```")
    assert r.reward_result.valid, r.reward_result.reasons
    return r.reward, r.reward_result.reasons["tests"]


# ------------------------------------------------------------------------------------------------ code
def test_code_forged_result_line_with_the_harness_nonce_scores_zero(sandbox):
    """The old harness ran the solution in its own process: the nonce was a global of __main__."""
    forge = ("import json, os, sys\n"
             "m = sys.modules['__main__']\n"
             "nonce = next((v for v in vars(m).values() if isinstance(v, str) and len(v) == 32), '')\n"
             "sys.__stdout__.write('\\n' + nonce + json.dumps([[True, '']] * 6) + '\\n')\n"
             "sys.__stdout__.flush()\n"
             "os._exit(0)\n"
             "def is_prime(n):\n    return False\n")
    assert code_reward(sandbox, "code-is_prime", forge)[0] == 0.0


def test_code_patched_json_and_print_score_zero(sandbox):
    forge = ("import builtins, json\n"
             "_dumps = json.dumps\n"
             "json.dumps = lambda obj, *a, **k: _dumps([[True, ''] for _ in obj], *a, **k)\n"
             "_print = builtins.print\n"
             "builtins.print = lambda *a, **k: _print(*[str(x).replace('false', 'true') for x in a], **k)\n"
             "def gcd(a, b):\n    return -1\n")
    assert code_reward(sandbox, "code-gcd", forge)[0] == 0.0


def test_code_reading_the_tests_and_hard_coding_answers_scores_zero(sandbox):
    """The candidate's sandbox holds no test file: answers read from one cannot exist."""
    forge = ("import glob, os, re\n"
             "ANSWERS = {}\n"
             "for p in glob.glob('**', recursive=True) + glob.glob('/tmp/**', recursive=True):\n"
             "    try:\n"
             "        text = open(p).read()\n"
             "    except (OSError, ValueError):\n"
             "        continue\n"
             "    for a, b, want in re.findall(r'gcd\\((\\d+), (\\d+)\\) == (\\d+)', text):\n"
             "        ANSWERS[int(a), int(b)] = int(want)\n"
             "def gcd(a, b):\n    return ANSWERS[a, b]\n")
    reward, reason = code_reward(sandbox, "code-gcd", forge)
    assert reward == 0.0 and "KeyError" in reason


def test_code_always_equal_object_scores_zero(sandbox):
    forge = ("class Yes(int):\n"
             "    def __eq__(self, other):\n        return True\n"
             "    __hash__ = int.__hash__\n"
             "def gcd(a, b):\n    return Yes(0)\n")
    reward, reason = code_reward(sandbox, "code-gcd", forge)
    assert reward == 0.0 and "cannot be compared" in reason


def test_code_exceptions_mutation_and_partial_credit_still_judged_right(sandbox):
    # raising the asked-for ValueError passes the try/except tests; a subclass counts as a ValueError
    ok = ("class Bad(ValueError):\n    pass\n"
          "def parse_duration(s):\n"
          "    import re\n"
          "    m = re.fullmatch(r'(?:(\\d+)h)?(?:(\\d+)m)?(?:(\\d+)s)?', s)\n"
          "    if not s or not m:\n        raise Bad(s)\n"
          "    h, mi, se = (int(x or 0) for x in m.groups())\n"
          "    return 3600 * h + 60 * mi + se\n")
    assert code_reward(sandbox, "code-parse_duration", ok)[0] == 1.0
    # rotating in place changes the caller's list: the mutation test catches it through the verifier
    inplace = ("def rotate_list(xs, k):\n    if xs:\n        k %= len(xs)\n        xs[:] = xs[-k:] + xs[:-k]\n"
               "    return xs\n")
    reward, reason = code_reward(sandbox, "code-rotate_list", inplace)
    assert reward == pytest.approx(4 / 5) and "AssertionError" in reason


class _CountingSandbox:
    """The sandbox, counting its runs (the candidate's; the verifier's zygote calls do not pass through run)."""

    def __init__(self, sandbox):
        self._sandbox, self.runs = sandbox, 0

    def run(self, *args, **kwargs):
        self.runs += 1
        return self._sandbox.run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sandbox, name)


def test_code_results_file_is_never_parsed_in_the_worker(sandbox, monkeypatch):
    """A results file of nested empty lists just over the claim bound (4 MiB; the old worker json.loads'ed 15 MB
    of them into ~400 MB, tens of seconds) is refused by size unparsed; what the worker parses is the verifier's
    small verdict only. Just over the bound: writing it runs under the solution's load-time alarm, which a
    15 MB write on a loaded machine once exceeded (a timeout, not the size refusal, was then the verdict)."""
    import megatron_rl.envs.code.verifier as V

    seen: list[int] = []
    real = V.json.loads
    monkeypatch.setattr(V.json, "loads", lambda s, *a, **k: seen.append(len(s)) or real(s, *a, **k))
    n = V.CLAIM_MAX_BYTES // 3 + 4096  # '[],' each: the file is 12 KB over the bound
    flood = (f"import os\nopen('.mrl_results.json', 'w').write('[' + '[],' * {n} + '[]]')\nos._exit(0)\n"
             "def gcd(a, b):\n    return 1\n")
    reward, reason = code_reward(sandbox, "code-gcd", flood)
    assert reward == 0.0 and "larger than" in reason, reason
    assert max(seen, default=0) < V.CLAIM_MAX_BYTES // 4, seen


@pytest.mark.parametrize("claim", ['{"tests": 5}', "[[[", '{"tests": [["ok"]]}', "[]"])
def test_code_malformed_results_end_the_replay_as_a_failed_attempt(sandbox, claim):
    """A results file of the wrong shape is the candidate's doing: one candidate run, every test fails, the sample
    stays valid (the old verifier crashed on some shapes, an infrastructure error that drops the sample, and
    replayed others for every round)."""
    counting = _CountingSandbox(sandbox)
    solution = (f"import os\nopen('.mrl_results.json', 'w').write({claim!r})\nos._exit(0)\n"
                "def gcd(a, b):\n    return 1\n")
    reward, reason = code_reward(counting, "code-gcd", solution)
    assert reward == 0.0 and "malformed" in reason and counting.runs == 1, (reason, counting.runs)


# -------------------------------------------------------------------------------------------- terminal
def call(command: str) -> str:
    return "<tool_call>" + json.dumps({"name": "shell", "arguments": {"command": command}}) + "</tool_call>"


def terminal_reward(sandbox, commands: list[str], tid: str = "terminal-fix-median") -> tuple[float, str]:
    env = make_env("terminal", sandbox=sandbox, budget=Budget(max_turns=len(commands) + 1))
    env.reset(task("terminal", tid))
    for c in commands:
        r = env.step(call(c))
        assert "[exit code 0]" in r.observation.text and "note:" not in r.observation.text, r.observation.text
    r = env.step("done")
    assert r.reward_result.valid, r.reward_result.reasons
    return r.reward, r.reward_result.reasons["verified"]


ATTACKS = {
    "unittest_main_shadow": ["mkdir -p unittest && touch unittest/__init__.py && "
                             "printf 'raise SystemExit(0)\\n' > unittest/__main__.py"],
    "early_exit_test_file": ["printf 'import os\\nos._exit(0)\\n' > test_0.py"],
    "user_site_pth": ["mkdir -p .local/lib/python3.11/site-packages && "
                      "echo 'import os; os._exit(0)' > .local/lib/python3.11/site-packages/zz.pth"],
    "exit_on_import_of_the_module_under_test": ["printf 'import os\\nos._exit(0)\\n' >> stats.py"],
    "replace_the_visible_test": ["printf 'import unittest\\n' > test_stats.py && "
                                 "printf 'import unittest\\n' > test_hidden_stats.py"],
    "stdlib_shadow": ["printf 'import os\\nos._exit(0)\\n' > json.py && for m in ast select subprocess argparse "
                      "difflib fnmatch pprint; do cp json.py $m.py; done"],
    # a daemon writing forged verdict lines into the harness's stdout through /proc/<harness>/fd/1 (refused: the
    # pipe is the worker's, and the harness is non-dumpable)
    "forge_the_harness_stdout": ["cat >> stats.py <<'EOF'\nimport os, time\nppid = os.getppid()\n"
                                 "if os.fork() == 0:\n    os.setsid()\n    try:\n"
                                 "        fd = os.open('/proc/%d/fd/1' % ppid, os.O_WRONLY)\n"
                                 "    except OSError:\n        os._exit(0)\n    while True:\n"
                                 "        os.write(fd, b'\\nMRL-VERDICT {\"passed\": true, \"files\": {}}\\n')\n"
                                 "        time.sleep(0.001)\nos._exit(0)\nEOF"],
}


# the module under test, imported by the pristine test, writes the test process's report itself / patches unittest
ATTACKS["module_writes_the_report"] = [
    "cat > stats.py <<'EOF'\nimport ast, json, os, sys\n"
    "tree = ast.parse(open(sys.argv[1]).read())\n"
    "n = sum(1 for c in tree.body if isinstance(c, ast.ClassDef) for d in c.body\n"
    "        if isinstance(d, ast.FunctionDef) and d.name.startswith('test'))\n"
    "os.write(int(sys.argv[2]), json.dumps({'run': n, 'failed': 0, 'skipped': 0, 'log': ''}).encode())\n"
    "os._exit(0)\nEOF"]
# the module under test reads the expected values out of the (hidden) test files at verification time
ATTACKS["read_the_hidden_tests"] = [
    "cat > stats.py <<'EOF'\nimport ast, glob, re\nANSWERS = {}\n"
    "for f in glob.glob('test_*.py'):\n"
    "    for a, want in re.findall(r'median\\((\\[[^\\]]*\\])\\), ([0-9.]+)\\)', open(f).read()):\n"
    "        ANSWERS[tuple(ast.literal_eval(a))] = ast.literal_eval(want)\n"
    "def median(xs):\n    return ANSWERS[tuple(xs)]\nEOF"]
ATTACKS["module_patches_unittest"] = [
    "cat > stats.py <<'EOF'\nimport unittest\n"
    "unittest.TestCase.assertEqual = lambda *a, **k: None\n"
    "def median(xs):\n    return 0\nEOF"]


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_terminal_verifier_cannot_be_forged(sandbox, attack):
    reward, reason = terminal_reward(sandbox, ATTACKS[attack])
    assert reward == 0.0, (attack, reason)


def test_terminal_honest_fix_still_passes_next_to_planted_files(sandbox):
    fix = ("cat > stats.py <<'EOF'\ndef median(xs):\n    s = sorted(xs)\n    n = len(s)\n"
           "    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\nEOF")
    reward, reason = terminal_reward(sandbox, [fix, ATTACKS["stdlib_shadow"][0], ATTACKS["unittest_main_shadow"][0]])
    assert reward == 1.0 and "2 tests passed" in reason and "1 tests passed" in reason, reason


def test_code_set_arguments_plan_the_same_call_in_every_process(sandbox):
    """Set iteration order differs between processes (hash randomisation): the call plan must not."""
    sol = "def size(s, extra=frozenset()):\n    return len(s | extra)\n"
    from megatron_rl.envs.code.verifier import run_unit_tests

    tests = ["assert size({'a', 'b', 'c', 'd', 'e'}) == 5", "assert size({'x'}, extra=frozenset({'y', 'z'})) == 3"]
    results, _, status = run_unit_tests(sandbox, sol, tests)
    assert status == "ok" and results == [(True, ""), (True, "")], results


def test_code_calls_that_depend_on_earlier_answers_are_replayed(sandbox):
    from megatron_rl.envs.code.verifier import run_unit_tests

    tests = ["assert inc(inc(1)) == 3", "assert inc(1) == 2 and inc(5) == 6",
             "assert [inc(i) for i in range(4)] == [1, 2, 3, 4]",
             "xs = [3, 1, 2]\nsort_in_place(xs)\nassert inc(xs[0]) == 2"]
    good = "def inc(x):\n    return x + 1\ndef sort_in_place(xs):\n    xs.sort()\n"
    results, _, status = run_unit_tests(sandbox, good, tests)
    assert status == "ok" and [p for p, _ in results] == [True] * 4, results
    bad = "def inc(x):\n    return x + 2\ndef sort_in_place(xs):\n    pass\n"
    results, _, status = run_unit_tests(sandbox, bad, tests)
    assert status == "ok" and [p for p, _ in results] == [False] * 4, results


class NoZygote(Sandbox):
    """The sandbox without its zygote: the code reward runs a verifier sandbox per verdict (`verify.py`), as
    on backends that have none."""

    def __init__(self, inner: Sandbox):
        self.inner = inner

    def run(self, *a, **kw):
        return self.inner.run(*a, **kw)


def test_code_harness_runs_the_workers_bytecode(sandbox, monkeypatch):
    """The harness scripts run from the worker's bytecode (not compiled again in the sandbox): with a source
    that would fail, the reward still comes out right (the verifier as a sandbox per verdict; the zygote's
    own script: tests/envs/test_sandbox_zygote.py)."""
    from megatron_rl.envs.code import verifier as V

    sandbox = NoZygote(sandbox)

    for name in ("_RUNNER_FILES", "_VERIFIER_FILES"):
        files = dict(getattr(V, name))
        src = next(n for n in files if n.endswith(".py"))
        files[src] = b"raise SystemExit('the source was compiled')\n"
        monkeypatch.setattr(V, name, files)
    results, _, status = V.run_unit_tests(sandbox, "def inc(x):\n    return x + 1\n",
                                          ["assert inc(1) == 2", "assert inc(2) == 4"])
    assert status == "ok" and [p for p, _ in results] == [True, False], results


def test_code_harness_falls_back_to_source_for_another_bytecode_format(sandbox, monkeypatch):
    """A sandbox interpreter with another magic number compiles the harness source instead."""
    from megatron_rl.envs.code import verifier as V

    sandbox = NoZygote(sandbox)

    for name in ("_RUNNER_FILES", "_VERIFIER_FILES"):
        files = {n: (b"\0\0\r\n" + d[4:] if n.endswith(".pyc") else d) for n, d in getattr(V, name).items()}
        monkeypatch.setattr(V, name, files)
    results, _, status = V.run_unit_tests(sandbox, "def inc(x):\n    return x + 1\n",
                                          ["assert inc(1) == 2", "assert inc(2) == 4"])
    assert status == "ok" and [p for p, _ in results] == [True, False], results


def test_verifier_harness_refuses_to_run_outside_a_pid_namespace_of_its_own(sandbox):
    """The harnesses' fence kills every process it can signal (`kill(-1)`): outside a sandbox with its own pid
    namespace (the subprocess backend) that would be the worker and every process of its uid. The harness exits
    before anything runs there; inside bubblewrap it goes on."""
    import subprocess

    from megatron_rl.envs.verdict import FENCE, host_pidns

    script = FENCE + f"require_own_pidns({host_pidns()!r})\nprint('ran')\n"
    host = subprocess.run([sys.executable, "-I", "-S", "-c", script], capture_output=True, text=True, timeout=60)
    assert host.returncode == 3 and "own pid namespace" in host.stderr and "ran" not in host.stdout
    inside = sandbox.run(["python3", "-I", "-S", "run.py"], files={"run.py": script})
    assert inside.exit_code == 0 and inside.stdout.strip() == "ran", inside
