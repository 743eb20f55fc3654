"""Long-episode state (`envs.episode_state`): a multi-turn episode checkpointed every few turns and cut off
(the worker killed) continues from its checkpoint in a fresh environment, token-exact, generating only the turns
after it; a checkpoint whose replay differs, or that cannot be read, starts the episode again."""
from __future__ import annotations

import pytest

from megatron_rl.envs.base import Budget, Environment, Observation, RewardComponent, RewardSpec, Task
from megatron_rl.envs.episode import drive, episode
from megatron_rl.envs.episode_state import EpisodeCheckpoint, drive_resumable
from megatron_rl.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
TASK = Task("t0", "ledger", "Add numbers; say 'done' to stop.")


class Ledger(Environment):
    """A multi-turn toy environment: each turn adds the model's number to a running total it reports back;
    `drift` makes its observations differ from one instance to the next (a step that is not reproducible)."""

    name = "ledger"
    multi_turn = True
    instances = 0

    def __init__(self, drift: bool = False):
        super().__init__(budget=Budget(max_turns=20, max_tokens=100000))
        Ledger.instances += 1
        self.drift = drift

    def reward_spec(self):
        return RewardSpec([RewardComponent("x", "format", 1.0)])

    def _start(self, task):
        self.total = 0

    def _act(self, action):
        if action.strip().startswith("done"):
            return None
        self.total += int(action.strip() or 0)
        extra = f" (instance {Ledger.instances})" if self.drift else ""
        return Observation(text=f"total {self.total}{extra}", role="tool")


