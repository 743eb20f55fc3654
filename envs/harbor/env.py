"""Harbor environment: a Harbor task (Terminal-Bench 2.0 format) as a multi-turn shell episode.

The agent (the policy) gets the task's instruction.md and runs shell commands over turns with
`<tool_call>{"name": "shell", "arguments": {"command": "..."}}</tool_call>`; each command runs in a fresh
sandbox holding the workspace (the task's WORKDIR at /work, started from the Dockerfile's COPY'd files) - in the
task's image when its Dockerfile installs packages the host lacks (`envs.harbor.image`) -
with the Dockerfile's ENV exported, and the files are carried to the next turn (processes and shell state are
not). The episode ends on an action without a tool call, on the turn/token budget, or when the agent's time
(task.toml `[agent] timeout_sec`, capped) is spent. Then the task's tests run in a separate verifier sandbox
(`envs.harbor.verifier`) and their reward file is the reward (`tests`, weight 1; success = 1.0).

THREAT MODEL: each agent command is untrusted and runs under the sandbox's isolation (`envs.sandbox.bwrap`)
with the task's memory/cpu limits and a wall limit of min(command cap, agent time left); what the reward
trusts and what it does not is stated in `envs.harbor.verifier`. The agent never sees tests/ or solution/.
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.envs.base import (
    ENVIRONMENTS,
    EnvError,
    Observation,
    RewardComponent,
    RewardSpec,
    ToolEnvironment,
    Workspace,
)
from megatron_rl.envs.harbor.loader import decode_files
from megatron_rl.envs.sandbox.base import Limits, Sandbox
from megatron_rl.envs.terminal.env import SHELL


@dataclass
class HarborCaps:
    """Upper bounds on what a task.toml may ask for (a task asks for less: its own value is used)."""

    agent_s: float = 300.0
    """Agent wall time per episode, all commands together (seconds)."""
    command_s: float = 60.0
    """Wall time of one agent command (seconds)."""
    verifier_s: float = 120.0
    """Wall time of the tests (seconds)."""
    memory_mb: int = 2048
    """Memory of one sandbox run (MiB); also the default when task.toml names none."""
    scratch_mb: int = 256
    """Workspace + /tmp of one sandbox run (MiB); also the default when task.toml names none."""
    cpus: float = 2.0
    """CPU cores of one sandbox run."""
    workspace_bytes: int = 16 << 20
    """Workspace size carried between turns (bytes)."""


def sandbox_limits(task_limits: dict, caps: HarborCaps, wall_s: float) -> Limits:
    """The sandbox limits of one run: the task's memory/cpus/storage within `caps`, with this wall time."""
    mem = min(task_limits.get("memory_mb") or caps.memory_mb, caps.memory_mb)
    scratch = min(task_limits.get("storage_mb") or caps.scratch_mb, caps.scratch_mb)
    cpus = min(task_limits.get("cpus") or 1.0, caps.cpus)
    return Limits(wall_s=wall_s, cpu_s=wall_s * max(cpus, 1.0), memory_mb=mem, scratch_mb=scratch, cpus=cpus,
                  pids=256, file_size_mb=min(64, scratch))


def exports(env: dict[str, str]) -> str:
    """Shell lines exporting `env` (values quoted)."""
    return "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())


AGENT_SOURCE = Path(__file__).resolve().parents[1] / "agents" / "shell_agent.py"
"""The shell agent's program, copied into the sandbox (standard library only)."""


