"""The environment API: tasks, observations, steps, tools, budgets and composed rewards.

An episode is `obs = env.reset(task)` followed by `result = env.step(action)` until `result.done`.
Environments work on text: the worker tokenises, generates and passes the model's text back; every
`Observation.text` is model-visible (the worker appends it to the token sequence with loss_mask=0), while
`Observation.hidden` and `StepResult.info` are for logs and the trainer only.

Every action is untrusted model output. `Environment.step` never raises on anything the model writes:
malformed tool calls, unknown tools, bad arguments, crashing code and non-UTF-8 output become error
observations or zero rewards with a reason. Caller bugs (stepping a finished episode) do raise.

Rewards are named components with weights (`RewardSpec`); each component is a function from the
`envs.rewards.REWARDS` registry and returns a score, a reason and provenance (verifier version, judge
model). `RewardResult.status` is not "ok" (and `valid` is False) when infrastructure failed rather than
the model: "sandbox_error" (the sandbox could not run) or "error" (judge unreachable, bad task data, a
reward-function bug). Such a sample should be dropped, not trained on as a zero.
"""
from __future__ import annotations

import abc
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl.envs.reward_spec import RewardComponent, RewardContext, RewardSpec
from megatron_rl.envs.sandbox import SandboxConfig
from megatron_rl.envs.sandbox.base import Limits, Sandbox, SandboxResult
from megatron_rl.envs.tools import TOOL_CALL_RE, Tool, ToolCall, has_tool_call, parse_tool_calls
from megatron_rl.envs.types import EnvError, Observation, RewardOutput, RewardResult, StepResult, Task
from megatron_rl.envs.workspace import Workspace, safe_relpath, sandbox_problem
from megatron_rl.registry import Registry

__all__ = ["ENVIRONMENTS", "TOOL_CALL_RE", "Budget", "EnvError", "Environment", "Observation", "RewardComponent",
           "RewardContext", "RewardOutput", "RewardResult", "RewardSpec", "SingleTurnEnvironment", "StepResult",
           "Task", "Tool", "ToolCall", "ToolEnvironment", "Workspace", "has_tool_call", "make_env",
           "parse_tool_calls", "safe_relpath", "sandbox_problem"]

log = logging.getLogger(__name__)


@dataclass
class Budget:
    """Limits of one episode."""

    max_turns: int = 8
    """Most model actions per episode."""
    max_tokens: int = 4096
    """Most tokens per episode, model and observation tokens together."""
    max_observation_chars: int = 4000
    """Longer observations are truncated (head and tail kept) before the model sees them."""


def estimate_tokens(text: str) -> int:
    """Rough token count (bytes / 4) used when the worker passes no tokenizer-based counter."""
    return (len(text.encode("utf-8", "replace")) + 3) // 4


