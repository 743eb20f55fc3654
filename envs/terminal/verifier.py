"""The terminal domain's verifier: pristine unittest files over the final workspace, in a sandbox of their own.

THREAT MODEL (what the `verifier` reward trusts)
Trusted: the task's verifier files (its pristine tests), the worker and the harness below. Untrusted: every
file of the workspace (the model wrote or changed them) and every process that imports one.
- The verifier runs in a fresh sandbox started after the model's last command ended, over a copy of the
  final workspace with the task's pristine test files written over it. Only those pristine `test_*.py`
  files run: test files the model added (`test_0.py` calling `os._exit(0)`) are never imported.
- The harness (`python3 -I -S`: no user site, no `.pth`, no `sitecustomize`, script directory and
  workspace not on `sys.path`) never imports anything from the workspace: a planted `unittest/__main__.py`,
  `json.py` or `.local/.../x.pth` changes nothing. It is non-dumpable (no /proc/<pid>/mem, fd or environ
  access, no ptrace by the same uid) and a child subreaper (`envs.verdict.FENCE`). It reads the pristine test
  files into memory and removes them from disk before any workspace code runs (the model's code cannot read
  the hidden tests' expected values).
- Each test file runs in two processes. The TEST process (`python3 -I -S`, non-dumpable before anything else
  starts, its pipes non-inheritable) executes the pristine file with unittest and never imports workspace
  code: a module the standard library does not have is a proxy whose attribute reads, attribute writes and
  calls go to the CANDIDATE process (started only after the test process is ready), which imports the
  workspace's modules (stdlib first, the workspace appended to `sys.path`) and answers each with a plain,
  serialised value (tagged JSON as in the code domain: None, bool, int, float, str, bytes, list, tuple, dict,
  set, frozenset, complex; arguments after the call, for mutation), an exception of a built-in type, or
  "callable"/"module". The test process decodes answers into exact built-in types, so the comparisons,
  unittest and the report are the test process's own: patched `unittest`, objects whose `__eq__` is always
  true, frame tricks and a module that writes a report itself cannot exist on that side. What the candidate
  process answers is only its CLAIM of what its code returns (equivalent to returning it); an answer that is
  late (the file's time budget), larger than `RPC_MAX_BYTES` or malformed fails the test and ends the channel.
- A file passes only when its test process exited 0 and reported as many tests run as the pristine file
  defines (counted by the harness from its syntax tree), none failed, errored or skipped. After each file the
  harness kills and reaps every other process of the sandbox (the candidate process, whatever it started,
  the test process) before the next file starts.
- The verdict is the harness's own line on the sandbox's stdout, which no child holds, printed after the
  last kill, with a nonce only the harness knows (`envs.verdict`); the sandbox's exit status must be 0 too.
  A process of the model's can kill or stop the harness or the test process (then that file or the whole
  run fails), not write their reports or the verdict.
Not covered: a test that hands a workspace function a non-plain value (a lambda, a file object) or uses a
non-plain result (a class instance, a generator) fails with a reason - such tasks need their own verifier;
workspace state persists across the tests of one file (as in one interpreter). A program a test runs
(`subprocess.run([sys.executable, "main.py"])`) runs as the test process's child with the model's code; its
output is data, but it can signal or stop the test process (a fail). Files the tests read from the workspace
are the model's (data, as intended). Test classes that inherit test methods from other classes are counted by
their own `def test*` only (such files need one class per test set). A custom `command` (not unittest) is run
as given in the verifier sandbox: its exit status is trusted, and so is whatever it imports.
"""
from __future__ import annotations

import json
import posixpath

from megatron_rl.envs.base import sandbox_problem
from megatron_rl.envs.code.verifier import _CODEC
from megatron_rl.envs.sandbox.base import Limits, SandboxResult
from megatron_rl.envs.verdict import FENCE, host_pidns, new_nonce, verdict_line

VERDICT = "MRL-VERDICT "
RPC_MAX_BYTES = 16 << 20
"""Largest answer line the candidate's process may send the test process."""

