"""The harbor domain: Harbor task folders loaded (Dockerfile subset, host packages, path mapping), every shipped
task's reference solution passing its tests in the verifier sandbox while an empty attempt fails, refusals
naming the instruction, episodes through the RL loop's in-process path (a scripted engine, as in
tests/loop/test_multiturn.py; everything else real: bubblewrap, the env, the verifier, `Rollouts`, the runner) and
eval's per-task table.
"""
from __future__ import annotations

import json
import re
import shlex

import pytest

from megatron_rl.envs.harbor import paths
from megatron_rl.envs.harbor.host import MissingPackage
from megatron_rl.envs.harbor.loader import TASKS_DIR, HarborTaskError, load_harbor, load_task_folder
from megatron_rl.envs.harbor.spec import EnvironmentSpec, UnsupportedInstruction, parse_dockerfile
from tests.loop.test_multiturn import _rollouts  # the scripted engine (a test double of RolloutEngine)

FAST_TASKS = ["fix-inventory-package", "csv-sales-report"]


@pytest.fixture(scope="module")
def suite():
    return {t.id: t for t in load_harbor()}


def _task_folder(root, dockerfile, test_sh="#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n", toml=""):
    d = root / "t1"
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "instruction.md").write_text("Do it in /app.\n")
    (d / "task.toml").write_text('version = "1.0"\n' + toml)
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    (d / "tests" / "test.sh").write_text(test_sh)
    return d


# ----------------------------------------------------------------------------------------------- the suite
def test_shipped_suite_ids_splits_and_solutions(suite):
    folders = sorted(p.name for p in TASKS_DIR.iterdir() if (p / "task.toml").is_file())
    assert sorted(suite) == folders and len(folders) >= 24
    assert len([n for n in folders if not n.startswith("terminal-")]) >= 10
    assert len([n for n in folders if n.startswith("terminal-")]) == 14  # the converted terminal suite
    for t in suite.values():
        assert t.domain == "harbor" and t.payload["solution"]["text"]["solve.sh"]
        assert not re.search(r"(?<![\w.])/app\b", t.prompt) and "test.sh" in t.payload["tests"]["text"]
    heldout = {t.id for t in suite.values() if t.split == "heldout"}
    assert {"terminal-fix-csv-fields", "terminal-edit-version-bump", "tiny-http-service"} <= heldout  # metadata.split
    assert "fix-env-settings" in heldout  # no metadata.split: the sha256 rule


def test_converted_terminal_tasks_match_the_jsonl_suite(suite):
    from megatron_rl.envs.tasks import load_domain

    for t in load_domain("terminal"):
        h = suite[t.id]
        assert h.split == t.split and h.prompt.startswith(t.prompt)
        files = {k: v for k, v in h.payload["files"]["text"].items()}
        assert files == {k: paths.rewrite(v, "/app") for k, v in t.payload["files"].items()}
        assert set(t.payload["verify"]["files"]) < set(h.payload["tests"]["text"])


def _check_solution_and_empty(task, sandbox):
    from megatron_rl.envs.harbor.oracle import attempt

    solved, res = attempt(task, sandbox, solve=True)
    assert res is not None and res.exit_code == 0, (res.stdout[-400:], res.stderr[-400:])
    assert solved.valid and solved.total == 1.0 and solved.components["tests"] == 1.0, solved.reasons
    empty, _ = attempt(task, sandbox, solve=False)
    assert empty.valid and empty.total == 0.0, empty.reasons
    assert "reward.txt = 0" in empty.reasons["tests"]  # test.sh ran and said no (not a missing result)


@pytest.mark.parametrize("name", FAST_TASKS)
def test_reference_solution_passes_and_empty_attempt_fails(suite, sandbox, name):
    _check_solution_and_empty(suite[name], sandbox)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(p.name for p in TASKS_DIR.iterdir() if (p / "task.toml").is_file()))
def test_every_shipped_task_reference_passes_and_empty_fails(suite, sandbox, name):
    _check_solution_and_empty(suite[name], sandbox)