def truncate_middle(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"


_default_sandbox: Sandbox | None = None


def default_sandbox() -> Sandbox:
    """The process-wide default sandbox (`SandboxConfig()`: bubblewrap), built on first use by an environment
    that was given none."""
    global _default_sandbox
    if _default_sandbox is None:
        _default_sandbox = SandboxConfig().build()
    return _default_sandbox


class _LazySandbox(Sandbox):
    """The environment's sandbox as reward functions see it: resolved on first use (rewards that need none
    never build one); a backend that raises (unavailable, closed) gives a 'setup' violation instead."""

    def __init__(self, env: Environment):
        self._env = env

    @property
    def name(self) -> str:
        try:
            return self._env.sandbox.name
        except Exception:
            return "unavailable"

    @property
    def layer(self):
        """The environment's sandbox image (None without one, or when the sandbox cannot be built)."""
        try:
            return self._env.sandbox.layer
        except Exception:
            return None

    def zygote(self, name: str, source: str):
        """The environment's sandbox's forking service (None when it has none or cannot be built)."""
        try:
            return self._env.sandbox.zygote(name, source)
        except Exception as e:
            log.warning("%s: no sandbox zygote: %s", self._env.name, e)
            return None

    def run(self, command, files=None, limits=None, stdin=None, collect=None, sockets=None) -> SandboxResult:
        try:
            kw = {"sockets": sockets} if sockets else {}
            return self._env.sandbox.run(command, files=files, limits=limits, stdin=stdin, collect=collect, **kw)
        except Exception as e:
            log.warning("%s: sandbox failed: %s", self._env.name, e)
            return SandboxResult(-1, "", f"{e.__class__.__name__}: {e}", 0.0, violations=["setup"])


class Environment(abc.ABC):
    """Base class. Subclasses implement `reward_spec` and `_act`, and usually `_start` (per-episode state)
    and `_reward_state` (what their reward functions read besides the final response).

    One instance runs one episode at a time; `reset` starts a new one. Sandboxes and judges are shared
    and passed in; an environment holds nothing else between episodes.
    """

    name: str = "abstract"
    tools: tuple[Tool, ...] = ()
    """Tools the model may call (declared with JSON schemas)."""
    limits: Limits = Limits(wall_s=10.0, cpu_s=10.0)
    """Sandbox limits of one run."""
    instructions: str = ""
    """Format instructions appended to every task prompt (model-visible)."""
    success_component: str = "correct"
    """The reward component that says whether an episode solved its task (eval's pass@k)."""
    multi_turn: bool = False
    """Whether an episode may take more than one model turn."""
    agents: tuple[str, ...] = ()
    """Black-box agent programs that can play its episodes (`run_agent`; `envs.agents`)."""
    agent: str = ""
    """The agent playing this instance's episodes ('' = the loop's own turns: the model's replies are the
    actions); set from the domain config (envs.mixture.DomainConfig.agent)."""
    agent_args: str = ""
    """Extra command-line arguments of the agent program (DomainConfig.agent_args)."""

    def __init__(self, *, budget: Budget | None = None, sandbox: Sandbox | None = None, judge: Any = None,
                 reward_weights: dict[str, float] | None = None,
                 token_counter: Callable[[str], int] | None = None):
        self.budget = budget or Budget()
        self._sandbox = sandbox
        self.judge = judge
        self.spec = self.reward_spec().with_weights(reward_weights)
        self.count_tokens = token_counter or estimate_tokens
        self.task: Task | None = None
        self.done = True

    # ---- subclass hooks
    @abc.abstractmethod
    def reward_spec(self) -> RewardSpec:
        """The default reward composition of this environment."""

    @abc.abstractmethod
    def _act(self, action: str) -> Observation | None:
        """Apply one model action; return the next observation, or None when the episode is over."""

    def _start(self, task: Task) -> None:  # noqa: B027  (optional hook)
        """Set up per-episode state (workspace, tool state)."""

    def _reward_state(self) -> dict:
        return {}

    def render_prompt(self, task: Task) -> str:
        return f"{task.prompt}\n\n{self.instructions}" if self.instructions else task.prompt

    def compact_prompt(self, task: Task) -> str:
        """The short prompt of tiny byte-level models (a tokenizer without a chat template): the task's prompt."""
        return task.prompt + "\n"

    def reference_response(self, task: Task, corrupt: bool = False) -> str | None:
        """A response giving the task's reference answer (`payload.solution`) in this environment's answer format,
        which the supervised warm-up trains on; with `corrupt`, a wrong answer made from it (the warm-up checks
        that the reward rejects it). None: the environment has no such format (its tasks are not warmed up on)."""
        return None

    def run_agent(self, session, observation):
        """Run the black-box agent `self.agent` for the episode just reset, reaching the policy through
        `session` (an `envs.agents.session.AgentSession`); returns when the agent has ended."""
        raise EnvError(f"{self.name}: no black-box agent can play this environment")

    def agent_wall_s(self) -> float:
        """The agent's wall time for one episode (seconds)."""
        return 600.0

    def tool_summary(self) -> dict[str, float]:
        """This episode's tool use per tool: `tool.<name>.calls`, `tool.<name>.errors` (calls that did not run:
        unparsable, unknown tool, bad arguments, or the tool raised; an answer like "error: no such file" is a
        run) and `tool.<name>.latency_s` (summed); {} for an environment without tools. Names are sanitised."""
        out: dict[str, float] = {}
        for name, status, seconds in getattr(self, "tool_log", []):
            key = "tool." + re.sub(r"[^A-Za-z0-9_-]", "_", name)[:48]
            out[f"{key}.calls"] = out.get(f"{key}.calls", 0.0) + 1
            out[f"{key}.errors"] = out.get(f"{key}.errors", 0.0) + (status != "ok")
            out[f"{key}.latency_s"] = out.get(f"{key}.latency_s", 0.0) + seconds
        return out

    # ---- API
    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = default_sandbox()
        return self._sandbox

    def tool_schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools]

    def reset(self, task: Task) -> Observation:
        if task.domain != self.name:
            raise EnvError(f"task {task.id!r} is for domain {task.domain!r}, not {self.name!r}")
        self.task, self.done, self.turn = task, False, 0
        self.infra_status = "ok"  # set to sandbox_error when a sandbox failed during the episode
        self.transcript: list[tuple[str, str]] = []
        self.tool_log: list[tuple[str, str, float]] = []  # (tool, status, seconds) of every call this episode
        self.last_action = ""
        self._start(task)
        text = self.render_prompt(task)
        self.tokens = self.count_tokens(text)
        return Observation(text=text, role="user", tools=self.tool_schemas())

    def step(self, action: str | bytes, action_tokens: int | None = None) -> StepResult:
        """Apply the model's `action` text. `action_tokens`: its exact token count, when the worker knows it."""
        if self.task is None or self.done:
            raise EnvError(f"{self.name}: step() called {'before reset()' if self.task is None else 'after done'}")
        if isinstance(action, (bytes, bytearray, memoryview)):
            action = bytes(action).decode("utf-8", "replace")
        elif not isinstance(action, str):
            raise EnvError(f"{self.name}: step() takes the model's text (str or bytes), got {type(action).__name__}")
        self.turn += 1
        self.tokens += action_tokens if action_tokens is not None else self.count_tokens(action)
        self.transcript.append(("assistant", action))
        self.last_action = action
        try:
            obs = self._act(action)
        except Exception as e:  # an environment bug on odd input must not kill the worker
            log.exception("%s: environment error on task %s", self.name, self.task.id)
            return self._finish("error", error=f"{e.__class__.__name__}: {e}")
        if obs is None:
            return self._finish("ok")
        obs.text = truncate_middle(obs.text, self.budget.max_observation_chars)
        self.tokens += self.count_tokens(obs.text)
        self.transcript.append((obs.role, obs.text))
        if self.turn >= self.budget.max_turns or self.tokens >= self.budget.max_tokens:
            return self._finish("truncated")
        return StepResult(obs, 0.0, False, self._info("ok"))

    def success(self, result: RewardResult) -> bool:
        """Whether an episode with this reward solved its task: `success_component` scored 1 (full marks)."""
        return result.valid and result.components.get(self.success_component, 0.0) >= 1.0 - 1e-9

    def finish(self, status: str = "truncated") -> StepResult:
        """End the running episode now (the runner's token budget is spent) and score it."""
        if self.task is None or self.done:
            raise EnvError(f"{self.name}: finish() called {'before reset()' if self.task is None else 'after done'}")
        return self._finish(status)

    def score(self) -> RewardResult:
        ctx = RewardContext(task=self.task, response=self.last_action, transcript=list(self.transcript),
                            state=self._reward_state(), sandbox=_LazySandbox(self), judge=self.judge)
        return self.spec.compute(ctx)

    def _info(self, status: str, **extra) -> dict:
        return {"status": status, "turn": self.turn, "tokens": self.tokens, "env": self.name,
                "task_id": self.task.id, **extra}

    def _finish(self, status: str, **extra) -> StepResult:
        self.done = True
        if status == "error":
            rr = RewardResult(total=0.0, status="error", reasons={"env": extra.get("error", "")})
        else:
            try:
                rr = self.score()
            except Exception as e:  # a bug in the environment's reward state: drop the sample, keep the worker
                log.exception("%s: scoring failed on task %s", self.name, self.task.id)
                rr = RewardResult(total=0.0, status="error", reasons={"env": f"{e.__class__.__name__}: {e}"})
            if not rr.valid:
                status = rr.status
            elif self.infra_status != "ok":
                status = self.infra_status
        info = self._info(status, **extra)
        info["reward_components"] = dict(rr.components)
        return StepResult(None, rr.total, True, info, rr)


