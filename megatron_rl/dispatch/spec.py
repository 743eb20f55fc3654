"""What a rollout worker task runs: episodes, the generator, the sandbox, and where shards go.

Everything here is plain data (dataclasses of str/int/float/list/dict) so a spec pickles for submitit and
round-trips through YAML/JSON for `megatron-rl rollout-worker --spec FILE` (`megatron_rl.config`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.config import ConfigError, from_dict, to_dict
from megatron_rl.data.store import S3StoreConfig
from megatron_rl.envs.mixture import MixtureConfig
from megatron_rl.envs.sandbox import SandboxConfig


@dataclass
class EpisodeSpec:
    """One episode to run: which environment, which task, how to sample."""

    episode_id: str
    """Globally unique id; a trajectory with this id is written exactly once to the consumer."""
    env: str
    """Environment registry name (e.g. countdown)."""
    task: dict = field(default_factory=dict)
    """The task as `Task.to_dict()`: id, domain, prompt, payload, split."""
    sampling: dict = field(default_factory=dict)
    """Sampling for the generator: temperature, top_p, top_k, max_new_tokens, stop_token_ids, seed."""
    group_id: int = 0
    """Group for group-normalised advantages (all samples of one prompt share it)."""
    seed: int = 0
    """Per-episode seed (sampling; the scripted test policy picks right/wrong answers by it)."""
    prompt_ids: list[int] = field(default_factory=list)
    """Prompt token ids chosen by the consumer (its prompt format); empty = `<bos>` + the env's first observation."""


@dataclass
class GeneratorConfig:
    """Where model tokens come from: the rollout engine over HTTP, or the scripted TEST policy."""

    kind: str = "scripted"
    """http (the rollout engine's client; needs url) or scripted (a test policy answering from the task)."""
    url: str = ""
    """Rollout engine base URL (kind=http), e.g. http://gpunode:8000."""
    token_file: str = ""
    """kind=http: file holding the rollout server's token (mode 600, written by the driver: every endpoint but
    /health needs it); '' = $MEGATRON_RL_ROLLOUT_TOKEN."""
    timeout_s: float = 120.0
    """HTTP request timeout (kind=http)."""
    retries: int = 2
    """kind=http: extra attempts of one request on connection errors, timeouts and 5xx/429 (4xx never)."""
    backoff_s: float = 0.5
    """kind=http: seconds before the first retry, doubled after each."""
    max_new_tokens: int = 512
    """kind=http: tokens per model turn when the episode's sampling gives no max_new_tokens (capped by the
    worker's max_tokens budget)."""
    routed_experts: bool = False
    """kind=http, MoE routing replay: ask the server for each token's experts and store them in the shards."""
    wrong_fraction: float = 0.0
    """Scripted test policy: fraction of episodes (chosen by episode seed) answered wrongly."""
    policy_version: int = 0
    """Scripted test policy: the policy version it reports."""
    tool_turns: int = 0
    """Scripted test policy: model turns of tool calls before the answer (a multi-turn episode of a tool
    environment: `write_file` on even turns, `list_files` on odd ones, so later observations depend on the
    workspace the earlier turns built); 0 = the answer at once."""
    turn_delay_s: float = 0.0
    """Scripted test policy: seconds each model turn takes (an episode slow enough to kill mid-way)."""

    def validate(self) -> None:
        if self.kind not in ("http", "scripted"):
            raise ConfigError(f"generator.kind must be http or scripted, got {self.kind!r}")
        if self.kind == "http" and not self.url:
            raise ConfigError("generator.url is required with kind=http (the rollout engine's base URL)")
        if self.timeout_s <= 0 or self.retries < 0 or self.backoff_s < 0 or self.max_new_tokens < 1:
            raise ConfigError("generator.timeout_s must be > 0, retries and backoff_s >= 0, max_new_tokens >= 1")
        if not 0.0 <= self.wrong_fraction <= 1.0:
            raise ConfigError(f"generator.wrong_fraction must be in [0, 1], got {self.wrong_fraction}")
        if self.tool_turns < 0 or self.turn_delay_s < 0:
            raise ConfigError(f"generator.tool_turns and turn_delay_s must be >= 0, got {self.tool_turns}, "
                              f"{self.turn_delay_s}")


@dataclass
class FaultConfig:
    """Fault injection FOR TESTS ONLY (retry, kill and straggler paths); all off by default."""

    raise_in_rounds: list[int] = field(default_factory=list)
    """Dispatch rounds (0 = first attempt) in which a worker raises RuntimeError after `raise_after` episodes."""
    raise_after: int = 0
    """Episodes a faulty worker finishes (and publishes) before raising."""
    delay_s: float = 0.0
    """Sleep this long before each episode (makes tasks slow enough to kill, cancel or time out)."""
    delay_in_rounds: list[int] = field(default_factory=list)
    """Rounds the delay applies to; empty = every round."""