@ENVIRONMENTS.register("harbor")
class HarborEnv(ToolEnvironment):
    name = "harbor"
    success_component = "tests"
    tools = (SHELL,)
    agents = ("shell",)
    caps = HarborCaps()
    instructions = ("You work in a terminal; your working directory is /work. Run a command with <tool_call>"
                    "{\"name\": \"shell\", \"arguments\": {\"command\": \"...\"}}</tool_call>; its output comes back "
                    "in the next message. Each command starts in a fresh shell: files persist between commands; "
                    "environment variables, processes and empty directories do not. When the task is done, reply "
                    "without a tool call.")

    def reward_spec(self) -> RewardSpec:
        return RewardSpec([RewardComponent("tests", "harbor_tests", 1.0)])

    @property
    def sandbox(self) -> Sandbox:
        """The task's image sandbox when its environment/ needs packages the host lacks (payload["image"]:
        `envs.harbor.image`), for the agent's commands and the verifier alike; else the shared one."""
        image = self.task.payload.get("image") if self.task is not None else None
        if not image:
            return super().sandbox
        from megatron_rl.envs.sandbox.domain_images import image_sandbox

        return image_sandbox(image, workers=getattr(self._sandbox, "workers", 1))

    def _start(self, task) -> None:
        self.workspace = Workspace(max_bytes=self.caps.workspace_bytes, max_files=4096)
        for path, data in decode_files(task.payload.get("files") or {}).items():
            err = self.workspace.write(path, data)
            if err:
                raise EnvError(f"task {task.id}: its environment/ files do not fit the workspace: {err}")
        self.task_limits = task.payload.get("limits") or {}
        self.agent_s_left = min(float(self.task_limits.get("agent_s") or self.caps.agent_s), self.caps.agent_s)

    def _act(self, action: str) -> Observation | None:
        if self.agent_s_left <= 0:
            return None
        return super()._act(action)

    def agent_wall_s(self) -> float:
        return self.agent_s_left

    def run_agent(self, session, observation):
        """The shell agent (envs/agents/shell_agent.py) in one sandbox over the workspace, for the task's agent
        time: its first message is the reset observation (the prompt the loop renders), its tool the shell; it
        reaches the policy at /.sandbox/gateway.sock. The workspace it leaves is what the tests see."""
        task = {"messages": [{"role": observation.role, "content": observation.text}], "tools": observation.tools}
        files = {".mrl_agent/agent.py": AGENT_SOURCE.read_text(), ".mrl_agent/task.json": json.dumps(task)}
        cmd = (f"python3 -I .mrl_agent/agent.py --socket /.sandbox/gateway.sock --task .mrl_agent/task.json "
               f"--max-turns {self.budget.max_turns} --tool-timeout {self.caps.command_s:g} --quiet "
               f"{self.agent_args}")
        res, note = self.run_command(cmd, extra_files=files, wall_s=self.agent_s_left,
                                     sockets={"gateway.sock": session.bind})
        self.transcript.append(("agent", note or f"exit code {res.exit_code if res else '-'}"))
        return res

    def _reward_state(self) -> dict:
        wall = min(float(self.task_limits.get("verifier_s") or self.caps.verifier_s), self.caps.verifier_s)
        return {"workspace": self.workspace, "limits": sandbox_limits(self.task_limits, self.caps, wall)}

    def run_command(self, command: str, extra_files: dict | None = None, wall_s: float | None = None,
                    sockets: dict | None = None):
        """Run one agent command in the workspace with the task's ENV (at most `wall_s`, default the command
        cap); spends agent time."""
        wall = max(min(wall_s or self.caps.command_s, self.agent_s_left), 0.5)
        self.limits = sandbox_limits(self.task_limits, self.caps, wall)
        t0 = time.monotonic()
        res, note = self.run_in_workspace(exports(self.task.payload.get("env") or {}) + command, extra_files,
                                          sockets)
        self.agent_s_left -= time.monotonic() - t0
        if self.agent_s_left <= 0:
            note = "; ".join(filter(None, [note, "the agent time limit of this task is spent: the episode ends"]))
        return res, note

    def tool_shell(self, command: str) -> str:
        res, note = self.run_command(command)
        out = f"$ {command[:200]}\n"
        if res is not None:
            for stream in (res.stdout, res.stderr):
                if stream:
                    out += ("" if out.endswith("\n") else "\n") + stream[-3000:]
            out += ("" if out.endswith("\n") else "\n") + f"[exit code {res.exit_code}]"
        return out + (f"\n[note: {note}]" if note else "")
