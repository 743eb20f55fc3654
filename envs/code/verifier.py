"""The code domain's verifier: the candidate's function runs in one sandbox, the tests in another, after it.

THREAT MODEL (what the `unit_tests` reward trusts)
Trusted: the task's tests (Python statements, usually asserts), the worker, and the two harness scripts
below. Untrusted: the solution and everything its process writes.
- Candidate sandbox (first): `python3 -I -S` running `runner.py` (`site=True`: with site packages) loads
  `solution.py` and calls its functions with the ARGUMENTS the tests pass (`.mrl_calls.json`), nothing else:
  it never sees the test statements, expected values or assertions, so it cannot read them and hard-code
  answers. Each return value (and each
  argument after the call, to catch mutation) is serialised to tagged JSON of plain data (None, bool, int,
  float, str, bytes, list, tuple, dict, set, frozenset, complex); anything else is reported as not
  comparable. The runner shares the candidate's process, so everything it writes is only the candidate's
  CLAIM of what its function returned - equivalent to returning that value.
- Verifier (second, after the candidate's sandbox has ended; no candidate code runs in it): the pristine
  tests from the task payload run with every free name of a test bound to a stub that answers from the
  candidate's claims (decoded into exact built-in types, so objects whose `__eq__` is always true, patched
  `json`/`print`/`builtins` and frame inspection cannot exist on this side). Where the sandbox has a zygote
  (bubblewrap, `Sandbox.zygote`), the verdict comes from a child forked for it by a long-lived verifier
  process in a sandbox of its own that has never seen candidate data (`envs.sandbox.zygote`: the child
  reads the spec and the claims from the worker's pipe and answers through the service's own pipe, which
  no candidate sandbox can reach: another uid as root, another pid namespace always); one bad exchange
  (timeout, crash, malformed answer) closes that sandbox and the next verdict starts a new one. Elsewhere
  a fresh verifier sandbox per verdict runs `verify.py` and writes `.mrl_verdict.json`, collected from its
  scratch only. Either way the candidate can neither write the verdict nor learn a nonce (there is none).
- The worker never parses the candidate's results file: it takes it from the scratch (no link followed,
  regular files only, capped by the sandbox) and hands it, at most `CLAIM_MAX_BYTES` (larger: every test
  fails), as bytes to the verifier, which parses it inside its own sandbox under the request's memory and CPU
  limits. A claim that is not JSON or not one list of answers per test fails every test and ends the replay
  (a valid sample scored 0, never a crashed verifier or a dropped sample). What the worker parses is the
  verifier's verdict only, produced by trusted code, whose reported calls are capped at `PLAN_MAX_BYTES`
  together (a test whose calls grow past that - a candidate's answers fed into calls - fails).
- A test whose calls depend on earlier answers (`f(f(1))`, `assert f(1) == 1 and f(2) == 2`) is replayed:
  the verifier reports the calls it still needs, the candidate sandbox runs again, up to `MAX_ROUNDS`.
  The calls a task's tests make are cached per test suite, so a known task costs one candidate sandbox run
  and one verdict.
- Both harness scripts are trusted code compiled by the worker: each sandbox gets the worker's bytecode
  (`runner.pyc`, `verify.pyc`, run by a fixed `-c` loader when the sandbox interpreter's magic number
  matches, else the source next to it is compiled there). They are written into a scratch the program has
  not touched, before it starts; in the candidate's sandbox they are the candidate's anyway (see above).
Not covered: the candidate sees the arguments its function is called with (that is what a function is);
a test that uses a solution's value without calling it (`assert LIMIT == 3`) or needs a non-plain object
(a generator, a class instance) fails with a reason - such tasks need their own verifier; calls within a
test share the candidate's process state (as they would in one interpreter), so a deterministic function
is assumed when a test is replayed over rounds; tests whose calls (arguments included) exceed `PLAN_MAX_BYTES`
together, or whose answers exceed `CLAIM_MAX_BYTES`, fail.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import marshal
import threading
from collections import OrderedDict

from megatron_rl.envs.base import sandbox_problem
from megatron_rl.envs.sandbox.base import Limits, SandboxResult
from megatron_rl.envs.sandbox.zygote import ZygoteError

MAX_ROUNDS = 4
"""Most candidate runs per reward (a test whose calls depend on earlier answers needs one per step)."""
CLAIM_MAX_BYTES = 4 << 20
"""Largest results file of a candidate's run that is handed to the verifier (larger: every test fails); below
the sandbox's scratch and file-size caps, and within what the verifier can parse under its memory limit."""
PLAN_MAX_BYTES = 1 << 20
"""Most bytes of calls one verdict reports (all tests together): bounds what the worker parses of a verdict."""

