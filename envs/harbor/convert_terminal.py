"""Convert the terminal domain's JSONL suite (envs/terminal/tasks/*.jsonl) into Harbor task folders.

    python -m envs.harbor.convert_terminal [--out envs/harbor/tasks]

Per task: `instruction.md` (the prompt), `task.toml` (its split in `[metadata] split`), `environment/Dockerfile`
(`FROM python:3.11-slim-bookworm`, `WORKDIR /app`, `COPY files/ /app/`) with the initial files under
`environment/files/`, `tests/` (the verifier's pristine test files, `run_tests.py`: every test they define must
run and pass, and `test.sh`, which writes the reward) and `solution/solve.sh` (the reference commands in /app).
The output is byte-stable: rerunning over the same suite rewrites the same files.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from envs.harbor.loader import TASKS_DIR
from envs.tasks import ENVS_DIR, load_tasks

RUN_TESTS = '''"""Run the pristine test files of /tests against the code in /app: exit 0 only when every test they
define (counted from their syntax tree) ran and passed, none skipped."""
import ast
import importlib.util
import os
import sys
import unittest

TESTS, APP = "/tests", "/app"


def expected(path):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return sum(1 for c in tree.body if isinstance(c, ast.ClassDef) for d in c.body
               if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.name.startswith("test"))


def load(path):
    name = "pristine_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return unittest.defaultTestLoader.loadTestsFromModule(mod)


os.chdir(APP)
sys.path.append(APP)
paths = [os.path.join(TESTS, f) for f in sorted(os.listdir(TESTS)) if f.startswith("test") and f.endswith(".py")]
want = sum(expected(p) for p in paths)
result = unittest.TextTestRunner(verbosity=1).run(unittest.TestSuite(load(p) for p in paths))
ok = want > 0 and result.testsRun == want and result.wasSuccessful() and not result.skipped
print("ran %d of %d tests: %s" % (result.testsRun, want, "passed" if ok else "FAILED"))
sys.exit(0 if ok else 1)
'''

TEST_SH = """#!/bin/bash
# The reward (1: every pristine test ran and passed, else 0) goes to /logs/verifier/reward.txt.
mkdir -p /logs/verifier
cd /app
if python3 -I -S /tests/run_tests.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""

DOCKERFILE = "FROM python:3.11-slim-bookworm\nWORKDIR /app\n"


def task_toml(split: str, source: str) -> str:
    return (f'version = "1.0"\n\n[metadata]\nauthor_name = "megatron-rl"\ncategory = "debugging"\n'
            f'split = "{split}"\nsource = "{source}"\n\n[verifier]\ntimeout_sec = 60.0\n\n[agent]\n'
            'timeout_sec = 180.0\n\n[environment]\ncpus = 1\nmemory_mb = 512\nstorage_mb = 64\n')


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def convert(task, out: Path) -> Path:
    """Write one terminal task as a Harbor task folder under `out`."""
    d = out / task.id
    if d.exists():
        shutil.rmtree(d)
    p = task.payload
    files = p.get("files") or {}
    write(d / "instruction.md", f"{task.prompt}\n\nYou work in `/app`.\n")
    write(d / "task.toml", task_toml(task.split, Path(task.source.split(":")[0]).relative_to(ENVS_DIR.parent)
                                     .as_posix()))
    write(d / "environment/Dockerfile", DOCKERFILE + ("COPY files/ /app/\n" if files else ""))
    for rel, text in files.items():
        write(d / "environment/files" / rel, text)
    for rel, text in (p["verify"].get("files") or {}).items():
        write(d / "tests" / rel, text)
    write(d / "tests/run_tests.py", RUN_TESTS)
    write(d / "tests/test.sh", TEST_SH)
    write(d / "solution/solve.sh", "#!/bin/bash\nset -e\ncd /app\n" + "\n".join(p["reference_commands"]) + "\n")
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(TASKS_DIR), help="folder of task folders (default: the shipped suite)")
    args = ap.parse_args(argv)
    files = sorted((ENVS_DIR / "terminal" / "tasks").glob("*.jsonl"))
    tasks = load_tasks(files, domain="terminal")
    for t in tasks:
        convert(t, Path(args.out))
    print(f"wrote {len(tasks)} Harbor task folders to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