@dataclass
class WorkerConfig:
    """How a rollout worker runs its episodes (shared by every task of a dispatch)."""

    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    """Where model tokens come from."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Sandbox backend; the pool gets max(sandbox.workers, threads) slots."""
    threads: int = 0
    """Episodes run concurrently per task; 0 = the CPUs Slurm gave the task (else os.cpu_count(), max 8)."""
    episodes_per_shard: int = 0
    """Publish a shard every this many finished episodes (0 = one shard at the end of the task attempt)."""
    max_turns: int = 8
    """Most model actions per episode of an environment not in `envs.domains`."""
    max_tokens: int = 4096
    """Most tokens per episode (model plus observations): the model's max_seq_length."""
    vocab_size: int = 384
    """The policy's vocabulary size (the byte tokenizer pads up to it)."""
    tokenizer: str = ""
    """HF tokenizer folder of the run (on the shared filesystem); '' = the byte tokenizer."""
    envs: MixtureConfig = field(default_factory=MixtureConfig)
    """The run's `envs:` section, which the worker builds its environments from (`envs.mixture.EnvFactory`, as
    the in-process loop does): each domain's reward weights, budget, agent; the LLM judge (judge_base_url,
    judge_model, judge_cache_dir: the driver sets it to <run>/judge_cache on the shared filesystem, '' =
    <shard_dir>/judge_cache); image_store / image_cache. {} domains = every environment with its own rewards,
    max_turns and max_tokens above."""
    checkpoint_turns: int = 0
    """A multi-turn episode (the loop's own turns, not a black-box agent's) saves its state to the store every
    this many model turns, and a re-leased one continues from it, token-exact (`envs.episode_state`); 0 = off."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Test-only fault injection."""
    images: dict[str, dict[str, str]] = field(default_factory=dict)
    """Environment name -> its sandbox image {digest, file}: built once by the driver into the shared store
    (`MixtureConfig.worker_images`); each node extracts it once into image_cache and mounts it."""
    store: str = "fs"
    """Where shards are published (`data.store`): fs (the shard folder on the shared filesystem) or s3 (object
    store + NATS announcements, `s3`); the driver copies the run's `episodes.store`."""
    s3: S3StoreConfig = field(default_factory=S3StoreConfig)
    """The s3 store's endpoint, bucket, prefix and queue (store=s3); no credentials (environment or file)."""

    def validate(self) -> None:
        import megatron_rl.envs  # noqa: F401  (registers the built-in environments)
        from megatron_rl.envs.base import EnvError, make_env
        from megatron_rl.registry import RegistryError

        for name, d in self.envs.domains.items():
            try:
                make_env(name, agent=d.agent, reward_weights=d.reward_weights or None)
            except (EnvError, RegistryError) as e:
                raise ConfigError(f"worker.envs.domains.{name}: {e}") from None
            if d.agent_args and not d.agent:
                raise ConfigError(f"worker.envs.domains.{name}.agent_args={d.agent_args!r} is set but no agent is")
        if self.threads < 0 or self.episodes_per_shard < 0 or self.checkpoint_turns < 0:
            raise ConfigError("worker.threads, worker.episodes_per_shard and worker.checkpoint_turns must be >= 0")
        if self.store == "s3":
            self.s3.check("worker.s3")


@dataclass
class WorkerSpec:
    """One task's work: a batch of episodes and where its shards go (`--spec FILE` of rollout-worker)."""

    episodes: list[EpisodeSpec] = field(default_factory=list)
    """The episodes of this task."""
    shard_dir: str = "runs/shards"
    """Folder shards are published into (shared filesystem)."""
    shard_prefix: str = "rollout"
    """Shard file name prefix (the dispatch run's id)."""
    round: int = 0
    """Dispatch attempt this task belongs to (0 = first)."""
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """How to run the episodes."""

    def validate(self) -> None:
        ids = [e.episode_id for e in self.episodes]
        if len(ids) != len(set(ids)):
            raise ConfigError("worker spec: episode ids are not unique")

    @classmethod
    def load(cls, path: str | Path) -> WorkerSpec:
        """Read a spec from a JSON or YAML file."""
        import yaml

        if not Path(path).is_file():
            raise ConfigError(f"worker spec {str(path)!r} does not exist")
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ConfigError(f"worker spec {str(path)!r} is neither JSON nor YAML: {e}") from None
        return from_dict(cls, data)

    def dump(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(to_dict(self)))
        return path
