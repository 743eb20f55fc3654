"""The run's mixture of domains (the run config's `envs:` section): weights, tasks, rewards, budgets, judge.

    envs:
      domains:
        arithmetic: {weight: 2}
        math: {weight: 1, reward_weights: {format: 0.0}}
        tool_use: {weight: 1, max_turns: 3}
        harbor: {weight: 1, max_turns: 8, max_tokens: 8192, task_files: [path/to/harbor_tasks]}  # task folders
        code: {weight: 1, image: images/code.yaml}  # its sandboxes run in this image (envs.sandbox.image)
      judge_base_url: http://judge:8000/v1        # optional
      curriculum: {enabled: true, floor: 0.2}     # optional: weights move toward learnable domains (envs/curriculum.py)

A key of `domains` may be a pattern: `reasoning_gym/*` (a glob), `reasoning_gym:arithmetic` (a task library's
category), with shared settings that exact names override (envs/procedural/domains.py). A task library's domain
(`reasoning_gym/<generator>`, envs/procedural) generates its tasks from `seed` with the settings `generator`.

Every domain is a registered environment; its tasks are its shipped suite or `task_files`, split into train
(sampled by the RL loop, weighted, resumable) and heldout (evaluated per domain). `build_env` makes one
environment for one episode with the domain's reward weights and budget; the RL loop, eval, warm-up and the
rollout workers all build their environments through `EnvFactory` (`MixtureConfig.factory`), which also carries
the LLM judge and the domains' images.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.envs.base import ENVIRONMENTS, Budget, EnvError, Environment, Task, make_env
from megatron_rl.envs.curriculum import DomainCurriculumConfig


@dataclass
class DomainConfig:
    """One domain of the mixture."""

    weight: float = 1.0
    """Sampling weight of its tasks in the RL loop (0: evaluated only)."""
    task_files: list[str] = field(default_factory=list)
    """Task files (.jsonl/.yaml), or folders for a folder domain (harbor: task folders or folders of them);
    [] = the environment's shipped suite."""
    train_tasks: int = 0
    """Train tasks used at most (0 = all); a task library's domain (envs/procedural) makes this many (0 = 64)."""
    heldout_tasks: int = 0
    """Held-out tasks used at most (0 = all); a task library's domain makes this many (0 = 16)."""
    seed: int = 0
    """A task library's domain: the seed its train tasks are drawn from (held-out: seed + 2**30)."""
    generator: dict[str, Any] = field(default_factory=dict)
    """A task library's domain: its generator's settings (e.g. reasoning-gym's difficulty fields); unknown names
    are refused; {} = the generator's defaults."""
    levels: int = 0
    """A task library's domain: climb the first `levels` difficulty levels of its generator's own curriculum
    (reasoning-gym's; `generator` settings apply on top) during the run, easiest first: train_tasks made per
    level, the next level once the domain's groups at this one reach `envs.curriculum.level_up_at` mean reward
    (`envs.sampler`); held-out tasks keep the `generator` settings. 0 = fixed settings."""
    tier: str = ""
    """Only tasks whose payload `tier` is this (the generated suites' easy / medium); '' = all tasks."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """Overrides of the environment's reward component weights, e.g. {format: 0.0}."""
    max_turns: int = 4
    """Model turns per episode at most (single-turn environments take one)."""
    max_tokens: int = 0
    """Tokens per episode at most, prompt included (0 = the model's max_seq_length)."""
    max_observation_chars: int = 2000
    """Longer observations are cut in the middle before the model sees them."""
    agent: str = ""
    """A black-box agent program that plays the episodes through the gateway ('shell': envs/agents/shell_agent.py
    in the sandbox, reaching the policy over a Unix socket); '' = the loop's own turns."""
    agent_args: str = ""
    """Extra arguments of the agent program, e.g. its long-history strategy: '--history drop-oldest
    --context-budget 6000' (see envs/agents/shell_agent.py)."""
    image: str = ""
    """The sandbox image of this domain (`envs.sandbox.image`): an image spec YAML or a built .sqfs/.tar;
    harbor: `dockerfile` builds each task's image from its environment/ (packages the host lacks); '' = none."""