# ------------------------------------------------------------------------------------- environment/ spec
def test_dockerfile_subset_is_parsed_into_a_spec():
    spec = parse_dockerfile(
        "# comment\nFROM python:3.11-slim-bookworm\n"
        "RUN apt-get update -qq && apt-get install -y --no-install-recommends \\\n"
        "    jq make && rm -rf /var/lib/apt/lists/*\n"
        "RUN pip install --no-cache-dir setuptools==66.1.1\n"
        "WORKDIR /srv\nCOPY a.py b/ ./\nENV A=1 B=two\nENV C some words\n")
    assert spec.base == "python:3.11-slim-bookworm" and spec.apt == ["jq", "make"]
    assert spec.pip == ["setuptools==66.1.1"] and spec.workdir == "/srv"
    assert spec.copies == [("a.py", "/srv/"), ("b", "/srv/")] and spec.env == {"A": "1", "B": "two",
                                                                                 "C": "some words"}
    assert EnvironmentSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("line, why", [
    ("USER app", "instruction USER"), ("EXPOSE 8080", "instruction EXPOSE"), ("ADD x.tgz /app/", "instruction ADD"),
    ("RUN curl -fsSL https://x.sh | sh", "RUN may only chain"), ("RUN make build", "not a package install"),
    ("COPY --from=builder /out /app/", "COPY takes"), ("CMD [\"python3\"]", "instruction CMD"),
    ("RUN pip install -r requirements.txt", "not a package install"), ("RUN rm -rf /", "not a package install"),
])
def test_unsupported_instruction_is_refused_with_its_line(tmp_path, line, why):
    d = _task_folder(tmp_path, f"FROM debian:bookworm\nWORKDIR /app\n{line}\n")
    with pytest.raises(UnsupportedInstruction) as e:
        load_harbor([tmp_path])
    assert f"Dockerfile:3: {line[:40]!r}"[:-1] in str(e.value) and why in str(e.value) and str(d) in str(e.value)


@pytest.mark.parametrize("dockerfile, name", [
    ("FROM ubuntu:24.04\n", "Debian base"), ("FROM debian:bookworm AS build\nFROM debian:bookworm\n", "Debian base"),
    ("FROM debian:bookworm\nCOPY x /etc/x\n", "outside WORKDIR"),
])
def test_other_refusals_name_the_reason(tmp_path, dockerfile, name):
    d = _task_folder(tmp_path, dockerfile)
    (d / "environment" / "x").write_text("x")
    with pytest.raises(UnsupportedInstruction, match=name):
        load_task_folder(d)


@pytest.mark.parametrize("line, name", [
    ("RUN apt-get install -y mrl-no-such-package", "apt package 'mrl-no-such-package'"),
    ("RUN pip install mrl-no-such-dist==1.0", "pip package 'mrl-no-such-dist==1.0'"),
    ("RUN apt-get install -y bash=0.0-not-this", "apt package 'bash=0.0-not-this'"),
])
def test_task_whose_packages_are_missing_on_the_host_is_refused_naming_them(tmp_path, line, name):
    d = _task_folder(tmp_path, f"FROM debian:bookworm\n{line}\n")
    with pytest.raises(MissingPackage, match=name):
        load_task_folder(d)
    assert load_task_folder(d, check=False).payload["spec"]["base"] == "debian:bookworm"  # the spec alone parses


def test_python_base_must_match_the_host(tmp_path):
    with pytest.raises(MissingPackage, match="FROM python:3.2-slim needs python 3.2"):
        load_task_folder(_task_folder(tmp_path, "FROM python:3.2-slim\n"))


def test_malformed_folders_name_the_file(tmp_path):
    d = _task_folder(tmp_path, "FROM debian:bookworm\n", toml="[agent]\ntimeout_sec = 'x'\n")
    with pytest.raises(HarborTaskError, match="task.toml"):
        load_task_folder(d)
    (d / "task.toml").write_text("[environment]\ngpus = 1\n")
    with pytest.raises(HarborTaskError, match="GPUs"):
        load_task_folder(d)
    (d / "task.toml").write_text("")
    (d / "tests" / "test.sh").unlink()
    with pytest.raises(HarborTaskError, match="missing tests/test.sh"):
        load_task_folder(d)


def test_paths_are_mapped_only_where_they_start_a_path():
    text = 'cd /app && cat "/app/x" /tests/a.sh > /logs/verifier/reward.txt; ls /usr/app $HOME/app /appx ./app/y'
    assert paths.rewrite(text, "/app") == ('cd /work && cat "/work/x" /work/.mrl_tests/a.sh > '
                                           '/work/.mrl_logs/verifier/reward.txt; ls /usr/app $HOME/app /appx ./app/y')


