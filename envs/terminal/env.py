"""Terminal environment: a scratch workspace of files; the model runs shell commands over turns with
`<tool_call>{"name": "shell", "arguments": {"command": "..."}}</tool_call>`. Each command runs in a fresh
sandbox holding the workspace; the files afterwards (new, changed, deleted) are collected back, so the
workspace carries across turns while nothing else does (no background processes, no environment variables).
An action without a tool call ends the episode; so does the turn or token budget. Then a hidden verifier
command runs over the final workspace plus the verifier's own files: exit 0 is success.

Task payload: `files` (initial workspace, path -> text), `verify` ({"command": ..., "files": {...}}),
`reference_commands` (a known solution, for the suite's own tests; never shown).
Reward: `verified` (weight 1) the verifier's pass/fail.

THREAT MODEL of the reward (details in `envs.terminal.verifier`): trusted are the task's verifier files and
the worker; every workspace file is untrusted. The verifier runs in its own sandbox after the model's last
command, only over the task's pristine test files (copies written over the model's, read into memory and
removed before any workspace code runs; test files the model added never run), under an isolated
(`python3 -I -S`), non-dumpable harness. Each test file runs in a test process that never imports workspace
code: workspace modules are proxies answered by a separate candidate process with plain serialised values,
so the comparisons and the report are the test process's own (a module that patches `unittest` or writes a
report itself scores 0). Every process is killed before the verdict. Not covered: tests that need non-plain
values from workspace code (they fail with a reason).
"""
from __future__ import annotations

from megatron_rl.envs.base import ENVIRONMENTS, RewardComponent, RewardSpec, Tool, ToolEnvironment, Workspace
from megatron_rl.envs.sandbox.base import Limits

SHELL = Tool("shell", "Run a shell command (/bin/sh) in your workspace directory. No network. Each command starts "
             "in a fresh shell: files persist between commands, environment variables and processes do not.",
             {"type": "object", "additionalProperties": False, "required": ["command"],
              "properties": {"command": {"type": "string", "description": "the command line"}}})


@ENVIRONMENTS.register("terminal")
class TerminalEnv(ToolEnvironment):
    name = "terminal"
    success_component = "verified"
    tools = (SHELL,)
    limits = Limits(wall_s=15.0, cpu_s=10.0, memory_mb=512)
    instructions = ("You work in a terminal. Run a command with <tool_call>{\"name\": \"shell\", \"arguments\": "
                    "{\"command\": \"...\"}}</tool_call>; its output comes back in the next message. When the task "
                    "is done, reply without a tool call.")

    def reward_spec(self) -> RewardSpec:
        return RewardSpec([RewardComponent("verified", "verifier", 1.0)])

    def _start(self, task) -> None:
        self.workspace = Workspace()
        for path, content in (task.payload.get("files") or {}).items():
            self.workspace.write(path, content)

    def _reward_state(self) -> dict:
        return {"workspace": self.workspace, "limits": self.limits}

    def tool_shell(self, command: str) -> str:
        res, note = self.run_in_workspace(command)
        out = f"$ {command[:200]}\n"
        if res is not None:
            for stream in (res.stdout, res.stderr):
                if stream:
                    out += ("" if out.endswith("\n") else "\n") + stream[-3000:]
            out += ("" if out.endswith("\n") else "\n") + f"[exit code {res.exit_code}]"
        return out + (f"\n[note: {note}]" if note else "")
