"""The environment API's data types: tasks, observations, step results and composed rewards (see envs.base)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class EnvError(RuntimeError):
    """A caller error: stepping a finished episode, a bad task payload, a bad environment option."""


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