@pytest.mark.slow
def test_task_toml_limits_and_env_reach_the_sandbox(tmp_path, sandbox):
    """memory/cpus/timeouts come from task.toml (within the caps); ENV is exported; the agent's time runs out."""
    from megatron_rl.envs.harbor.env import HarborEnv

    d = _task_folder(tmp_path, "FROM debian:bookworm\nWORKDIR /app\nENV GREETING=hello\nCOPY data /app/in/\n",
                     toml="[agent]\ntimeout_sec = 1.5\n[verifier]\ntimeout_sec = 7.0\n[environment]\nmemory = '1G'\n"
                          "cpus = 1\n")
    (d / "environment" / "data").write_text("42\n")
    task = load_task_folder(d)
    assert task.payload["limits"] == {"agent_s": 1.5, "verifier_s": 7.0, "cpus": 1.0, "memory_mb": 1024,
                                      "storage_mb": None}
    env = HarborEnv(sandbox=sandbox)
    env.reset(task)
    call = '<tool_call>{"name": "shell", "arguments": {"command": "echo $GREETING; cat in/data; sleep 3"}}</tool_call>'
    r = env.step(call)
    assert "hello\n42" in r.observation.text and "time limit" in r.observation.text
    assert env.limits.memory_mb == 1024 and env.limits.wall_s == 1.5
    end = env.step(call)  # no agent time left: the episode ends without running it, and is scored
    assert end.done and end.reward == 1.0 and env._reward_state()["limits"].wall_s == 7.0


# ---------------------------------------------------------------------------------------------- the reward
def test_a_reward_the_agent_plants_is_not_the_reward(suite, sandbox):
    """The agent writes reward files where the verifier reads them and a test.sh of its own: score 0."""
    from megatron_rl.envs.harbor.env import HarborEnv

    env = HarborEnv(sandbox=sandbox)
    env.reset(suite["csv-sales-report"])
    plant = ("mkdir -p /work/.mrl_logs/verifier /work/.mrl_tests logs/verifier tests && for f in "
             "/work/.mrl_logs/verifier/reward.txt logs/verifier/reward.txt; do echo 1 > $f; done && "
             "printf 'echo 1 > /work/.mrl_logs/verifier/reward.txt' | tee tests/test.sh > /work/.mrl_tests/test.sh")
    env.step(_shell(plant))
    assert "logs/verifier/reward.txt" in env.workspace.files and not any(p.startswith(".mrl_")
                                                                         for p in env.workspace.files)
    end = env.step("Done.")
    assert end.done and end.reward == 0.0 and "reward.txt = 0" in end.reward_result.reasons["tests"]


ATTACKS = {
    "honest": "open('/app/ok', 'w').close()",
    "rewrite test.sh": ("p = '/tests/test.sh'\ns = open(p).read().replace('echo 0 >', 'echo 1 >')\n"
                        "f = open(p, 'r+')\nf.write(s)\nf.close()"),  # same length, same inode: bash would read it
    "forge the verdict": ("import json, os\nline = '\\nMRL-HARBOR-VERDICT ' + json.dumps({'rc': 0, 'txt': '1'})\n"
                          "print(line)\nfor p in (os.getppid(), 1, 2):\n    try:\n"
                          "        open(f'/proc/{p}/fd/1', 'w').write(line + '\\n')\n"
                          "    except OSError:\n        pass"),
    "kill test.sh": ("import os, signal\nopen('/work/.mrl_logs/verifier/reward.txt', 'w').write('1')\n"
                     "os.kill(os.getppid(), signal.SIGKILL)"),
    # a daemon holds a FIFO at the result path with '1' queued: test.sh's '0' lands behind it
    "a FIFO at the result path": ("import os, time\np = '/work/.mrl_logs/verifier/reward.txt'\nos.mkfifo(p)\n"
                                  "if os.fork() == 0:\n    os.setsid()\n    fd = os.open(p, os.O_RDWR)\n"
                                  "    os.write(fd, b'1' + b'\\n' * 4095)\n    time.sleep(60)"),
    # a daemon that rewrites the result in a loop, before and after test.sh's own write
    "a daemon rewriting the result in a loop": (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    while True:\n        try:\n"
        "            with open('/work/.mrl_logs/verifier/r', 'w') as f:\n                f.write('1')\n"
        "            os.replace('/work/.mrl_logs/verifier/r', '/work/.mrl_logs/verifier/reward.txt')\n"
        "        except OSError:\n            pass"),
    # the result written early and made read-only (test.sh's own write then fails), or its folder
    "a read-only result": ("import os\np = '/work/.mrl_logs/verifier/reward.txt'\nopen(p, 'w').write('1')\n"
                           "os.chmod(p, 0o444)\nos.chmod(os.path.dirname(p), 0o555)"),
    # a reward.txt planted next to the reward.json a test.sh writes (reward.txt is read first)
    "a planted reward.txt": "open('/work/.mrl_logs/verifier/reward.txt', 'w').write('1')",
    # a daemon stops the harness, waits for test.sh to exit, writes 1 late, continues the harness
    "a late write while the harness is stopped": (
        "import os, signal, time\nbash = os.getppid()\n"
        "st = lambda pid: open('/proc/%d/stat' % pid).read().rsplit(')', 1)[1].split()\n"
        "harness = int(st(bash)[1])\n"
        "if os.fork() == 0:\n    os.setsid()\n    os.kill(harness, signal.SIGSTOP)\n"
        "    while st(bash)[0] != 'Z':\n        time.sleep(0.01)\n"
        "    open('/work/.mrl_logs/verifier/reward.txt', 'w').write('1')\n"
        "    os.kill(harness, signal.SIGCONT)\n    time.sleep(60)"),
}


