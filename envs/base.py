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
import base64
import dataclasses
import json
import logging
import posixpath
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from envs.sandbox import SandboxConfig
from envs.sandbox.base import Limits, Sandbox, SandboxResult
from megatron_rl.registry import Registry

log = logging.getLogger(__name__)


class EnvError(RuntimeError):
    """A caller error: stepping a finished episode, a bad task payload, a bad environment option."""


# --------------------------------------------------------------------------------------------- data
@dataclass
class Task:
    """One task of a suite: the prompt the model sees and the hidden payload its verifier uses."""

    id: str
    """Unique id within its domain."""
    domain: str
    """The environment (registry name) that runs this task."""
    prompt: str
    """Model-visible task text."""
    payload: dict = field(default_factory=dict)
    """Hidden data for the environment and its verifiers (tests, answers, files); never shown as is."""
    split: str = "train"
    """Which split the task belongs to: train or heldout."""
    source: str = ""
    """Where the task was loaded from, as file:line (for error messages)."""

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "source"}


@dataclass
class Observation:
    """What the environment returns to the worker after reset or a step."""

    text: str
    """Model-visible text; the worker tokenises it and appends it with loss_mask=0."""
    role: str = "user"
    """Chat role for the text: user (task prompt), tool (tool/shell results)."""
    tools: list[dict] = field(default_factory=list)
    """Tool schemas (OpenAI function format) to render into the chat template; set on reset only."""
    hidden: dict = field(default_factory=dict)
    """Not model-visible: details for logs (raw tool output, errors)."""


@dataclass
class RewardOutput:
    """What one reward function returns."""

    score: float
    """Score, usually in [0, 1]."""
    reason: str = ""
    """Why this score (for logs): e.g. '3/4 tests passed', 'no \\boxed{} answer'."""
    provenance: dict = field(default_factory=dict)
    """Verifier name/version, judge model/version, library versions."""
    status: str = "ok"
    """ok; sandbox_error (the sandbox failed) or error (judge down, bad task data): the score means nothing."""

    @property
    def valid(self) -> bool:
        return self.status == "ok"


