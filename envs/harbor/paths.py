"""Where a Harbor task's absolute paths live in this sandbox.

Harbor tasks name absolute paths: the WORKDIR (conventionally /app), `/tests` (copied in for the verifier),
`/solution` (the oracle's) and `/logs/verifier/reward.txt` (the result). The bubblewrap sandbox has one writable
directory, `/work`, and a read-only root that a domain cannot add directories to, so the loader maps them:

    WORKDIR -> /work                 (the workspace: carried across turns, copied into the verifier)
    /tests     -> /work/.mrl_tests      /solution -> /work/.mrl_solution      /logs -> /work/.mrl_logs

and rewrites those prefixes in the instruction, tests/, solution/ and ENV values when a task is loaded
(a prefix only where it starts a path: `/app/x`, `"/app"`, `cd /app;` - never `/usr/app` or `$HOME/app`).
`.mrl_` paths never enter the workspace (`envs.workspace`), so the agent cannot plant tests or a result there.
An image builder that gives tasks their own root (real /app, /tests) can skip the rewrite (`rewrite=False`).
"""
from __future__ import annotations

import re

WORK = "/work"
TESTS, SOLUTION, LOGS = ".mrl_tests", ".mrl_solution", ".mrl_logs"
REWARD_TXT, REWARD_JSON = f"{LOGS}/verifier/reward.txt", f"{LOGS}/verifier/reward.json"


def mapping(workdir: str) -> dict[str, str]:
    """Absolute task path -> sandbox path, longest first."""
    m = {workdir: WORK, "/tests": f"{WORK}/{TESTS}", "/solution": f"{WORK}/{SOLUTION}", "/logs": f"{WORK}/{LOGS}"}
    return dict(sorted(m.items(), key=lambda kv: -len(kv[0])))


def rewrite(text: str, workdir: str) -> str:
    """`text` with the task's absolute paths replaced by their sandbox paths."""
    for src, dst in mapping(workdir).items():
        text = re.sub(rf"(?<![\w./$-]){re.escape(src)}(?=[/\s\"'`;:)|&,]|$)", dst, text)
    return text


def workspace_path(dest: str, workdir: str) -> str | None:
    """A COPY destination as a workspace-relative path; None when it is outside the workdir."""
    if dest.rstrip("/") == workdir:
        return ""
    if not dest.startswith(workdir.rstrip("/") + "/"):
        return None
    return dest[len(workdir.rstrip("/")) + 1:]