# the late write waits for test.sh to exit under a stopped harness: ~4 s, in the slow tier
@pytest.mark.parametrize("attack", [pytest.param(a, marks=pytest.mark.slow) if a.startswith("a late write") else a
                                    for a in sorted(ATTACKS)])
def test_programs_the_tests_run_cannot_forge_the_verdict(tmp_path, sandbox, attack):
    """test.sh runs the agent's prog.py, then writes 1 only if /app/ok exists: rewriting test.sh on disk while
    bash runs it, forging the harness's verdict line, writing reward 1 and killing test.sh, or a process left
    behind that owns the result path (a FIFO, a rewrite loop, a late write while the harness is stopped) all
    score 0."""
    from megatron_rl.envs.harbor.oracle import attempt

    sh = ("#!/bin/bash\npython3 /app/prog.py\nsleep 0.2\nif [ -f /app/ok ]; then echo 1 > /logs/verifier/reward.txt;"
          " else echo 0 > /logs/verifier/reward.txt; fi\n")
    if attack == "a planted reward.txt":
        sh = "#!/bin/bash\npython3 /app/prog.py\necho '{\"reward\": 0}' > /logs/verifier/reward.json\n"
    d = _task_folder(tmp_path, "FROM debian:bookworm\nWORKDIR /app\nCOPY prog.py /app/\n", test_sh=sh,
                     toml="[verifier]\ntimeout_sec = 4.0\n")
    (d / "environment" / "prog.py").write_text(ATTACKS[attack] + "\n")
    rr, _ = attempt(load_task_folder(d), sandbox, solve=False)
    assert rr.valid and rr.total == (1.0 if attack == "honest" else 0.0), rr.reasons


@pytest.mark.parametrize("attack", ["import os\nos._exit(0)\n",
                                    "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"])
def test_converted_terminal_task_module_cannot_decide_its_own_tests(suite, sandbox, attack):
    """The module under test exits 0 on import or patches unittest: the pristine tests (run_tests.py) never import
    it in the process whose exit status test.sh trusts, so the wrong fix still scores 0."""
    from megatron_rl.envs.harbor.env import HarborEnv

    env = HarborEnv(sandbox=sandbox)
    env.reset(suite["terminal-fix-median"])
    module = attack + "def median(xs):\n    return 0\n"
    env.step(_shell(f"printf %s {shlex.quote(module)} > stats.py"))
    end = env.step("Done.")
    assert end.done and end.reward == 0.0, end.reward_result.reasons


