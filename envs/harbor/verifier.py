"""The harbor domain's verifier: the task's pristine `tests/test.sh` over a copy of the final workspace, in a
sandbox of its own; the reward is what test.sh wrote to /logs/verifier/reward.txt (or reward.json).

THREAT MODEL (what the `harbor_tests` reward trusts)
Trusted: the task folder (tests/, task.toml, the Dockerfile spec), the worker and the harness below. Untrusted:
every workspace file (the agent wrote or changed them) and every process that runs one.
- The verifier runs in a fresh sandbox started after the agent's last command ended: no process of the
  agent survives into it (each agent command ran in its own sandbox whose pid namespace died with it).
- The tests are the task's pristine copies, written to `/work/.mrl_tests` (the task's /tests); the result
  directory `/work/.mrl_logs/verifier` (the task's /logs/verifier) starts empty. Neither can come from the
  agent: `.mrl_` paths are never carried in a workspace (`envs.workspace`), so a planted `tests/test.sh`,
  `reward.txt` or `.mrl_logs` in the workspace is not what runs or what is read.
- A harness (`python3 -I -S`, non-dumpable: no /proc/<pid>/fd or mem access, no ptrace by the same uid) reads
  test.sh into memory before anything runs (a program that rewrites the file on disk while bash executes it
  changes nothing) and runs it with `bash -c` (the task's ENV and [verifier] env, stdin /dev/null, output to a log
  file the harness keeps open). The harness is a child subreaper: every process test.sh or its programs start
  (daemons, `setsid`, double forks) stays its descendant. Before each top-level command of test.sh whose text
  names the result (`/logs/...`, `reward.txt`, `reward.json`: the usual `echo 1 > /logs/verifier/reward.txt`)
  test.sh stops itself (a DEBUG trap, `TRAP`); the harness then kills every other process of the sandbox and
  reaps them, makes the result folders real, writable folders again and removes a result that is not a
  regular file (a read-only one is made writable), and only then lets test.sh go on, so its own write lands
  while no process the agent started is alive (a loop rewriting the result, a FIFO held open at its path, a
  watcher, a result made read-only so test.sh's write fails). Any other stop or continue
  of test.sh (another process's signal) scores 0. The moment test.sh exits (or times out) the harness kills
  every remaining process again (`envs.verdict.FENCE`); only then does it read the result, so nothing can
  write, rename or hold the result path afterwards. A result is read only from a regular file (every path
  component opened without following links; fstat S_ISREG: a FIFO, socket or device is refused) of at most
  4 KiB; anything else scores 0 with the reason. A reward.txt and a reward.json that disagree score 0 (one is
  not test.sh's).
- The verdict is the harness's own line on the sandbox's stdout, which no test process holds, printed after the
  kill, and carries a nonce from the harness's spec file (read and unlinked before test.sh starts; it lives
  only in the harness's memory), so only the harness can write a line the worker accepts. A harness that was
  stopped and continued (how a process could act between test.sh's exit and the kill) gives 0.
- test.sh killed by a signal, timed out, or no verdict at all (the harness was killed) scores 0; a missing or
  unparsable result scores 0 (never an infrastructure error, so an agent cannot turn a failure into a dropped
  sample by breaking the tests); rewards are clamped to [0, 1].
- Limits: [verifier] timeout_sec (capped by the environment), memory/cpus of task.toml; a verifier that hits a
  sandbox limit scores 0; a sandbox that cannot start is `sandbox_error` (dropped, not scored).
Not covered: test.sh runs the agent's programs in the same sandbox and uid (that is what Harbor tests do), so
what decides the result before it is written is theirs to influence: a program the tests run can change test
files not yet read, the other programs the tests call, and the files the tests check. The fence covers results
written by a top-level command of test.sh whose text names them; a result written from a function, subshell or
a program whose own code names the path (`python3 write_reward.py`) is written while the agent's processes may
still run, and one written through a variable only (`echo 1 > "$OUT"`) is not recognised. A test.sh that writes a result
only on success (no `else` writing 0) keeps a result the agent's programs planted earlier on failure. A background job
test.sh started is killed by that fence too (a test.sh that writes a result and then still needs its server
fails). Tests that import the agent's code in their own process (pytest over its modules) let that code decide their
exit status; the shipped tasks converted from the terminal suite run theirs through a `run_tests.py` that
never imports it (`envs.harbor.convert_terminal`). The pristine tests lie in /tests while the agent's
programs run (they can read expected values there unless the tests remove them first, as run_tests.py
does). A workspace on PATH (ENV PATH naming the workdir) lets the agent replace tools the tests call, as in
Docker. test.sh runs as `bash -c` with $0 set to its path and `${BASH_SOURCE[0]}` / `$BASH_SOURCE` in its text
replaced by `$0` (the same file); a test.sh that sets its own DEBUG trap replaces the fence's.
"""
from __future__ import annotations