_CODEC = r'''
import builtins, sys
try:  # the C parts of json: importing json itself (and re) would double the start-up time of these scripts
    import _json, _signal as signal
    class _Ctx:
        strict, object_hook, object_pairs_hook, parse_float, parse_int = True, None, None, float, int
        @staticmethod
        def parse_constant(name):
            raise ValueError("non-standard JSON constant " + name)
    def _refuse(o):
        raise TypeError("not JSON")
    _scan = _json.make_scanner(_Ctx())
    _dump = _json.make_encoder(None, _refuse, _json.encode_basestring_ascii, None, ":", ",", False, False, False)
    def loads(text):
        i = len(text) - len(text.lstrip())
        try:
            obj, end = _scan(text, i)
        except StopIteration:
            raise ValueError("not JSON") from None
        if text[end:].strip():
            raise ValueError("extra data after JSON")
        return obj
    def dumps(obj):
        return "".join(_dump(obj, 0))
except (ImportError, AttributeError, TypeError):
    import json, signal
    loads, dumps = json.loads, lambda obj: json.dumps(obj, separators=(",", ":"))
if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(100000)
_DEPTH = 200

class Uncomparable(TypeError):
    pass

def enc(x, d=0):
    if d > _DEPTH:
        raise Uncomparable("value nested more than %d levels deep" % _DEPTH)
    t = type(x)
    if x is None or t is bool or t is str:
        return x
    if t is int:
        return x if -(1 << 53) < x < (1 << 53) else {"i": str(x)}
    if t is float:
        return {"f": repr(x)}
    if t is list:
        return [enc(v, d + 1) for v in x]
    if t is tuple:
        return {"t": [enc(v, d + 1) for v in x]}
    if t is dict:
        return {"d": [[enc(k, d + 1), enc(v, d + 1)] for k, v in x.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": sorted((enc(v, d + 1) for v in x), key=dumps)}  # canonical order
    if t is bytes:
        return {"b": x.hex()}
    if t is complex:
        return {"c": [repr(x.real), repr(x.imag)]}
    raise Uncomparable("a %s cannot be compared by the verifier: return plain data (None, bool, int, float, "
                       "str, bytes, list, tuple, dict, set)" % t.__name__)

def dec(x, d=0):
    if d > _DEPTH:
        raise ValueError("nested too deeply")
    t = type(x)
    if x is None or t is bool or t is str or t is int:
        return x
    if t is list:
        return [dec(v, d + 1) for v in x]
    if t is not dict or len(x) != 1:
        raise ValueError("malformed value")
    (k, v), = x.items()
    if k == "i" and type(v) is str:
        return int(v)
    if k == "f" and type(v) is str:
        return float(v)
    if k == "b" and type(v) is str:
        return bytes.fromhex(v)
    if k == "c" and type(v) is list and len(v) == 2 and all(type(p) is str for p in v):
        return complex(float(v[0]), float(v[1]))
    if type(v) is not list:
        raise ValueError("malformed value")
    if k == "t":
        return tuple(dec(e, d + 1) for e in v)
    if k == "s":
        return set(dec(e, d + 1) for e in v)
    if k == "fs":
        return frozenset(dec(e, d + 1) for e in v)
    if k == "d" and all(type(p) is list and len(p) == 2 for p in v):
        return {dec(a, d + 1): dec(b, d + 1) for a, b in v}
    raise ValueError("malformed value")

def read(path):
    with open(path, encoding="utf-8") as f:
        return loads(f.read())

def write(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        f.write(dumps(obj))
'''