@dataclass
class MixtureConfig:
    """Which domains a run trains and evaluates on (the `envs:` section)."""

    domains: dict[str, DomainConfig] = field(default_factory=dict)
    """Domain (registered environment name) -> its weight, tasks, rewards and budget ({} in a run config:
    data.domain alone, with rl.reward_weights)."""
    judge_base_url: str = ""
    """OpenAI-compatible judge endpoint including /v1 ('' = no LLM judge; judged domains use rules only)."""
    judge_model: str = ""
    """Judge model name (recorded in every judged reward's provenance)."""
    judge_cache_dir: str = ""
    """On-disk cache of judge answers ('' = <run>/judge_cache)."""
    image_store: str = ""
    """Shared-filesystem folder of built sandbox images ('' = ~/.cache/megatron-rl/images)."""
    image_cache: str = ""
    """Node-local folder the images are extracted into ('' = <tmp>/megatron-rl-images-<uid>)."""
    curriculum: DomainCurriculumConfig = field(default_factory=DomainCurriculumConfig)
    """Online curriculum across the domains (envs/curriculum.py): sampling weights move toward domains whose
    groups have mixed outcomes, above a floor; off by default (the weights above, fixed)."""
    patterns: dict[str, list[str]] = field(default_factory=dict)
    """Filled by the config loader: each pattern of `domains` and the domains it matched (saved in the run's
    config.yaml); not set by hand."""

    @staticmethod
    def prepare_config(data: dict, prefix: str = "") -> dict:
        """The raw `envs:` mapping with the patterns of `domains` expanded (see envs/procedural/domains.py)."""
        from megatron_rl.envs.procedural.domains import prepare_mixture

        return prepare_mixture(data, prefix)

    def validate(self) -> None:
        import megatron_rl.envs  # noqa: F401  (registers the built-in environments)
        from megatron_rl.config import ConfigError

        domains = self.domains
        if not domains:  # a run config fills it from data.domain (RunConfig._resolve_domains)
            return
        from megatron_rl.envs.procedural.domains import check_domain, is_pattern, unknown_domain_message

        if any(is_pattern(k) for k in domains):  # a mixture built in code: expand as the loader does
            from megatron_rl.config import from_dict, to_dict
            from megatron_rl.envs.procedural.domains import expand

            expanded, patterns = expand(to_dict(domains))
            self.domains = domains = {k: from_dict(DomainConfig, v, f"envs.domains.{k}") for k, v in expanded.items()}
            self.patterns.update(patterns)
        for name, d in domains.items():
            if name not in ENVIRONMENTS:
                raise ConfigError(f"envs.domains.{name}: not a registered environment; "
                                  f"{unknown_domain_message(name) or f'known: {sorted(ENVIRONMENTS.names())}'}")
            if not d.weight >= 0 or d.max_turns < 1 or d.max_tokens < 0 or d.train_tasks < 0 or d.heldout_tasks < 0:
                raise ConfigError(f"envs.domains.{name}: need weight >= 0, max_turns >= 1, max_tokens >= 0, "
                                  f"train_tasks >= 0 and heldout_tasks >= 0 (got {d})")
            check_domain(name, d)
            try:
                make_env(name, reward_weights=d.reward_weights)
            except EnvError as e:
                raise ConfigError(f"envs.domains.{name}.reward_weights: {e}") from None
            try:
                make_env(name, agent=d.agent)
            except EnvError as e:
                raise ConfigError(f"envs.domains.{name}.agent: {e}") from None
            _check_agent_args(name, d)
            self._check_image(name, d)
        for name, d in domains.items():
            if d.tier and not self.tasks("train", only=name)[name]:
                raise ConfigError(f"envs.domains.{name}.tier={d.tier!r}: no train task of {name!r} has that tier "
                                  f"(payload.tier); leave it '' for all tasks")
        if not any(d.weight > 0 for d in domains.values()):
            raise ConfigError("envs.domains: no domain has a weight > 0, so the RL loop has nothing to sample")

    def check_generated(self) -> None:
        """Make the tasks of every task library's domain and refuse one whose generator cannot fill its splits or
        whose held-out questions are train questions, naming it (the run's config check, before any rank starts;
        not in `validate`, which rollout workers run too)."""
        from megatron_rl.envs.procedural import is_procedural
        from megatron_rl.envs.procedural.domains import check_splits

        for name, d in self.domains.items():
            if is_procedural(name):
                check_splits(name, d, lambda split, name=name: self.tasks(split, only=name)[name])

    def _check_image(self, name: str, d: DomainConfig) -> None:
        """A domain's image names a spec that loads (unknown keys refused) or an image file that exists."""
        from megatron_rl.config import ConfigError

        if not d.image:
            return
        if name == "harbor":
            if d.image != "dockerfile":
                raise ConfigError(f"envs.domains.harbor.image={d.image!r}: harbor tasks name their own images; set "
                                  "'dockerfile' (build each task's environment/) or leave it ''")
            self.prepare_images(name)
            return
        if d.image == "dockerfile":
            raise ConfigError(f"envs.domains.{name}.image='dockerfile' applies to harbor only; name an image spec YAML")
        if d.image.endswith((".yaml", ".yml")):
            from megatron_rl.envs.sandbox.image import ImageSpec

            if not os.path.isfile(d.image):
                raise ConfigError(f"envs.domains.{name}.image: spec {d.image!r} does not exist")
            ImageSpec.load(d.image).validate()
        elif not (d.image.endswith((".sqfs", ".tar")) and os.path.isfile(d.image)):
            raise ConfigError(f"envs.domains.{name}.image={d.image!r}: name an image spec (.yaml) or an existing "
                              "built image file (.sqfs/.tar)")

    def prepare_images(self, name: str) -> int:
        """Build (or find in the store) and cache on this node every image the tasks of domain `name` name, so
        that a package that cannot be had is refused before any episode, naming it. Returns the image count."""
        import json

        from megatron_rl.config import ConfigError
        from megatron_rl.envs.sandbox import image_cache
        from megatron_rl.envs.sandbox.domain_images import configure
        from megatron_rl.envs.sandbox.image import ImageBuildError, ImageSpec

        configure(self.image_store, self.image_cache)
        specs = {json.dumps(t.payload["image"], sort_keys=True) for split in ("train", "heldout")
                 for t in self.tasks(split, only=name)[name] if t.payload.get("image")}
        for s in sorted(specs):
            try:
                image_cache.resolve(ImageSpec.from_dict(json.loads(s)), self.image_store or None,
                                    self.image_cache or None)
            except ImageBuildError as e:
                raise ConfigError(f"envs.domains.{name}.image: {e}") from None
        return len(specs)

    def worker_images(self) -> dict[str, dict[str, str]]:
        """Domain -> its image {digest, file} for dispatched and fleet workers: each domain image (harbor's are
        per task, built by `prepare_images`) built once into the shared store, here in the driver."""
        from megatron_rl.envs.sandbox.domain_images import configure, publish

        configure(self.image_store, self.image_cache)
        return {name: publish(d.image) for name, d in self.domains.items() if d.image and name != "harbor"}

    def loader_options(self, name: str) -> dict:
        """Options of domain `name`'s task loader (`envs.tasks.load_domain`): harbor images from environment/; a
        task library's domain: task counts, seed and generator settings."""
        from megatron_rl.envs.procedural import is_procedural

        d = self.domains.get(name)
        if d is not None and is_procedural(name):
            return {"counts": {"train": d.train_tasks, "heldout": d.heldout_tasks}, "seed": d.seed,
                    "config": dict(d.generator)}
        return {"images": True} if name == "harbor" and d is not None and d.image == "dockerfile" else {}

    def tasks(self, split: str, only: str | None = None) -> dict[str, list[Task]]:
        """Tasks per domain (or of domain `only`) of `split`, of the domain's tier (capped at train_tasks or
        heldout_tasks)."""
        from megatron_rl.envs.tasks import load_domain

        out = {}
        for name, d in self.domains.items():
            if only is not None and name != only:
                continue
            tasks = load_domain(name, d.task_files or None, split=split, **self.loader_options(name))
            if d.tier:
                tasks = [t for t in tasks if t.payload.get("tier") == d.tier]
            cap = {"train": d.train_tasks, "heldout": d.heldout_tasks}.get(split, 0)
            out[name] = tasks[:cap] if cap else tasks
        return out

    def level_tasks(self) -> dict[str, list[list]]:
        """Domain -> its train tasks per difficulty level (level 0 first) for every domain with `levels` > 0: level
        i's tasks are made with the generator's level-i settings under `generator` (its own seed: seed + i), ids
        `L<i>-train-...`, and none repeats a held-out question of the domain."""
        from megatron_rl.envs.procedural.contract import difficulty_levels
        from megatron_rl.envs.procedural.env import generate

        out = {}
        for name, d in self.domains.items():
            if d.levels <= 0 or d.weight <= 0:
                continue
            held = {t.prompt for t in self.tasks("heldout", only=name)[name]}
            out[name] = []
            for i, settings in enumerate(difficulty_levels(name)[:d.levels]):
                tasks = generate(name, "train", {"train": d.train_tasks, "heldout": d.heldout_tasks}, d.seed + i,
                                 {**settings, **d.generator})
                out[name].append([dataclasses.replace(t, id=f"L{i}-{t.id}") for t in tasks if t.prompt not in held])
        return out

    def budget(self, name: str, max_seq_length: int, unlisted: DomainConfig | None = None) -> Budget:
        """Domain `name`'s episode budget (`unlisted`'s, default DomainConfig(), for a domain not in the mixture)."""
        d = self.domains.get(name) or unlisted or DomainConfig()
        tokens = min(d.max_tokens or max_seq_length, max_seq_length)
        return Budget(max_turns=d.max_turns, max_tokens=tokens, max_observation_chars=d.max_observation_chars)

    def build_env(self, name: str, max_seq_length: int, sandbox=None, judge=None,
                  token_counter=None) -> Environment:
        """A fresh environment of domain `name` for one episode (`factory(...)(name, sandbox)`)."""
        return self.factory(max_seq_length, judge=judge, token_counter=token_counter)(name, sandbox)

    def factory(self, max_seq_length: int, judge=None, token_counter=None, images=None,
                unlisted: DomainConfig | None = None) -> EnvFactory:
        """The run's environment factory (see `EnvFactory`)."""
        return EnvFactory(self, max_seq_length, judge, token_counter, images, unlisted or DomainConfig())

    def agent_domains(self) -> list[str]:
        """Domains played by a black-box agent."""
        return [name for name, d in self.domains.items() if d.agent]

    def judge(self, run_dir: str):
        """The LLM judge client, or None without `judge_base_url` (its cache: judge_cache_dir, else
        <run_dir>/judge_cache)."""
        if not self.judge_base_url:
            return None
        from megatron_rl.envs.rewards import JudgeConfig

        return JudgeConfig(base_url=self.judge_base_url, model=self.judge_model,
                           cache_dir=self.judge_cache_dir or f"{run_dir}/judge_cache").build()