# The candidate's process: imports the workspace's modules and answers the test process's requests with plain,
# serialised values. Everything here is the candidate's to subvert: what it sends is only its claim.
_SERVER = _CODEC + r"""
import importlib, os, types
chan_in, chan_out = os.fdopen(os.dup(0), "rb"), os.dup(1)
null = os.open("/dev/null", os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
sys.path.append(os.getcwd())

def describe(e):
    for c in type(e).__mro__:
        if getattr(builtins, c.__name__, None) is c:
            try:
                return ["raise", c.__name__, str(e)[:300]]
            except BaseException:
                return ["raise", c.__name__, ""]
    return ["raise", "Exception", type(e).__name__]

def handle(msg):
    op, mod = msg[0], msg[1]
    if op == "import":
        m = importlib.import_module(mod)
        return ["ok", hasattr(m, "__path__")]
    m = sys.modules[mod]
    if op == "set":
        setattr(m, msg[2], dec(msg[3]))
        return ["ok"]
    obj = getattr(m, msg[2])
    if op == "get":
        if isinstance(obj, types.ModuleType):
            return ["module", obj.__name__]
        if callable(obj):
            return ["callable"]
        return ["value", enc(obj)]
    a, kw = dec(msg[3]), dec(msg[4])
    value = obj(*a, **kw)
    return ["ok", enc(value), enc(a), enc(kw)]

for line in chan_in:
    try:
        out = handle(loads(line.decode("utf-8")))
    except BaseException as e:
        out = describe(e)
    try:
        data = dumps(out)
    except BaseException as e:
        data = dumps(["bad", "an answer cannot be compared by the verifier: %s" % type(e).__name__])
    view = memoryview(data.encode() + b"\n")
    while view:
        view = view[os.write(chan_out, view):]
"""

# The proxy side (`_TESTER`, and the converted Harbor tasks' run_tests.py): workspace modules imported by a
# test are proxies; their attribute reads, writes and calls are requests to the candidate's process, answered with
# plain values decoded into exact built-in types.
_PROXY = r"""
import importlib, importlib.machinery, os, select, time, types
LOCAL = {"__spec__", "__loader__", "__package__", "__path__", "__file__", "__cached__", "__name__", "__doc__",
         "__builtins__", "__class__", "__dict__"}
CHANNEL = {"dead": None, "buf": b""}  # req_w, ans_r, deadline, rpc_max: set by the script

class CandidateError(RuntimeError):
    pass

def rpc(msg):
    if CHANNEL["dead"]:
        raise CandidateError(CHANNEL["dead"])
    data = dumps(msg).encode() + b"\n"
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(CHANNEL["req_w"], view):]
        while b"\n" not in CHANNEL["buf"]:
            left = CHANNEL["deadline"] - time.monotonic()
            if left <= 0 or not select.select([CHANNEL["ans_r"]], [], [], left)[0]:
                raise CandidateError("the candidate's process did not answer in time")
            chunk = os.read(CHANNEL["ans_r"], 1 << 16)
            if not chunk:
                raise CandidateError("the candidate's process exited")
            CHANNEL["buf"] += chunk
            if len(CHANNEL["buf"]) > CHANNEL["rpc_max"]:
                raise CandidateError("the candidate's answer is larger than " + str(CHANNEL["rpc_max"]) + " bytes")
    except (OSError, CandidateError) as e:
        CHANNEL["dead"] = str(e) if isinstance(e, CandidateError) else "the candidate's process exited"
        raise CandidateError(CHANNEL["dead"]) from None
    line, _, CHANNEL["buf"] = CHANNEL["buf"].partition(b"\n")
    try:
        ans = loads(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        ans = None
    if type(ans) is not list or not ans or type(ans[0]) is not str:
        CHANNEL["dead"] = "malformed answer from the candidate's process"
        raise CandidateError(CHANNEL["dead"])
    if ans[0] == "raise" and len(ans) == 3 and type(ans[1]) is str and type(ans[2]) is str:
        cls = getattr(builtins, ans[1], None)
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = RuntimeError
        raise cls(ans[2])
    if ans[0] == "bad" and len(ans) == 2:
        raise TypeError(str(ans[1])[:300])
    return ans

def update_in_place(orig, after):
    if type(orig) is list and type(after) is list:
        orig[:] = after
    elif type(orig) in (dict, set) and type(after) is type(orig):
        orig.clear()
        orig.update(after)

class RemoteCallable:
    def __init__(self, mod, name):
        self._where = (mod, name)
    def __call__(self, *args, **kwargs):
        ans = rpc(["call", self._where[0], self._where[1], enc(list(args)), enc(kwargs)])
        if ans[0] != "ok" or len(ans) != 4:
            raise CandidateError("malformed answer from the candidate's process")
        value, a, kw = dec(ans[1]), dec(ans[2]), dec(ans[3])
        if type(a) is list and len(a) == len(args):
            for o, n in zip(args, a):
                update_in_place(o, n)
        if type(kw) is dict:
            for k, o in kwargs.items():
                if k in kw:
                    update_in_place(o, kw[k])
        return value

class RemoteModule(types.ModuleType):
    def __getattr__(self, name):
        if name in LOCAL:
            raise AttributeError(name)
        ans = rpc(["get", self.__name__, name])
        if ans[0] == "value" and len(ans) == 2:
            return dec(ans[1])
        if ans[0] == "callable":
            return RemoteCallable(self.__name__, name)
        if ans[0] == "module" and len(ans) == 2 and type(ans[1]) is str:
            return importlib.import_module(ans[1])
        raise CandidateError("malformed answer from the candidate's process")
    def __setattr__(self, name, value):
        if name in LOCAL or isinstance(value, (types.ModuleType, RemoteCallable)):
            super().__setattr__(name, value)
        else:
            rpc(["set", self.__name__, name, enc(value)])

class RemoteLoader:
    def create_module(self, spec):
        return RemoteModule(spec.name)
    def exec_module(self, module):
        pass

class RemoteFinder:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in sys.stdlib_module_names:
            return None  # an optional standard module this build lacks is not the workspace's to provide
        try:
            ans = rpc(["import", name])
        except (ModuleNotFoundError, CandidateError):
            return None
        except Exception as e:
            raise ImportError("%s (in the workspace's %s)" % (e, name)) from None
        if ans[0] != "ok" or len(ans) != 2:
            return None
        return importlib.machinery.ModuleSpec(name, RemoteLoader(), is_package=ans[1] is True)

"""