@dataclass
class RewardResult:
    """The composed reward of an episode: total, named components and their provenance."""

    total: float
    """Weighted sum of the components."""
    components: dict[str, float] = field(default_factory=dict)
    """Unweighted score per component name."""
    weights: dict[str, float] = field(default_factory=dict)
    """Weight per component name."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Reason per component name."""
    provenance: dict[str, dict] = field(default_factory=dict)
    """Provenance per component name."""
    status: str = "ok"
    """ok, or the first failing component's status (sandbox_error, error): drop such a sample."""

    @property
    def valid(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class StepResult:
    """What `Environment.step` returns."""

    observation: Observation | None
    """Next model-visible observation; None when the episode is done."""
    reward: float
    """Total reward (0.0 until the episode is done)."""
    done: bool
    """True when the episode ended (final answer, budget exhausted, or an error)."""
    info: dict = field(default_factory=dict)
    """status (a shard status: ok, truncated, sandbox_error, error), turn, tokens, errors; not model-visible."""
    reward_result: RewardResult | None = None
    """The composed reward with components and provenance, when done."""


# ------------------------------------------------------------------------------------------ rewards
@dataclass
class RewardComponent:
    """One named reward component: a registered reward function, its weight and parameters."""

    name: str
    """Component name (a column in the trajectory shard)."""
    fn: str
    """Name of the reward function in `envs.rewards.REWARDS`."""
    weight: float = 1.0
    """Weight in the total."""
    params: dict = field(default_factory=dict)
    """Keyword arguments passed to the reward function."""


@dataclass
class RewardContext:
    """Everything a reward function may look at."""

    task: Task
    """The task of the episode (its payload holds the hidden answers/tests)."""
    response: str
    """The model's final action text."""
    transcript: list[tuple[str, str]] = field(default_factory=list)
    """(role, text) of the whole episode: ('assistant', ...), ('tool', ...)."""
    state: dict = field(default_factory=dict)
    """Environment-specific state (workspace files, extracted answer)."""
    sandbox: Sandbox | None = None
    """Where verifiers run model code (never in the worker)."""
    judge: Any = None
    """An `envs.rewards.JudgeClient`, or None."""


@dataclass
class RewardSpec:
    """A weighted composition of reward components."""

    components: list[RewardComponent]
    """The named components; the total is their weighted sum."""

    def __post_init__(self):
        names = [c.name for c in self.components]
        if len(set(names)) != len(names):
            raise EnvError(f"duplicate reward component names in {names}")

    def with_weights(self, weights: dict[str, float] | None) -> RewardSpec:
        """A copy with some weights replaced; unknown names are an error listing the known ones."""
        weights = dict(weights or {})
        known = {c.name for c in self.components}
        unknown = sorted(set(weights) - known)
        if unknown:
            raise EnvError(f"unknown reward component(s) {unknown}; known: {sorted(known)}")
        return RewardSpec([dataclasses.replace(c, weight=float(weights.get(c.name, c.weight)))
                           for c in self.components])

    def compute(self, ctx: RewardContext) -> RewardResult:
        from envs.rewards import REWARDS, run_reward

        out = RewardResult(total=0.0)
        for comp in self.components:
            r = run_reward(REWARDS.get(comp.fn), ctx, comp.params)
            r.provenance.setdefault("fn", comp.fn)
            out.components[comp.name] = float(r.score)
            out.weights[comp.name] = comp.weight
            out.reasons[comp.name] = r.reason
            out.provenance[comp.name] = r.provenance
            if out.status == "ok" and r.status != "ok":
                out.status = r.status
            out.total += comp.weight * float(r.score)
        return out


# -------------------------------------------------------------------------------------------- tools
@dataclass
class Tool:
    """A tool the model may call; `parameters` is the JSON schema of its arguments object."""

    name: str
    """Name the model calls it by."""
    description: str
    """What it does (shown to the model)."""
    parameters: dict
    """JSON schema (an object schema) of its arguments."""

    def schema(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass
class ToolCall:
    """One parsed `<tool_call>` block; `error` is set (and name/arguments empty) when it was malformed."""

    name: str
    """Tool name as the model wrote it."""
    arguments: dict
    """Arguments object as the model wrote it (validated later against the tool's schema)."""
    error: str | None = None
    """Why the block could not be parsed (shown to the model); None when it parsed."""


TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _parse_one(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        return ToolCall("", {}, f"tool call is not valid JSON ({e.__class__.__name__}: {str(e)[:120]})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'a tool call must be a JSON object {"name": "...", "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(args, dict):
        return ToolCall("", {}, f"tool call {obj['name'][:80]!r}: 'arguments' must be a JSON object")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Parse `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in order of appearance.

    Never raises: a malformed block becomes a ToolCall with `error` set (the message for the model).
    """
    calls = [_parse_one(raw) for raw in TOOL_CALL_RE.findall(text)]
    if text.count("<tool_call>") > text.count("</tool_call>"):
        calls.append(ToolCall("", {}, "unterminated <tool_call> (missing </tool_call>)"))
    return calls


def has_tool_call(text: str) -> bool:
    return "<tool_call>" in text


# ---------------------------------------------------------------------------------------- workspace
_RESERVED = ".mrl_"
_DUMP = (
    "import os,json,base64\n"
    "out={};total=0\n"
    "for d,ds,fs in os.walk('.'):\n"
    " ds[:]=sorted(x for x in ds if not os.path.islink(os.path.join(d,x)) and x!='__pycache__')\n"
    " for f in sorted(fs):\n"
    "  p=os.path.normpath(os.path.join(d,f))\n"
    "  if p.startswith('.mrl_') or os.path.islink(p) or not os.path.isfile(p): continue\n"
    "  total+=os.path.getsize(p)\n"
    "  if total>MAXB or len(out)>=MAXF: raise SystemExit(3)\n"
    "  out[p]=base64.b64encode(open(p,'rb').read()).decode()\n"
    "json.dump(out,open('.mrl_ws.json','w'))\n"
)


def safe_relpath(path: str) -> str | None:
    """Normalise a model-given relative path; None if it is absolute, escapes the workspace or is reserved."""
    if not isinstance(path, str) or not path or "\x00" in path or path.startswith("/"):
        return None
    p = posixpath.normpath(path)
    if p in (".", "") or p.startswith("../") or p == ".." or p.startswith(_RESERVED):
        return None
    return p


@dataclass
class Workspace:
    """A scratch directory that survives across turns as files in the worker, carried into each sandbox run
    and collected back after it (new, changed and deleted files alike). Regular files only: symlinks, empty
    directories and permission bits are not carried (run scripts with `sh x.sh` / `python3 x.py`)."""

    files: dict[str, bytes] = field(default_factory=dict)
    """Relative path -> content."""
    max_bytes: int = 1 << 20
    """Most bytes over all files; a run that leaves more keeps the previous files."""
    max_files: int = 256
    """Most files."""

    def write(self, path: str, content: str | bytes) -> str | None:
        """Write a file; return an error message (for the model) or None."""
        p = safe_relpath(path)
        if p is None:
            return f"invalid path {path!r}: use a relative path inside the workspace"
        data = content.encode() if isinstance(content, str) else content
        size = sum(len(v) for k, v in self.files.items() if k != p) + len(data)
        if size > self.max_bytes or (p not in self.files and len(self.files) >= self.max_files):
            return f"workspace full (limit {self.max_bytes} bytes, {self.max_files} files)"
        self.files[p] = data
        return None

    def read(self, path: str) -> bytes | None:
        p = safe_relpath(path)
        return None if p is None else self.files.get(p)

    def run(self, sandbox: Sandbox, command: str, limits: Limits | None = None,
            extra_files: dict[str, str | bytes] | None = None) -> tuple[SandboxResult, str | None]:
        """Run a shell `command` with the workspace as the scratch directory, then take back its files.

        Returns the sandbox result and an error message when the files could not be collected (the
        workspace then stays as it was). `extra_files` are present for this run only.
        """
        files: dict[str, str | bytes] = dict(self.files)
        files.update(extra_files or {})
        files[".mrl_cmd.sh"] = command
        dump = _DUMP.replace("MAXB", str(self.max_bytes)).replace("MAXF", str(self.max_files))
        script = f"sh .mrl_cmd.sh; rc=$?; python3 -I -S -c {shlex.quote(dump)} || exit 125; exit $rc"
        result = sandbox.run(script, files=files, limits=limits, collect=[".mrl_ws.json"])
        err = self._take_back(result.files.get(".mrl_ws.json"), set(extra_files or {}))
        return result, err

    def _take_back(self, manifest: bytes | None, drop: set[str]) -> str | None:
        if manifest is None:
            return "workspace files could not be collected (killed, or too large)"
        try:
            obj = json.loads(manifest)
            new = {}
            for k, v in obj.items():
                p = safe_relpath(k)
                if p is not None and p not in drop:
                    new[p] = base64.b64decode(v, validate=True)
        except (ValueError, AttributeError, TypeError, RecursionError):
            return "workspace files could not be collected (corrupt manifest)"
        if sum(map(len, new.values())) > self.max_bytes or len(new) > self.max_files:
            return "workspace over its size limit; changes dropped"
        self.files = new
        return None


def sandbox_problem(result: SandboxResult) -> tuple[str, str] | None:
    """(reason, status) when a run did not complete normally, None when it did. A limit the program hit is
    the model's doing (status ok: a zero reward); a 'setup' violation is the sandbox's (sandbox_error)."""
    if "setup" in result.violations:
        return f"sandbox setup failed: {result.stderr[-300:]}", "sandbox_error"
    if result.violations:
        return f"sandbox limit hit: {', '.join(result.violations)}", "ok"
    return None


# -------------------------------------------------------------------------------------- environment
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

    def run(self, command, files=None, limits=None, stdin=None, collect=None) -> SandboxResult:
        try:
            return self._env.sandbox.run(command, files=files, limits=limits, stdin=stdin, collect=collect)
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


def make_env(name: str, **kwargs) -> Environment:
    """Build a registered environment by name; an unknown name is an error listing the known ones."""
    return ENVIRONMENTS.get(name)(**kwargs)


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

    def run_in_workspace(self, command: str, extra_files: dict | None = None) -> tuple[SandboxResult | None, str]:
        """Run `command` in the sandbox over `self.workspace`; returns (result, notes for the model). A sandbox
        that fails (raises, or cannot set up) marks the episode sandbox_error; the model sees a note."""
        try:
            res, err = self.workspace.run(self.sandbox, command, self.limits, extra_files)
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


# ------------------------------------------------------------------------------------------- config
@dataclass
class EnvConfig:
    """Which environments a run trains on, with what weights, tasks, budgets, judge and sandbox."""

    names: list[str] = field(default_factory=lambda: ["countdown"])
    """Environments (registry names) to sample tasks from."""
    weights: dict[str, float] = field(default_factory=dict)
    """Sampling weight per environment; a name not listed gets 1.0, weight 0 disables it."""
    task_files: dict[str, list[str]] = field(default_factory=dict)
    """Task files (.jsonl/.yaml) per environment; an environment not listed uses its shipped suite."""
    split: str = "train"
    """Which split of the task files to sample: train or heldout."""
    seed: int = 0
    """Seed of the domain sampler (deterministic given it; resumable from its state)."""
    max_turns: int = 8
    """Most model actions per episode."""
    max_tokens: int = 4096
    """Most tokens per episode (model plus observations)."""
    max_observation_chars: int = 4000
    """Longer observations are truncated in the middle."""
    reward_weights: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per environment, overrides of reward component weights, e.g. {countdown: {format: 0.0}}."""
    judge_base_url: str = ""
    """OpenAI-compatible judge endpoint including /v1; empty: environments run without an LLM judge."""
    judge_model: str = ""
    """Judge model name (recorded in every judged reward's provenance)."""
    judge_model_version: str = ""
    """Judge version for provenance (e.g. a checkpoint hash); empty: the name the server reports."""
    judge_cache_dir: str = "runs/judge_cache"
    """On-disk cache of judge answers, keyed by content hash."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """The sandbox backend shared by the environments (bwrap by default; workers > 1 for a pool)."""

    def validate(self) -> None:
        from megatron_rl.config import ConfigError

        if not self.names:
            raise ConfigError("envs.names is empty; name at least one environment, e.g. [countdown]")
        for n in self.names:
            if n not in ENVIRONMENTS:
                raise ConfigError(f"envs.names: unknown environment {n!r}; known: {', '.join(ENVIRONMENTS.names())}")
        for key in ("weights", "task_files", "reward_weights"):
            extra = sorted(set(getattr(self, key)) - set(self.names))
            if extra:
                raise ConfigError(f"envs.{key} names {extra}, which are not in envs.names {self.names}")
        if self.split not in ("train", "heldout"):
            raise ConfigError(f"envs.split must be train or heldout, got {self.split!r}")
        if self.max_turns < 1 or self.max_tokens < 1:
            raise ConfigError("envs.max_turns and envs.max_tokens must be >= 1")

    def build(self, sandbox: Sandbox | None = None) -> EnvSuite:
        """Load the task suites, build the sampler, the judge and (unless given) the sandbox."""
        from envs.rewards import JudgeConfig
        from envs.sampler import DomainSampler
        from envs.tasks import load_domain

        self.validate()
        tasks = {n: load_domain(n, self.task_files.get(n), split=self.split) for n in self.names}
        weights = {n: float(self.weights.get(n, 1.0)) for n in self.names}
        judge = JudgeConfig(base_url=self.judge_base_url, model=self.judge_model,
                            model_version=self.judge_model_version, cache_dir=self.judge_cache_dir).build()
        return EnvSuite(self, tasks, DomainSampler(tasks, weights, self.seed), judge,
                        sandbox or self.sandbox.build())


class EnvSuite:
    """What `EnvConfig.build()` returns: tasks, the sampler, and fresh environments sharing one sandbox/judge."""

    def __init__(self, config: EnvConfig, tasks: dict[str, list[Task]], sampler, judge, sandbox: Sandbox):
        self.config, self.tasks, self.sampler, self.judge, self.sandbox = config, tasks, sampler, judge, sandbox

    def make(self, name: str, token_counter: Callable[[str], int] | None = None) -> Environment:
        """A new environment instance (one per concurrent episode)."""
        c = self.config
        budget = Budget(c.max_turns, c.max_tokens, c.max_observation_chars)
        return make_env(name, budget=budget, sandbox=self.sandbox, judge=self.judge,
                        reward_weights=c.reward_weights.get(name), token_counter=token_counter)

    def close(self) -> None:
        self.sandbox.close()