import json
import math

from megatron_rl.envs.base import sandbox_problem
from megatron_rl.envs.harbor import paths
from megatron_rl.envs.harbor.loader import decode_files
from megatron_rl.envs.sandbox.base import Limits, SandboxResult
from megatron_rl.envs.verdict import FENCE, host_pidns, new_nonce, verdict_line

VERDICT = "MRL-HARBOR-VERDICT "

_HARNESS = FENCE + r'''
import re
with open(".mrl_verify.json") as f:
    spec = json.load(f)
os.unlink(".mrl_verify.json")
require_own_pidns(spec["host_pidns"])
with open(spec["script"], encoding="utf-8", errors="replace") as f:
    script = f.read()
script = re.sub(r"\$\{BASH_SOURCE(\[0\])?\}|\$BASH_SOURCE\b", "$0", script)  # its own file, run as bash -c
os.makedirs(os.path.dirname(spec["txt"]), exist_ok=True)
log_fd = os.open(spec["log"], os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
notes = []

def spawn():
    actions = [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0), (os.POSIX_SPAWN_DUP2, log_fd, 1),
               (os.POSIX_SPAWN_DUP2, log_fd, 2)]
    argv = ["bash", "-c", spec["trap"] + script, spec["script"]]
    return os.posix_spawnp("bash", argv, dict(os.environ, **spec["env"]), file_actions=actions)

def writable_result_path():
    # nothing else runs now: give the result folder and files back to test.sh (real, writable folders; a
    # result that is not a regular file removed, a read-only one made writable), so its own write lands
    import shutil
    folder = os.path.dirname(spec["txt"])
    for d in (".", os.path.dirname(folder), folder):
        if not os.path.isdir(d) or os.path.islink(d):
            if os.path.lexists(d):
                os.unlink(d)
            os.mkdir(d)
        os.chmod(d, 0o755)
    for f in (spec["txt"], spec["json"]):
        if os.path.islink(f) or (os.path.lexists(f) and not os.path.isfile(f)):
            shutil.rmtree(f) if os.path.isdir(f) and not os.path.islink(f) else os.unlink(f)
        elif os.path.lexists(f):
            os.chmod(f, 0o644)

def fence_test_sh(pid):
    # test.sh stopped itself before a command naming the result (or something stopped it): kill everything
    # else, then let it go on alone; any other change of its state meanwhile is another process's signal
    if not fence_except(pid):
        notes.append("a process the tests started could not be killed")
    try:
        writable_result_path()
    except OSError as e:
        notes.append("the result folder could not be restored: %s" % e)
    if os.waitpid(pid, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)[0]:
        notes.append("test.sh was continued or stopped by another process")
    os.kill(pid, signal.SIGCONT)

def run_test_sh(timeout):
    pid, deadline, ours = spawn(), time.monotonic() + timeout, False
    while True:
        got, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
        if not got:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            time.sleep(0.002)
        elif os.WIFSTOPPED(status):
            fence_test_sh(pid)
            ours = True
        elif os.WIFCONTINUED(status):
            if not ours:
                notes.append("test.sh was continued by another process")
            ours = False
        else:
            return os.waitstatus_to_exitcode(status)

rc = run_test_sh(spec["timeout"])
if not fence():
    notes.append("a process the tests started could not be killed")
verdict = {"rc": rc, "txt": None, "json": None}
for key in ("txt", "json"):
    verdict[key], why = read_result(spec[key], 4096)
    if why:
        notes.append(why)
if STOPPED:
    notes.append("the verifier harness was stopped and continued by a process of the tests")
verdict["refused"] = notes
end = os.lseek(log_fd, 0, os.SEEK_END)
verdict["log"] = os.pread(log_fd, 600, max(0, end - 600)).decode("utf-8", "replace")
print_verdict(spec["prefix"], spec["nonce"], verdict)
'''

TRAP = ('__mrl_fence() { [[ $BASHPID == $$ ]] || return 0; case "$BASH_COMMAND" in *"/.mrl_logs/"*|*reward.txt*|'
        '*reward.json*) kill -STOP $BASHPID;; esac; }; trap __mrl_fence DEBUG; ')