# The test process: runs one pristine test file with every workspace module replaced by a proxy that asks the
# candidate's process; only plain values decoded into exact built-in types come back. It never imports anything
# from the workspace and its report pipe is its own (non-inheritable, non-dumpable).
_TESTER = _CODEC + _PROXY + r"""
import ctypes, io, unittest
ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
report = os.dup(1)
req_w, ans_r = int(sys.argv[1]), int(sys.argv[2])
for fd in (report, req_w, ans_r):
    os.set_inheritable(fd, False)
os.write(report, b"R")  # ready: the candidate's process may start now
spec = loads(os.fdopen(0, "rb").read().decode("utf-8"))
null = os.open("/dev/null", os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)
CHANNEL.update(req_w=req_w, ans_r=ans_r, rpc_max=spec["rpc_max"], deadline=time.monotonic() + spec["total_s"])
sys.meta_path.append(RemoteFinder())  # after the standard library's finders: it cannot be shadowed
stream = io.StringIO()
try:
    path = spec["path"]
    mod = types.ModuleType(os.path.splitext(os.path.basename(path))[0])
    mod.__file__ = path
    sys.modules[mod.__name__] = mod
    exec(compile(spec["source"], path, "exec"), mod.__dict__)
    suite = unittest.defaultTestLoader.loadTestsFromModule(mod)
    res = unittest.TextTestRunner(stream=stream, verbosity=1).run(suite)
    out = {"run": res.testsRun, "failed": len(res.failures) + len(res.errors) + len(res.unexpectedSuccesses),
           "skipped": len(res.skipped), "log": stream.getvalue()[-1500:]}
except BaseException as e:
    out = {"error": "%s: %s" % (type(e).__name__, str(e)[:300]), "log": stream.getvalue()[-1500:]}
view = memoryview(dumps(out).encode())
while view:
    view = view[os.write(report, view):]
os._exit(0)
"""
_HARNESS = FENCE + r'''
import ast, select, subprocess, sys
with open(".mrl_verify.json") as f:
    spec = json.load(f)
os.unlink(".mrl_verify.json")
require_own_pidns(spec["host_pidns"])
sources = {}
for path in spec["tests"]:  # the pristine files, read before any candidate code runs, then removed
    with open(path, encoding="utf-8") as f:
        sources[path] = f.read()
    os.unlink(path)
deadline = time.monotonic() + spec["total_s"]
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1"}

def expected_tests(source):
    tree = ast.parse(source)
    return sum(1 for c in tree.body if isinstance(c, ast.ClassDef) for d in c.body
               if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.name.startswith("test"))

def read_some(fd, n):
    data = b""
    while len(data) < n and time.monotonic() < deadline:
        if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(fd, min(1 << 16, n - len(data)))
            if not chunk:
                break
            data += chunk
    return data

def close(owned, fd):
    owned.remove(fd)
    os.close(fd)

def converse(path, owned, rep_r, in_w, req_r, ans_w):
    """The test process is ready (non-dumpable, its channels private): start the candidate's, send the test."""
    if read_some(rep_r, 1) != b"R":
        return None
    subprocess.Popen([sys.executable, "-I", "-S", "-c", spec["server"]], stdin=req_r, stdout=ans_w,
                     stderr=subprocess.DEVNULL, env=ENV)
    close(owned, req_r)
    close(owned, ans_w)
    job = {"path": path, "source": sources[path], "rpc_max": spec["rpc_max"],
           "total_s": max(0.1, deadline - time.monotonic())}
    data = json.dumps(job).encode()
    while data:
        data = data[os.write(in_w, data):]
    close(owned, in_w)
    return read_some(rep_r, 1 << 20)

def run_file(path):
    want = expected_tests(sources[path])
    req_r, req_w = os.pipe()
    ans_r, ans_w = os.pipe()
    rep_r, rep_w = os.pipe()
    in_r, in_w = os.pipe()
    tester = subprocess.Popen([sys.executable, "-I", "-S", "-c", spec["tester"], str(req_w), str(ans_r)],
                              pass_fds=(req_w, ans_r), stdin=in_r, stdout=rep_w, stderr=subprocess.DEVNULL, env=ENV)
    for fd in (req_w, ans_r, rep_w, in_r):
        os.close(fd)
    owned = [rep_r, in_w, req_r, ans_w]
    try:
        data = converse(path, owned, rep_r, in_w, req_r, ans_w)
        code = tester.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False, "timed out"
    finally:
        fence()  # the candidate's process, all it started, and the test process: nothing outlives this file
        for fd in list(owned):
            close(owned, fd)
    if data is None:
        return False, "the test process did not start"
    try:
        rep = json.loads(data)
        run, failed, skipped = int(rep.get("run", -1)), int(rep.get("failed", -1)), int(rep.get("skipped", -1))
        log = str(rep.get("log", ""))[-600:]
        err = str(rep.get("error", ""))[:300]
    except (ValueError, TypeError, AttributeError):
        return False, "no report from the test process (exit %d)" % code
    if err:
        return False, "could not run: " + err
    if code != 0:
        return False, "test process exited %d" % code
    if want == 0 or run != want:
        return False, "%d of the %d tests ran" % (run, want)
    if failed or skipped:
        return False, "%d failed, %d skipped: %s" % (failed, skipped, log)
    return True, "%d tests passed" % run

files = {}
for path in sources:
    try:
        files[path] = run_file(path)
    except Exception as e:
        files[path] = (False, "verifier: %s: %s" % (type(e).__name__, e))
ok = bool(files) and all(p for p, _ in files.values())
fence()
print_verdict(spec["prefix"], spec["nonce"], {"passed": ok, "files": files})
'''