class SingleTurnEnvironment(Environment):
    """One model answer, then the reward."""

    def _act(self, action: str) -> Observation | None:
        return None


ENVIRONMENTS: Registry[type[Environment]] = Registry("environment", entry_point_group="megatron_rl.environments")


def make_env(name: str, agent: str = "", agent_args: str = "", **kwargs) -> Environment:
    """Build a registered environment by name; an unknown name is an error listing the known ones. `agent`:
    the black-box agent that plays its episodes (one of the environment's `agents`; '' = none)."""
    env = ENVIRONMENTS.get(name)(**kwargs)
    if agent and agent not in env.agents:
        raise EnvError(f"environment {name!r} cannot be played by agent {agent!r}; its agents: {list(env.agents)}")
    env.agent, env.agent_args = agent, agent_args
    return env


class ToolEnvironment(Environment):
    """Multi-turn: an action with `<tool_call>` blocks calls tools (results come back as a tool
    observation); an action without one is the final answer. Tool `x` is implemented by `tool_x(**args)`
    returning text; arguments are validated against the tool's JSON schema first."""

    multi_turn = True
    max_calls_per_turn: int = 4
    """Tool calls beyond this many in one action get an error instead of running."""

    def _validators(self) -> dict:
        import jsonschema

        cache = type(self).__dict__.get("_validator_cache")
        if cache is None:
            cache = {t.name: jsonschema.Draft202012Validator(t.parameters) for t in self.tools}
            type(self)._validator_cache = cache
        return cache

    def _act(self, action: str) -> Observation | None:
        if not has_tool_call(action):
            return None
        calls = parse_tool_calls(action)
        parts = []
        for c in calls[: self.max_calls_per_turn]:
            t0 = time.perf_counter()
            text, status = (f"<tool_error>{c.error}</tool_error>", "parse_error") if c.error else self._dispatch(c)
            self.tool_log.append((c.name or "(unparsed)", status, time.perf_counter() - t0))
            parts.append(text)
        if len(calls) > self.max_calls_per_turn:
            parts.append(f"<tool_error>only {self.max_calls_per_turn} tool calls run per turn; "
                         f"{len(calls) - self.max_calls_per_turn} ignored</tool_error>")
        n_err = sum(p.startswith("<tool_error>") for p in parts)
        return Observation("\n".join(parts), role="tool", hidden={"tool_errors": n_err})

    def run_in_workspace(self, command: str, extra_files: dict | None = None, sockets: dict | None = None
                         ) -> tuple[SandboxResult | None, str]:
        """Run `command` in the sandbox over `self.workspace`; returns (result, notes for the model). A sandbox
        that fails (raises, or cannot set up) marks the episode sandbox_error; the model sees a note."""
        try:
            res, err = self.workspace.run(self.sandbox, command, self.limits, extra_files, sockets)
        except Exception as e:  # run() raises only for caller/infrastructure errors, never for the program
            log.warning("%s: sandbox failed: %s", self.name, e)
            self.infra_status = "sandbox_error"
            return None, "the sandbox is unavailable (not your fault); try again"
        problem = sandbox_problem(res)
        if problem and problem[1] != "ok":
            self.infra_status = problem[1]
        notes = [problem[0]] if problem else []
        return res, "; ".join(notes + ([err] if err else []))

    def _dispatch(self, call: ToolCall) -> tuple[str, str]:
        """(text for the model, status): ok, unknown_tool, bad_arguments or error (the tool raised)."""
        validator = self._validators().get(call.name)
        if validator is None:
            known = ", ".join(t.name for t in self.tools)
            return f"<tool_error>unknown tool {call.name[:80]!r}; available tools: {known}</tool_error>", "unknown_tool"
        problems = [f"{'/'.join(map(str, e.path)) or 'arguments'}: {e.message[:160]}"
                    for e in validator.iter_errors(call.arguments)]
        if problems:
            return (f"<tool_error>bad arguments for {call.name}: {'; '.join(sorted(problems)[:3])}</tool_error>",
                    "bad_arguments")
        try:
            out = getattr(self, f"tool_{call.name}")(**call.arguments)
        except Exception as e:  # a tool failing on odd arguments is the model's problem, not the worker's
            log.debug("tool %s failed", call.name, exc_info=True)
            return f"<tool_error>{call.name} failed: {e.__class__.__name__}: {str(e)[:200]}</tool_error>", "error"
        return f'<tool_response name="{call.name}">\n{out}\n</tool_response>', "ok"