# The candidate sandbox: load the solution, answer the calls. Everything here is the candidate's to subvert.
_RUNNER = _CODEC + r'''
import time, posix
spec = read(".mrl_calls.json")
posix.unlink(".mrl_calls.json")
PER, TOTAL = spec["per_call_s"], spec["total_s"]
def alarm(*_):
    raise TimeoutError("test timed out")
signal.signal(signal.SIGALRM, alarm)
def builtin_name(e):
    for c in type(e).__mro__:
        if getattr(builtins, c.__name__, None) is c:
            return c.__name__
    return "Exception"
def message(e):
    try:
        return str(e)[:200]
    except BaseException:
        return ""
def describe(e):
    return "%s: %s" % (type(e).__name__, message(e))
sys.stdout = open("/dev/null", "w")
g = {"__name__": "solution", "__builtins__": builtins}
load = None
try:
    signal.setitimer(signal.ITIMER_REAL, PER)
    exec(compile(open("solution.py", encoding="utf-8", errors="replace").read(), "solution.py", "exec"), g)
    signal.setitimer(signal.ITIMER_REAL, 0)
except BaseException as e:
    signal.setitimer(signal.ITIMER_REAL, 0)
    load = "solution failed to load: " + describe(e)
deadline = time.monotonic() + TOTAL
stop = load
out = []
for calls in spec["tests"]:
    answers = []
    for name, args, kwargs in calls:
        left = min(PER, deadline - time.monotonic())
        if stop or left <= 0:
            answers.append(["skip", stop or "not run: time budget spent"])
            continue
        try:
            a, kw = dec(args), dec(kwargs)
            fn = g[name] if name in g else getattr(builtins, name)
        except BaseException as e:
            answers.append(["raise", "NameError", "name %r is not defined by the solution" % name])
            continue
        try:
            signal.setitimer(signal.ITIMER_REAL, left)
            value = fn(*a, **kw)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            if isinstance(e, TimeoutError) and str(e) == "test timed out":
                answers.append(["timeout"])
                stop = "not run: an earlier test timed out"
            else:
                answers.append(["raise", builtin_name(e), message(e)])
            continue
        try:
            answers.append(["ok", enc(value), enc(a), enc(kw)])
        except BaseException as e:
            answers.append(["bad", describe(e)])
    out.append(answers)
write(".mrl_results.json", {"tests": out})
'''