@dataclass
class EnvFactory:
    """The one place a run's environments are built: the in-process loop, eval and warm-up
    (`loop.job.episode_runner`), dispatched and fleet workers (`dispatch.worker.EpisodeRunner`, from the worker
    spec's `envs`). `factory(name, sandbox)` is a fresh environment of domain `name` for one episode, with the
    domain's reward weights, budget, agent and sandbox image, and the run's LLM judge."""

    mixture: MixtureConfig
    """The run's `envs:` section (domains, judge settings, image folders)."""
    max_seq_length: int
    """The model's context: every episode's token budget is capped by it."""
    judge: Any = None
    """The LLM judge client (`MixtureConfig.judge`), shared by every environment; None = judged domains use
    their rules only."""
    token_counter: Callable[[str], int] | None = None
    """Counts the tokens of an observation (the run's tokenizer); None = the environments' estimate."""
    images: dict[str, dict[str, str]] | None = None
    """Domain -> its published image {digest, file} (workers: built once by the driver, `worker_images`);
    None = build or find the mixture's image specs in this process (the driver's own episodes)."""
    unlisted: DomainConfig = field(default_factory=DomainConfig)
    """Settings of a domain not in the mixture (a worker spec written by hand)."""

    def __call__(self, name: str, sandbox=None) -> Environment:
        d = self.mixture.domains.get(name) or self.unlisted
        return make_env(name, budget=self.budget(name), sandbox=self.sandbox(name, sandbox), judge=self.judge,
                        reward_weights=d.reward_weights or None, token_counter=self.token_counter, agent=d.agent,
                        agent_args=d.agent_args)

    def budget(self, name: str) -> Budget:
        return self.mixture.budget(name, self.max_seq_length, self.unlisted)

    def sandbox(self, name: str, default=None):
        """The sandbox of domain `name`: its image's (one per image per process), else `default`. Harbor picks
        each task's image itself (envs.harbor.env)."""
        from megatron_rl.envs.sandbox import domain_images

        d = self.mixture.domains.get(name) or self.unlisted
        workers = getattr(default, "workers", 1)
        domain_images.configure(self.mixture.image_store, self.mixture.image_cache)
        if self.images is not None:
            ref = self.images.get(name)
            return domain_images.worker_sandbox(name, ref, workers) if ref else default
        if d.image and name != "harbor":
            return domain_images.image_sandbox(d.image, workers=workers)
        return default


def _check_agent_args(name: str, d: DomainConfig) -> None:
    """agent_args parse as the shell agent's options (and need an agent)."""
    import shlex

    from megatron_rl.config import ConfigError

    if not d.agent_args:
        return
    if not d.agent:
        raise ConfigError(f"envs.domains.{name}.agent_args={d.agent_args!r} is set but no agent is: set "
                          f"envs.domains.{name}.agent")
    from megatron_rl.envs.agents.shell_agent import build_parser

    try:
        build_parser().parse_args(["--socket", "-", "--task", "-", *shlex.split(d.agent_args)])
    except (SystemExit, ValueError):
        raise ConfigError(f"envs.domains.{name}.agent_args={d.agent_args!r}: not valid options of the shell agent "
                          f"(see python3 envs/agents/shell_agent.py --help)") from None
