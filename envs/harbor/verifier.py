"""The harbor domain's verifier: the task's pristine `tests/test.sh` over a copy of the final workspace, in a
sandbox of its own; the reward is what test.sh wrote to /logs/verifier/reward.txt (or reward.json).

THREAT MODEL (what the `harbor_tests` reward trusts)
Trusted: the task folder (tests/, task.toml, the Dockerfile spec), the worker and this module. Untrusted: every
workspace file (the agent wrote or changed them) and every process that runs one.
- The verifier runs in a fresh sandbox started after the agent's last command ended: no process of the
  agent survives into it (each agent command ran in its own sandbox whose pid namespace died with it).
- The tests are the task's pristine copies, written to `/work/.mrl_tests` (the task's /tests); the result
  directory `/work/.mrl_logs/verifier` (the task's /logs/verifier) starts empty. Neither can come from the
  agent: `.mrl_` paths are never carried in a workspace (`envs.workspace`), so a planted `tests/test.sh`,
  `reward.txt` or `.mrl_logs` in the workspace is not what runs or what is read.
- The command is fixed here (`bash /work/.mrl_tests/test.sh`, the task's ENV and [verifier] env exported,
  the sandbox's clean environment otherwise), and the reward is read from the collected result file only,
  never from the candidate's output; a missing or unparsable result scores 0 (never an infrastructure error,
  so an agent cannot turn a failure into a dropped sample by breaking the tests); rewards are clamped to [0, 1].
- Limits: [verifier] timeout_sec (capped by the environment), memory/cpus of task.toml; a verifier that
  hits a limit scores 0; a sandbox that cannot start is `sandbox_error` (dropped, not scored).
Not covered: test.sh runs the agent's programs in the same sandbox (that is what Harbor tests do), so a program
it runs can write the result file before test.sh writes its own, or tamper with the test files on disk while
tests run; a test.sh that writes its reward last (the usual pattern) overwrites such a forgery. A workspace
on PATH (an ENV PATH naming the workdir) lets the agent replace tools the tests call, as in Docker.
"""
from __future__ import annotations

import json
import math
import shlex

from envs.base import sandbox_problem
from envs.harbor import paths
from envs.harbor.loader import decode_files
from envs.sandbox.base import Limits, SandboxResult

COMMAND = f"bash {paths.WORK}/{paths.TESTS}/test.sh"


def exports(env: dict[str, str]) -> str:
    """Shell lines exporting `env` (values quoted)."""
    return "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())


def verifier_files(workspace_files: dict[str, bytes], payload: dict) -> dict[str, bytes]:
    """The verifier's scratch: the workspace copy, then the pristine tests (and nothing else under .mrl_)."""
    files = {p: d for p, d in workspace_files.items() if not p.startswith(".mrl_")}
    files.update(decode_files(payload.get("tests") or {}, prefix=f"{paths.TESTS}/"))
    return files


def parse_reward(files: dict[str, bytes]) -> tuple[float, str]:
    """(reward in [0, 1], reason) from reward.txt, else reward.json; (0, why) when there is none."""
    raw, name = files.get(paths.REWARD_TXT), "reward.txt"
    if raw is None:
        raw, name = files.get(paths.REWARD_JSON), "reward.json"
    if raw is None:
        return 0.0, "test.sh wrote no /logs/verifier/reward.txt"
    try:
        text = raw.decode("utf-8", "replace").strip()
        value = json.loads(text) if name == "reward.json" else float(text)
        if isinstance(value, dict):
            value = value.get("reward", next(iter(value.values()), None))
        value = float(value)
    except (ValueError, TypeError, StopIteration):
        return 0.0, f"unparsable {name}: {raw[:80]!r}"
    if not math.isfinite(value):
        return 0.0, f"{name} is not finite: {value}"
    return min(max(value, 0.0), 1.0), f"{name} = {value:g}"


def run_tests(sandbox, workspace_files: dict[str, bytes], payload: dict, limits: Limits
              ) -> tuple[float, str, str, SandboxResult]:
    """Run the task's tests over the workspace in a fresh sandbox: (reward, reason, status, result)."""
    env = {**(payload.get("env") or {}), **(payload.get("verifier_env") or {})}
    script = f"mkdir -p {paths.LOGS}/verifier\n{exports(env)}{COMMAND}\n"
    res = sandbox.run(script, files=verifier_files(workspace_files, payload), limits=limits,
                      collect=[paths.REWARD_TXT, paths.REWARD_JSON])
    problem = sandbox_problem(res)
    if problem and problem[1] != "ok":
        return 0.0, problem[0], problem[1], res
    reward, why = parse_reward(res.files)
    tail = (res.stdout + res.stderr)[-300:].strip()
    limit = f" ({problem[0]})" if problem else ""
    return (0.0 if problem else reward), f"{why}{limit}; test.sh exit {res.exit_code}: {tail}", "ok", res