class Policy:
    """Deterministic per (turn): a number for 7 turns, then 'done'; counts its calls; may die at a turn."""

    def __init__(self, die_at: int | None = None):
        self.calls: list[int] = []
        self.die_at = die_at

    def __call__(self, tokens, turn):
        if turn == self.die_at:
            raise KeyboardInterrupt("worker killed")  # nothing after this point survives but the checkpoint
        self.calls.append(turn)
        ids = TOK.encode("done" if turn == 7 else str(3 * turn + 1))
        return ids, [-0.01 * (turn + 1)] * len(ids), [turn // 3] * len(ids)


def make(drift=False):
    return lambda: episode(Ledger(drift), TASK, TOK, max_tokens=100000)


def fields(r):
    return (r.tokens, r.logprobs, r.loss_mask, r.versions, r.prompt_len, r.turns, r.status)


def test_a_cut_off_episode_continues_from_its_checkpoint_token_exact():
    want = drive(make()(), Policy())
    store: dict[str, bytes] = {}
    first = Policy(die_at=5)
    with pytest.raises(KeyboardInterrupt):
        drive_resumable(make(), first, lambda: store.get("e"), lambda b: store.__setitem__("e", b), every=2)
    ckpt = EpisodeCheckpoint.loads(store["e"])
    assert len(ckpt.turns) == 4 and first.calls == [0, 1, 2, 3, 4]  # saved after turns 2 and 4; turn 4 is lost
    second = Policy()  # another worker: a fresh environment
    got = drive_resumable(make(), second, lambda: store.get("e"), lambda b: store.__setitem__("e", b), every=2)
    assert second.calls == [4, 5, 6, 7]  # only the turns after the checkpoint are generated
    assert fields(got) == fields(want) and got.turns == 8
    assert sum(got.loss_mask) == sum(len(TOK.encode(str(3 * t + 1))) for t in range(7)) + len(TOK.encode("done"))


def test_a_checkpoint_whose_replay_differs_or_is_unreadable_starts_the_episode_again(caplog):
    store: dict[str, bytes] = {}
    with pytest.raises(KeyboardInterrupt):
        drive_resumable(make(drift=True), Policy(die_at=3), lambda: store.get("e"),
                        lambda b: store.__setitem__("e", b), every=2)
    again = Policy()
    got = drive_resumable(make(drift=True), again, lambda: store.get("e"), lambda b: store.__setitem__("e", b), 2)
    assert again.calls == list(range(8)) and "gave another context" in caplog.text  # never continued on a
    assert got.turns == 8                                                            # state it does not have
    fresh = Policy()
    drive_resumable(make(), fresh, lambda: b"{not json", lambda b: None, every=2)
    assert fresh.calls == list(range(8)) and "checkpoint unreadable" in caplog.text


class Gen:
    """The worker's generator interface over `Policy`."""

    def __init__(self, policy):
        self.policy = policy

    def generate(self, tokens, sampling, episode=None, turn=0):
        return self.policy(tokens, turn)


def test_a_worker_episode_resumes_from_the_stores_checkpoint_token_exact(tmp_path):
    """Through the rollout worker's episode (`dispatch.episode_rows`) and the shared-filesystem store: the
    checkpoint is saved under the batch folder and read back by the next attempt."""
    import numpy as np

    from megatron_rl.data.store import FsStore
    from megatron_rl.dispatch import EpisodeSpec
    from megatron_rl.dispatch.episode_rows import episode_rows

    ep = EpisodeSpec("g0-s0", "ledger", task={"id": "t0", "domain": "ledger", "prompt": TASK.prompt})
    [want] = episode_rows(ep, Ledger(), Gen(Policy()), TOK, 100000)
    store, folder = FsStore(), tmp_path / "rl_episodes" / "b0"
    with pytest.raises(KeyboardInterrupt):
        episode_rows(ep, Ledger(), Gen(Policy(die_at=4)), TOK, 100000, state=(store, folder, 3))
    assert len(EpisodeCheckpoint.loads(store.load_state(folder, "g0-s0")).turns) == 3
    policy = Policy()
    [got] = episode_rows(ep, Ledger(), Gen(policy), TOK, 100000, state=(store, folder, 3))
    assert policy.calls == [3, 4, 5, 6, 7]
    for k in ("tokens", "logprobs", "loss_mask", "token_versions"):
        assert np.array_equal(getattr(got, k), getattr(want, k)), k
    assert (got.prompt_len, got.status, got.reward) == (want.prompt_len, want.status, want.reward)
    assert store.load_state(folder, "other") is None and not list(folder.glob("state/.*.tmp"))


def test_the_run_config_sets_the_workers_checkpoint_interval(tmp_path):
    from pathlib import Path

    from megatron_rl import config as C
    from megatron_rl.config import ConfigError
    from megatron_rl.loop.job import worker_config
    from megatron_rl.run_config import RunConfig

    demo = Path(__file__).resolve().parents[2] / "configs" / "demo_cpu.yaml"
    cfg = C.load(RunConfig, demo, ["episodes.runner=fleet", "episodes.checkpoint_turns=4"])
    assert worker_config(cfg, tmp_path / "run").checkpoint_turns == 4
    assert worker_config(C.load(RunConfig, demo, ["episodes.runner=fleet"]), tmp_path / "run").checkpoint_turns == 0
    with pytest.raises(ConfigError, match="episodes.checkpoint_turns needs episodes.runner=dispatch or fleet"):
        C.load(RunConfig, demo, ["episodes.checkpoint_turns=4"])
    with pytest.raises(ConfigError, match="episodes.checkpoint_turns must be >= 0"):
        C.load(RunConfig, demo, ["episodes.runner=fleet", "episodes.checkpoint_turns=-1"])


def test_the_scripted_policys_multi_turn_settings_are_checked():
    from megatron_rl.config import ConfigError
    from megatron_rl.dispatch import GeneratorConfig

    GeneratorConfig(tool_turns=3, turn_delay_s=0.1).validate()
    for bad in ({"tool_turns": -1}, {"turn_delay_s": -0.5}):
        with pytest.raises(ConfigError, match="generator.tool_turns and turn_delay_s must be >= 0"):
            GeneratorConfig(**bad).validate()