# The verifier sandbox: only this harness, the pristine tests and decoded plain data. Nothing of the candidate
# runs here; its results file is data.
_VERIFY_DEFS = _CODEC + r'''
import time

class Pending(BaseException):
    """A value the candidate has not given yet was used: the test is replayed after another candidate run."""

def _pending(*_args, **_kwargs):
    raise Pending()

class Placeholder:
    """What an unanswered call returns: recording goes on (a comprehension of calls is planned in one round)
    until the value is used in any way."""
    __slots__ = ()
    __hash__ = None
for _op in ("eq ne lt le gt ge bool len iter next getitem setitem delitem contains call str repr format bytes "
            "int float complex index round abs neg pos invert add radd sub rsub mul rmul truediv rtruediv "
            "floordiv rfloordiv mod rmod pow rpow and rand or ror xor rxor lshift rlshift rshift rrshift "
            "matmul rmatmul divmod rdivmod enter exit reversed getattr").split():
    setattr(Placeholder, "__%s__" % _op, _pending)
Placeholder.__hash__ = _pending

def has_placeholder(x, d=0):
    if isinstance(x, Placeholder):
        return True
    if d < 50 and type(x) in (list, tuple, set, frozenset):
        return any(has_placeholder(v, d + 1) for v in x)
    if d < 50 and type(x) is dict:
        return any(has_placeholder(k, d + 1) or has_placeholder(v, d + 1) for k, v in x.items())
    return False

def alarm(*_):
    raise TimeoutError("test timed out")
signal.signal(signal.SIGALRM, alarm)

def free_names(code):
    """Global names a test's code (and the functions and comprehensions in it) may load; attribute names
    come along too (harmless: a stub only answers when called)."""
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    return sorted(n for n in names if not hasattr(builtins, n))

def update_in_place(orig, after):
    if type(orig) is list and type(after) is list:
        orig[:] = after
    elif type(orig) in (dict, set) and type(after) is type(orig):
        orig.clear()
        orig.update(after)

def answer(ans, args, kwargs):
    if type(ans) is not list or not ans or ans[0] not in ("ok", "raise", "timeout", "skip", "bad"):
        raise RuntimeError("malformed result from the candidate's run")
    if ans[0] == "ok" and len(ans) == 4:
        value, a, kw = dec(ans[1]), dec(ans[2]), dec(ans[3])
        if type(a) is list and len(a) == len(args):
            for o, n in zip(args, a):
                update_in_place(o, n)
        if type(kw) is dict:
            for k, o in kwargs.items():
                if k in kw:
                    update_in_place(o, kw[k])
        return value
    if ans[0] == "raise" and len(ans) == 3 and type(ans[1]) is str and type(ans[2]) is str:
        cls = getattr(builtins, ans[1], None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = RuntimeError
        raise cls(ans[2])
    if ans[0] == "timeout":
        raise TimeoutError("test timed out")
    raise RuntimeError(str(ans[1])[:300] if len(ans) > 1 else "malformed result")

def run_test(src, plan, answers):
    made = []
    state = {"pending": False}
    def stub_for(name):
        def stub(*args, **kwargs):
            if has_placeholder(args) or has_placeholder(kwargs):
                state["pending"] = True
                raise Pending()
            k = len(made)
            made.append([name, enc(list(args)), enc(kwargs)])
            if not state["pending"] and k < len(plan) and plan[k] == made[k] and answers is not None \
                    and k < len(answers):
                return answer(answers[k], args, kwargs)
            state["pending"] = True
            return Placeholder()
        stub.__name__ = name
        return stub
    code = compile(src, "test", "exec")
    g = {"__builtins__": builtins, "__name__": "test"}
    g.update({n: stub_for(n) for n in free_names(code)})
    try:
        exec(code, g)
        outcome = ["pass", ""]
    except Pending:
        outcome = ["pending", ""]
    except BaseException as e:
        try:
            msg = "%s: %s" % (type(e).__name__, str(e)[:200])
        except BaseException:
            msg = type(e).__name__
        outcome = ["fail", msg]
    if state["pending"]:
        return ["pending", "", made]
    return outcome + [made]

def verify(spec, claimed):
    """The verdict of every test of `spec` against the candidate's claimed answers (None: it gave none; a str:
    why its claim is malformed, which fails every test and ends the replay). The calls a verdict reports are
    capped at `plan_max` bytes together (a candidate's answers fed into calls cannot make it large)."""
    sys.stdout = open("/dev/null", "w")
    if type(claimed) is str:
        return [["fail", "malformed results from the solution's run: " + claimed, p] for p in spec["plan"]]
    per, total = spec["per_test_s"], spec["total_s"]
    deadline = time.monotonic() + total
    verdict, stop, room = [], None, spec["plan_max"]
    for i, (src, plan) in enumerate(zip(spec["tests"], spec["plan"])):
        left = min(per, deadline - time.monotonic())
        if stop or left <= 0:
            verdict.append(["fail", stop or "not run: time budget spent", plan])
            continue
        answers = claimed[i] if claimed is not None else None
        try:
            signal.setitimer(signal.ITIMER_REAL, left)
            v = run_test(src, plan, answers)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            v = ["fail", "verifier: %s" % type(e).__name__, plan]
        if v[0] == "fail" and v[1].startswith("TimeoutError: test timed out"):
            stop = "not run: an earlier test timed out"
        try:
            room -= len(dumps(v[2]))
        except BaseException:
            room = -1
        if room < 0:
            v = ["fail", "the calls of this test exceed %d bytes (answers fed into calls)" % spec["plan_max"], []]
        verdict.append(v)
    return verdict

def claims(spec, load):
    """The candidate's claimed answers: None when it gave none, a str saying why they are malformed."""
    if not spec["claimed"]:
        return None
    try:
        c = load()
    except (OSError, ValueError, UnicodeDecodeError, RecursionError, MemoryError) as e:
        return "not JSON (%s)" % type(e).__name__
    if type(c) is not dict or type(c.get("tests")) is not list or len(c["tests"]) != len(spec["tests"]) \
            or any(type(t) is not list for t in c["tests"]):
        return "not one list of answers per test"
    return c["tests"]
'''

