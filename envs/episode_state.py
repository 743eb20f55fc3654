"""Long-episode state: a multi-turn episode checkpoints its model turns every few turns, and a re-leased episode
continues from its checkpoint on another worker, token-exact, instead of starting again (issue 31 item 3).

    r = drive_resumable(lambda: open_episode(env, task, tok, max_tokens), generate,
                        load=lambda: store.load_state(folder, eid), save=lambda c: store.save_state(folder, eid, c),
                        every=4)

What a checkpoint holds (`EpisodeCheckpoint`): every model turn so far exactly as generated (token ids,
behaviour log-probs, policy versions) and the context the episode coroutine asked to generate from after the last
of them (prompt, turns and observations: the token sequence so far, whose loss mask and versions the coroutine
derives again). The environment's state is rebuilt by replaying the recorded actions through a fresh
`reset` + `step` (tools run again in the sandbox), which needs no per-environment snapshot code; the replay is
checked token-exact against the saved context, and an environment whose replay differs (its steps are not
reproducible: time, randomness, outside services) is started again from scratch (`ReplayMismatch`, logged), never
continued from a state it does not have. A snapshot hook for such environments (a workspace archive saved with
the checkpoint and restored before the replay's last step) is the next part; not built here.

Where it runs: the generation side of `envs.episode.drive` (one coroutine, any runner); the rollout worker
(`dispatch.episode_rows`) gets `load`/`save` from the run's trajectory store (`data.store`: `save_state`,
`load_state`, keyed by the batch folder and episode id), so a lease revoked mid-episode (worker killed,
preempted) and handed to another worker resumes there. Generation calls happen only for the turns after the
checkpoint; the episode's seed plus turn number keeps a retried turn's draws the same (`HttpGenerator`).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from megatron_rl.envs.episode_result import EpisodeResult, GenOut

log = logging.getLogger(__name__)


class ReplayMismatch(RuntimeError):
    """Replaying a checkpoint's turns did not give back its context: the environment's steps differ."""


@dataclass
class EpisodeCheckpoint:
    """An episode's model turns so far and the context after them (see the module docstring)."""

    turns: list[list] = field(default_factory=list)
    """One [token ids, log-probs, policy versions] per model turn, exactly as generated."""
    context: list[int] = field(default_factory=list)
    """The tokens the episode asked to generate from after the last turn (prompt, turns, observations)."""

    def dumps(self) -> bytes:
        return json.dumps({"version": 1, "turns": self.turns, "context": self.context}).encode()

    @classmethod
    def loads(cls, data: bytes) -> EpisodeCheckpoint:
        d = json.loads(data)
        if d.get("version") != 1:
            raise ValueError(f"episode checkpoint of an unknown version {d.get('version')!r}")
        return cls([list(t) for t in d["turns"]], list(d["context"]))


def drive_resumable(make: Callable[[], Generator], generate: Callable[[list[int], int], GenOut],
                    load: Callable[[], bytes | None], save: Callable[[bytes], None], every: int,
                    name: str = "episode") -> EpisodeResult:
    """Run the episode coroutine `make()` to its end like `envs.episode.drive`, from the checkpoint `load()`
    gives (None: from the start), saving one through `save` after every `every` model turns. A checkpoint that
    cannot be read or replayed is logged and the episode starts from scratch; a resumed one is logged (INFO,
    `name`: the episode's id)."""
    data = load()
    ckpt = None
    if data:
        try:
            ckpt = EpisodeCheckpoint.loads(data)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("episode checkpoint unreadable (%s); starting the episode again", e)
    if ckpt is not None and ckpt.turns:
        try:
            r = _drive(make(), generate, save, every, ckpt)
            log.info("%s resumed from its checkpoint after %d model turns", name, len(ckpt.turns))
            return r
        except ReplayMismatch as e:
            log.warning("%s; starting the episode again", e)
    return _drive(make(), generate, save, every, EpisodeCheckpoint())


def _drive(co: Generator, generate, save, every: int, ckpt: EpisodeCheckpoint) -> EpisodeResult:
    journal = EpisodeCheckpoint()
    tokens, turn = next(co), 0
    while True:
        if turn < len(ckpt.turns):  # replay: the recorded action, no generation
            out = tuple(ckpt.turns[turn])
        else:
            out = generate(tokens, turn)
        journal.turns.append([list(out[0]), list(out[1]), list(out[2])])
        try:
            tokens = co.send(out)
        except StopIteration as stop:
            if turn + 1 < len(ckpt.turns):
                raise ReplayMismatch(f"the episode ended at turn {turn} while replaying its checkpoint of "
                                     f"{len(ckpt.turns)} turns") from None
            return stop.value
        turn += 1
        if turn == len(ckpt.turns) and list(tokens) != ckpt.context:
            raise ReplayMismatch(f"replaying the checkpoint's {turn} turns gave another context (environment steps "
                                 "not reproducible)")
        if every and turn > len(ckpt.turns) and turn % every == 0:
            journal.context = list(tokens)
            save(journal.dumps())