"""Prepended to test.sh's first line (its line numbers stay): before each of its top-level commands that names
the result (its text, unexpanded), test.sh itself (not a subshell) stops; the harness then kills every other
process and continues it, so the result is written while nothing else runs."""


def verifier_files(workspace_files: dict[str, bytes], payload: dict, limits: Limits, nonce: str
                   ) -> dict[str, bytes | str]:
    """The verifier's scratch: the workspace copy, the pristine tests and the harness (nothing else under .mrl_);
    the harness signs its verdict line with `nonce`."""
    files: dict[str, bytes | str] = {p: d for p, d in workspace_files.items() if not p.startswith(".mrl_")}
    files.update(decode_files(payload.get("tests") or {}, prefix=f"{paths.TESTS}/"))
    env = {**(payload.get("env") or {}), **(payload.get("verifier_env") or {})}
    spec = {"script": f"{paths.WORK}/{paths.TESTS}/test.sh", "txt": paths.REWARD_TXT, "json": paths.REWARD_JSON,
            "log": f"{paths.LOGS}/verifier/test-output.log", "env": {k: str(v) for k, v in env.items()},
            "timeout": 0.85 * limits.wall_s, "prefix": VERDICT, "nonce": nonce, "trap": TRAP,
            "host_pidns": host_pidns()}
    files[".mrl_verify.py"] = _HARNESS
    files[".mrl_verify.json"] = json.dumps(spec)
    return files


def _parse_one(text: str, name: str) -> tuple[float | None, str]:
    try:
        value = json.loads(text) if name == "reward.json" else float(text.strip())
        if isinstance(value, dict):
            value = value.get("reward", next(iter(value.values()), None))
        value = float(value)
    except (ValueError, TypeError, StopIteration):
        return None, f"unparsable {name}: {text[:80]!r}"
    if not math.isfinite(value):
        return None, f"{name} is not finite: {value}"
    return min(max(value, 0.0), 1.0), f"{name} = {value:g}"


def parse_reward(verdict: dict) -> tuple[float, str]:
    """(reward in [0, 1], reason) from the verdict's reward.txt, else reward.json; (0, why) when there is none,
    or when both exist and disagree (one of them is not test.sh's: a planted reward.txt next to its reward.json)."""
    found = [(n, t) for n, t in (("reward.txt", verdict.get("txt")), ("reward.json", verdict.get("json")))
             if t is not None]
    if not found:
        return 0.0, "test.sh wrote no /logs/verifier/reward.txt"
    parsed = [_parse_one(t, n) for n, t in found]
    if len(parsed) == 2 and parsed[0][0] != parsed[1][0]:
        return 0.0, f"reward.txt and reward.json disagree ({parsed[0][1]}; {parsed[1][1]})"
    value, why = parsed[0]
    return (0.0 if value is None else value), why


def score(verdict: dict | None) -> tuple[float, str]:
    """The reward of a verdict: 0 unless test.sh exited by itself in time and left a result."""
    if verdict is None:
        return 0.0, "the verifier harness gave no verdict (killed?)"
    rc, log = verdict.get("rc"), str(verdict.get("log", ""))[-300:].strip()
    if rc is None or not isinstance(rc, int) or rc < 0:
        return 0.0, f"test.sh {'timed out' if rc is None else f'was killed (signal {-rc})'}: {log}"
    refused = verdict.get("refused")
    if not isinstance(refused, list):
        return 0.0, "the verifier harness gave a malformed verdict"
    if refused:
        return 0.0, f"{'; '.join(map(str, refused))[:300]}; test.sh exit {rc}: {log}"
    reward, why = parse_reward(verdict)
    return reward, f"{why}; test.sh exit {rc}: {log}"


def run_tests(sandbox, workspace_files: dict[str, bytes], payload: dict, limits: Limits
              ) -> tuple[float, str, str, SandboxResult]:
    """Run the task's tests over the workspace in a fresh sandbox: (reward, reason, status, result)."""
    nonce = new_nonce()
    res = sandbox.run(["python3", "-I", "-S", ".mrl_verify.py"],
                      files=verifier_files(workspace_files, payload, limits, nonce), limits=limits)
    problem = sandbox_problem(res)
    if problem and problem[1] != "ok":
        return 0.0, problem[0], problem[1], res
    if problem:
        return 0.0, f"{problem[0]}: {(res.stdout + res.stderr)[-300:]}", "ok", res
    reward, why = score(verdict_line(res.stdout, VERDICT, nonce))
    return reward, why, "ok", res