# One verifier sandbox per verdict (backends without a zygote): the spec and claims are files in its scratch.
_VERIFIER = _VERIFY_DEFS + r'''
spec = read(".mrl_verify.json")
write(".mrl_verdict.json", verify(spec, claims(spec, lambda: read("candidate/results.json"))))
'''

# The verifier zygote (`envs.sandbox.zygote`): each forked child gets `spec JSON NUL claims` on its channel.
_VERIFIER_ZYGOTE = _VERIFY_DEFS + r'''
def handle(request):
    spec, _, claimed = request.partition(b"\0")
    spec = loads(spec.decode("utf-8"))
    return dumps(verify(spec, claims(spec, lambda: loads(claimed.decode("utf-8"))))).encode()

serve(handle)
'''

_LOADER = ("import marshal\nn=%r\nwith open(n+'c','rb') as f: d=f.read()\n"
           "exec(marshal.loads(d[16:]) if d[:4]==__import__('_frozen_importlib_external').MAGIC_NUMBER "
           "else compile(open(n,encoding='utf-8').read(),n,'exec'))")
"""`python3 -c` stub: run the script's bytecode compiled here when the sandbox's interpreter has the same
magic number (the bytecode format), else compile the source there. Compiling these scripts in the sandbox
costs more than starting the interpreter (~5 ms of ~10)."""


def _harness(name: str, source: str) -> tuple[list[str], dict[str, bytes]]:
    """Interpreter options and files that run `source` as the trusted script `name` in a sandbox (the
    worker's own bytecode of it, `NAME` + 'c', with the source as fallback)."""
    code = compile(source, name, "exec", dont_inherit=True, optimize=0)
    pyc = importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(code)
    return ["-c", _LOADER % name], {name: source.encode(), name + "c": pyc}


_RUNNER_ARGS, _RUNNER_FILES = _harness("runner.py", _RUNNER)
_VERIFIER_ARGS, _VERIFIER_FILES = _harness("verify.py", _VERIFIER)
_ZYGOTE_NAME = "code-verifier"

_plans: OrderedDict[str, list] = OrderedDict()
_plans_lock = threading.Lock()
_PLAN_CACHE = 4096
_PLAN_MAX_CHARS = 1 << 16


def _plan_key(tests: list[str]) -> str:
    return hashlib.sha256(json.dumps(tests).encode()).hexdigest()


def _cached_plan(key: str, n: int) -> list[list]:
    with _plans_lock:
        plan = _plans.get(key)
        if plan is not None:
            _plans.move_to_end(key)
    return [list(p) for p in plan] if plan is not None else [[] for _ in range(n)]


def _remember_plan(key: str, plan: list[list]) -> None:
    """Cache a suite's calls; a plan that a candidate's answers made large (`f(f(1))` with a huge f(1)) is not
    kept, so one candidate cannot make later ones pay for it."""
    if len(json.dumps(plan)) > _PLAN_MAX_CHARS:
        return
    with _plans_lock:
        _plans[key] = [list(p) for p in plan]
        _plans.move_to_end(key)
        while len(_plans) > _PLAN_CACHE:
            _plans.popitem(last=False)


def _loads(data: bytes | None):
    try:
        return json.loads(data) if data is not None else None
    except (ValueError, RecursionError):
        return None