def test_reward_files_parsed_missing_or_bad_ones_score_zero_not_an_infra_error(tmp_path, sandbox):
    from megatron_rl.envs.harbor.oracle import attempt

    for body, why in [("echo lots > /logs/verifier/reward.txt", "unparsable"), ("exit 0", "wrote no"),
                      ('D="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"; cat "$D/r" > /logs/verifier/reward.txt',
                       "reward.txt = 0.5"),
                      ("echo '{\"reward\": 0.75}' > /logs/verifier/reward.json", "reward.json = 0.75")]:
        root = tmp_path / why.split()[0]
        d = _task_folder(root, "FROM debian:bookworm\n", test_sh=f"#!/bin/bash\n{body}\n")
        (d / "tests" / "r").write_text("0.5\n")  # next to test.sh, found through BASH_SOURCE
        rr, _ = attempt(load_task_folder(d), sandbox, solve=False)
        assert rr.valid and why in rr.reasons["tests"], rr.reasons
        assert rr.total == {"reward.json = 0.75": 0.75, "reward.txt = 0.5": 0.5}.get(why, 0.0)


# ------------------------------------------------------------------------------ episodes through the RL loop
def _shell(command: str) -> str:
    return "<tool_call>" + json.dumps({"name": "shell", "arguments": {"command": command}}) + "</tool_call>"


@pytest.mark.parametrize("solve", [True, False])
def test_harbor_episode_through_the_rl_loops_in_process_path(hf_tok, suite, solve):
    from megatron_rl.envs.sampler import DomainSampler
    from megatron_rl.envs.sandbox import SandboxConfig
    from megatron_rl.loop.episodes import ThreadEpisodeRunner

    task = suite["fix-env-settings"]
    fix = task.payload["solution"]["text"]["solve.sh"]
    script = [_shell("cat settings.py"), _shell(fix if solve else "echo nothing to do"), "Done."]
    runner = ThreadEpisodeRunner(SandboxConfig(), 2)
    try:
        rollouts = _rollouts(hf_tok, runner, script=script)
        rollouts.submit(0, [task])
        groups, _ = rollouts.batch(0, DomainSampler({"harbor": [task]}, seed=0))
    finally:
        runner.close()
    (g,) = groups
    assert g.turns == [3, 3] and [r[2] for r in g.rewards] == ["ok", "ok"]
    assert [r[0] for r in g.rewards] == [1.0 if solve else 0.0] * 2
    text = hf_tok.decode(g.prompt + list(g.samples[0].token_ids))
    assert 'os.environ.get("MODE"' in text and "[exit code 0]" in text  # turn 1's observation is in the sequence


@pytest.mark.slow
def test_eval_per_task_table_for_a_scripted_run(hf_tok, suite, tmp_path):
    """heldout_run on two tasks with a script that solves one: per-task and overall pass@1/pass@k, greedy, the
    markdown table and JSON."""
    from megatron_rl.envs.sandbox import SandboxConfig
    from megatron_rl.eval_report import write_report
    from megatron_rl.loop.episodes import ThreadEpisodeRunner
    from megatron_rl.loop.evaluation import heldout_run
    from megatron_rl.run_config import RunConfig

    tasks = [suite["fix-env-settings"], suite["csv-sales-report"]]
    script = [_shell(tasks[0].payload["solution"]["text"]["solve.sh"]), "Done."]
    runner = ThreadEpisodeRunner(SandboxConfig(), 2)
    try:
        rollouts = _rollouts(hf_tok, runner, script=script)
        cfg = RunConfig()
        cfg.eval.k, cfg.rl.max_new_tokens = 2, 256
        metrics, rows = heldout_run(rollouts, tasks, cfg, tag="ev")
    finally:
        runner.close()
    assert [(r["task"], r["greedy"], r["samples"], r["solved"], r["pass@1"], r["pass@2"]) for r in rows] == [
        ("fix-env-settings", 1, 2, 2, 1.0, 1.0), ("csv-sales-report", 0, 2, 0, 0.0, 0.0)]
    assert metrics["harbor/pass@1"] == metrics["pass@2"] == 0.5 and metrics["success_greedy"] == 0.5
    report = write_report(tmp_path / "eval.json", rows, 2, with_plot=False)  # the plot: the slow CLI test
    md = (tmp_path / "eval_tasks.md").read_text()
    assert "| fix-env-settings | harbor | 1 | 2 | 2 | 1.000 | 1.000 |" in md
    assert "| **all** (2/2 scored) | | 0.500 | | | 0.500 | 0.500 |" in md
    saved = json.loads((tmp_path / "eval_tasks.json").read_text())
    assert saved["summary"]["harbor"]["pass@2"] == 0.5 and saved["tasks"] == rows
    assert report["markdown"] == str(tmp_path / "eval_tasks.md") and not (tmp_path / "eval_tasks.png").exists()


