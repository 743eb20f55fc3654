"""The terminal domain's verifier: pristine unittest files over the final workspace, in a sandbox of their own.

THREAT MODEL (what the `verifier` reward trusts)
Trusted: the task's verifier files (its pristine tests), the worker and the harness below. Untrusted: every
file of the workspace (the model wrote or changed them) and every process that imports one.
- The verifier runs in a fresh sandbox started after the model's last command ended, over a copy of the
  final workspace with the task's pristine test files written over it. Only those pristine `test_*.py`
  files run: test files the model added (`test_0.py` calling `os._exit(0)`) are never imported.
- The harness (`python3 -I -S`: no user site, no `.pth`, no `sitecustomize`, script directory and
  workspace not on `sys.path`) never imports anything from the workspace: a planted `unittest/__main__.py`,
  `json.py` or `.local/.../x.pth` changes nothing. It makes itself non-dumpable (no /proc/<pid>/mem, fd or
  environ access, no ptrace by the same uid) and runs each test file in a child process (`-I -S`, stdlib
  imported first, the workspace APPENDED to `sys.path` so it cannot shadow the standard library) whose
  report comes back on a private pipe. A file passes only when its child exited 0 and reported as many
  tests run as the pristine file defines (counted by the harness from its syntax tree), none failed,
  errored or skipped: exiting early (`os._exit(0)` on import) or skipping tests scores 0.
- The verdict is the harness's own last line on the sandbox's stdout, which no child holds (children get
  /dev/null and their report pipe); the sandbox's exit status must be 0 too. A process of the model's can
  kill or stop the harness (then there is no verdict: 0), not write its verdict.
Not covered: the model's modules imported by a test run in that test's process and can patch it (e.g.
`unittest.TestCase.assertEqual`) to misreport its own file; a test that needs to defeat that compares plain
data the way the code domain does. Test classes that inherit test methods from other classes are counted
by their own `def test*` only (such files need one class per test set). A custom `command` (not unittest)
is run as given in the verifier sandbox: its exit status is trusted, and so is whatever it imports.
"""
from __future__ import annotations

import json
import posixpath

from envs.base import sandbox_problem
from envs.sandbox.base import Limits, SandboxResult

VERDICT = "MRL-VERDICT "

_CHILD = r'''
import importlib.util, io, json, os, sys, unittest
name, fd = sys.argv[1], int(sys.argv[2])
report = os.fdopen(fd, "w")
sys.path.append(os.getcwd())
stream = io.StringIO()
try:
    mod_name = os.path.splitext(os.path.basename(name))[0]
    spec = importlib.util.spec_from_file_location(mod_name, name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    suite = unittest.defaultTestLoader.loadTestsFromModule(mod)
    res = unittest.TextTestRunner(stream=stream, verbosity=1).run(suite)
    out = {"run": res.testsRun, "failed": len(res.failures) + len(res.errors) + len(res.unexpectedSuccesses),
           "skipped": len(res.skipped), "log": stream.getvalue()[-1500:]}
except BaseException as e:
    out = {"error": "%s: %s" % (type(e).__name__, str(e)[:300]), "log": stream.getvalue()[-1500:]}
report.write(json.dumps(out))
report.close()
'''

_HARNESS = r'''
import ast, ctypes, json, os, select, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
with open(".mrl_verify.json") as f:
    spec = json.load(f)
child_src = spec.pop("child")
os.unlink(".mrl_verify.json")
deadline = time.monotonic() + spec["total_s"]

def expected_tests(path):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return sum(1 for c in tree.body if isinstance(c, ast.ClassDef) for d in c.body
               if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.name.startswith("test"))

def run_file(path):
    want = expected_tests(path)
    r, w = os.pipe()
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1"}
    p = subprocess.Popen([sys.executable, "-I", "-S", "-c", child_src, path, str(w)], pass_fds=(w,),
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    os.close(w)
    data, eof = b"", False
    while not eof and time.monotonic() < deadline and len(data) < (1 << 20):
        if select.select([r], [], [], 0.05)[0]:
            chunk = os.read(r, 1 << 16)
            eof = not chunk
            data += chunk
        elif p.poll() is not None and not select.select([r], [], [], 0)[0]:
            break
    os.close(r)
    try:
        code = p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return False, "timed out"
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
for path in spec["tests"]:
    try:
        files[path] = run_file(path)
    except Exception as e:
        files[path] = (False, "verifier: %s: %s" % (type(e).__name__, e))
ok = bool(files) and all(p for p, _ in files.values())
sys.stdout.write("\n" + spec["prefix"] + json.dumps({"passed": ok, "files": files}) + "\n")
sys.stdout.flush()
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
    harness = {"tests": test_files(spec), "total_s": 0.8 * limits.wall_s, "prefix": VERDICT, "child": _CHILD}
    files[".mrl_verify.py"] = _HARNESS
    files[".mrl_verify.json"] = json.dumps(harness)
    res = sandbox.run(["python3", "-I", "-S", ".mrl_verify.py"], files=files, limits=limits)
    verdict = None
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(VERDICT):
            try:
                verdict = json.loads(line[len(VERDICT):])
            except ValueError:
                pass
            break
    if not isinstance(verdict, dict) or res.exit_code != 0 or sandbox_problem(res):
        problem = sandbox_problem(res)
        why = problem[0] if problem else f"exit {res.exit_code}"
        return False, f"verifier gave no verdict ({why}): {res.stderr[-200:]}".strip(), res
    per_file = verdict.get("files") or {}
    reason = "; ".join(f"{k}: {v[1]}" for k, v in per_file.items() if isinstance(v, list) and len(v) == 2)
    return verdict.get("passed") is True, reason[:600], res