def run_unit_tests(sandbox, code: str, tests: list[str], limits: Limits | None = None,
                   per_test_s: float = 2.0, site: bool = False) -> tuple[list[tuple[bool, str]], str, str]:
    """Run `tests` against `code`: the candidate's calls in one sandbox, the tests in a later, separate one.
    `site`: run the solution with Python's site packages (slower start; for tasks that need installed
    packages); without it the standard library only.

    Returns ([(passed, message)] per test, reason, status). Every test fails when the solution does not load
    or its run gives no result; after a call times out the remaining ones are not run (a hanging solution
    costs one timeout, not one per test); calls stop at 80% of the wall limit. status is sandbox_error when a
    sandbox could not start, error when the verifier (trusted code) gave no verdict.
    """
    limits = limits or Limits()
    key = _plan_key(tests)
    plan = _cached_plan(key, len(tests))
    claimed: bytes | None = None
    note = ""
    for _ in range(MAX_ROUNDS + 1):
        if any(plan):
            res = _candidate_run(sandbox, code, plan, limits, per_test_s, site)
            problem = sandbox_problem(res)
            if problem and problem[1] != "ok":
                return [(False, problem[0])] * len(tests), problem[0], problem[1]
            claimed = res.files.get(".mrl_results.json")
            if claimed is None or len(claimed) > CLAIM_MAX_BYTES:  # never parsed here: the verifier does that
                why = problem[0] if problem else f"exit {res.exit_code}"
                msg = (f"no test result: the solution's run gave no result ({why}): {res.stderr[-200:]}".strip()
                       if claimed is None else f"no test result: the solution's results are larger than "
                                               f"{CLAIM_MAX_BYTES} bytes")
                return [(False, msg)] * len(tests), msg, "ok"
            note = problem[0] if problem else ""
        verdict, problem = _verifier_run(sandbox, tests, plan, claimed, limits, per_test_s)
        if verdict is None:
            return [(False, problem[0])] * len(tests), problem[0], problem[1]
        pending = [i for i, v in enumerate(verdict) if v[0] == "pending"]
        plan = [v[2] if v[0] == "pending" or len(v[2]) > len(p) else p for v, p in zip(verdict, plan)]
        _remember_plan(key, plan)
        if not pending:
            results = [(v[0] == "pass", str(v[1])) for v in verdict]
            return results, note, "ok"
    results = [(v[0] == "pass", str(v[1]) if v[0] != "pending" else f"test needs more than {MAX_ROUNDS} rounds")
               for v in verdict]
    return results, note, "ok"


def _candidate_run(sandbox, code: str, plan: list[list], limits: Limits, per_test_s: float,
                   site: bool) -> SandboxResult:
    calls = {"per_call_s": float(per_test_s), "total_s": 0.8 * limits.wall_s, "tests": plan}
    files = {"solution.py": code, **_RUNNER_FILES, ".mrl_calls.json": json.dumps(calls)}
    argv = ["python3", "-I", *_RUNNER_ARGS] if site else ["python3", "-I", "-S", *_RUNNER_ARGS]
    return sandbox.run(argv, files=files, limits=limits, collect=[".mrl_results.json"])


def _verifier_run(sandbox, tests: list[str], plan: list[list], claimed: bytes | None, limits: Limits,
                  per_test_s: float) -> tuple[list | None, tuple[str, str] | None]:
    spec = {"tests": tests, "plan": plan, "per_test_s": float(per_test_s), "total_s": 0.8 * limits.wall_s,
            "claimed": claimed is not None, "plan_max": PLAN_MAX_BYTES}
    zygote = sandbox.zygote(_ZYGOTE_NAME, _VERIFIER_ZYGOTE) if hasattr(sandbox, "zygote") else None
    if zygote is not None:
        try:
            verdict = _loads(zygote.call(json.dumps(spec).encode() + b"\0" + (claimed or b""), limits))
        except ZygoteError as e:
            return None, (f"verifier gave no verdict ({e})", "error")
        return _checked(verdict, len(tests), "the verifier's answer is malformed")
    files: dict[str, str | bytes] = {**_VERIFIER_FILES, ".mrl_verify.json": json.dumps(spec)}
    if claimed is not None:
        files["candidate/results.json"] = claimed
    res = sandbox.run(["python3", "-I", "-S", *_VERIFIER_ARGS], files=files, limits=limits,
                      collect=[".mrl_verdict.json"])
    problem = sandbox_problem(res)
    if problem and problem[1] != "ok":
        return None, problem
    why = problem[0] if problem else f"exit {res.exit_code}"
    return _checked(_loads(res.files.get(".mrl_verdict.json")), len(tests), f"{why}: {res.stderr[-200:]}".strip())


def _checked(verdict, n: int, why: str) -> tuple[list | None, tuple[str, str] | None]:
    ok = (isinstance(verdict, list) and len(verdict) == n
          and all(isinstance(v, list) and len(v) == 3 and isinstance(v[2], list) for v in verdict))
    if not ok:
        return None, (f"verifier gave no verdict ({why})", "error")
    return verdict, None