def is_unittest_spec(spec: dict) -> bool:
    """Whether a verify spec is 'unittest over the task's test files' (the shipped kind)."""
    return "unittest" in str(spec.get("command", "")) and bool(test_files(spec))


def test_files(spec: dict) -> list[str]:
    return sorted(p for p in (spec.get("files") or {}) if posixpath.basename(p).startswith("test")
                  and p.endswith(".py"))


def run_verifier(sandbox, workspace_files: dict, spec: dict, limits: Limits | None) -> tuple[bool, str, SandboxResult]:
    """Run the pristine tests of `spec` over `workspace_files` in a fresh sandbox; (passed, reason, result)."""
    limits = limits or Limits()
    files = dict(workspace_files)
    files.update(spec.get("files") or {})  # pristine copies win over the model's versions
    nonce = new_nonce()
    harness = {"tests": test_files(spec), "total_s": 0.8 * limits.wall_s, "prefix": VERDICT, "nonce": nonce,
               "host_pidns": host_pidns(), "tester": _TESTER, "server": _SERVER, "rpc_max": RPC_MAX_BYTES}
    files[".mrl_verify.py"] = _HARNESS
    files[".mrl_verify.json"] = json.dumps(harness)
    res = sandbox.run(["python3", "-I", "-S", ".mrl_verify.py"], files=files, limits=limits)
    verdict = verdict_line(res.stdout, VERDICT, nonce)
    problem = sandbox_problem(res)
    if verdict is None or res.exit_code != 0 or problem:
        why = problem[0] if problem else f"exit {res.exit_code}"
        return False, f"verifier gave no verdict ({why}): {res.stderr[-200:]}".strip(), res
    per_file = verdict.get("files") or {}
    reason = "; ".join(f"{k}: {v[1]}" for k, v in per_file.items() if isinstance(v, list) and len(v) == 2)
    return verdict.get("passed") is True, reason[:600], res