def test_pass_at_k_estimator():
    from megatron_rl.eval_report import pass_at_k

    assert pass_at_k(5, 2, 2) == pytest.approx(0.7) and pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(1, 1, 4) == 1.0 and pass_at_k(0, 0, 1) == 0.0


def test_eval_command_takes_an_hf_folder_without_a_checkpoint(tmp_path):
    from megatron_rl import config as C
    from megatron_rl.commands import eval as ev
    from megatron_rl.run_config import RunConfig

    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(f"name: r\noutput_dir: {tmp_path}\n")
    args = ev.parse_args([str(cfg_path), "--hf", str(tmp_path), "--domains", "harbor"])
    plan = ev._plan(C.load(RunConfig, str(cfg_path), []), args)
    assert plan["checkpoint"] is None and "harbor" in plan["domains"]
    assert plan["out"] == tmp_path / "r" / "eval.json"
    with pytest.raises(C.ConfigError, match="no checkpoint"):
        ev._plan(C.load(RunConfig, str(cfg_path), []), ev.parse_args([str(cfg_path)]))
    assert "--hf" in ev._argv(args)


@pytest.mark.slow
@pytest.mark.multiproc
def test_eval_cli_on_harbor_tasks_from_an_hf_folder(tmp_path):
    """`megatron-rl eval --hf DIR --domains harbor` (no RL checkpoint): a random tiny model through the real
    engine and episode runner; eval.json, the per-task table (printed and written) and the plot."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.hf_tiny import tiny_llama, tiny_tokenizer

    hf = tmp_path / "hf"
    hf.mkdir()
    tiny_llama(hf, tiny_tokenizer(hf), max_positions=4096)
    exe, repo = str(Path(sys.executable).parent / "megatron-rl"), Path(__file__).resolve().parents[2]
    proc = subprocess.run([exe, "eval", "configs/post_train_cpu.yaml", f"output_dir={tmp_path}", "eval.tasks=3",
                           "eval.k=2", "model.max_seq_length=2048", "rl.max_new_tokens=24", "engine.num_blocks=512",
                           "--hf", str(hf), "--domains", "harbor"], cwd=repo, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "post_train"
    got = json.loads((run / "eval.json").read_text())
    assert got["checkpoint"] is None and got["model_init"] == f"hf:{hf}" and got["domains"]["harbor"]["tasks"] == 3
    rows = json.loads((run / "eval_tasks.json").read_text())["tasks"]
    assert sorted(r["task"] for r in rows if r["domain"] == "harbor") == sorted(
        t.id for t in load_harbor(split="heldout"))[:3]
    assert all(r["samples"] == 2 for r in rows)  # every episode scored (a random model: no infra failure)
    assert "| **harbor** (3/3 scored) |" in proc.stdout and (run / "eval_tasks.png").stat().st_size > 1000


def test_a_folder_of_tasks_is_a_mixture_domain(tmp_path):
    from megatron_rl.envs.mixture import DomainConfig, MixtureConfig

    for name, split in (("a", "train"), ("b", "heldout")):
        d = _task_folder(tmp_path / name, "FROM debian:bookworm\n", toml=f'[metadata]\nsplit = "{split}"\n')
        d.rename(tmp_path / f"task-{name}")
    mix = MixtureConfig(domains={"harbor": DomainConfig(task_files=[str(tmp_path)])})
    mix.validate()
    assert [t.id for t in mix.tasks("train")["harbor"]] == ["task-a"]
    assert [t.id for t in mix.tasks("heldout")["harbor"]] == ["task-b"]
    env = mix.build_env("harbor", 4096)
    assert env.name == "harbor" and env.budget.max_turns == 4


def test_converter_reproduces_the_committed_terminal_folders(tmp_path):
    from megatron_rl.envs.harbor.convert_terminal import main

    assert main(["--out", str(tmp_path)]) == 0
    made = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert len({m.split("/")[0] for m in made}) == 14
    for rel in made:
        assert (tmp_path / rel).read_bytes() == (TASKS_DIR / rel).read_bytes(), rel
    shipped = sorted(p.relative_to(TASKS_DIR).as_posix() for p in TASKS_DIR.rglob("*")
                     if p.is_file() and p.parts[len(TASKS_DIR.parts)].startswith("terminal-"))
    assert shipped == made  # nothing extra committed either
