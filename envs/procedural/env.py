"""The domains of task libraries: their tasks (`generate`), environment (`ProceduralEnvironment`) and reward.

Splits: held-out tasks are drawn with seed + `HELDOUT_SEED_OFFSET`, train tasks with the domain's seed (a
generator that seeds item i with seed + i never reaches the other split's seeds), skipping any whose question is a
held-out one (a generator with few distinct tasks repeats them); the mixture checks the splits are disjoint and
refuses a domain that cannot fill its train split. Each task's payload holds the reference answer, the library's
record of the task when it survives JSON unchanged (else the task is made again from its seed and index to score
it), and its provenance: library, version, generator, seed, size, index and settings.

Reward: `correct` is the generator's own score of the text in the reply's last <answer>...</answer> (partial credit
kept; no tag: 0); `format` (weight 0.1) is 1 for exactly one <answer> tag. A generator that raises (or returns a
score outside [0, 1]) while scoring masks the sample: reward status `error`, counted per domain by the RL loop
(`<domain>/infra_error_frac`) and here (`ERRORS`). A generator that raises while making a task leaves that task out;
the count is logged and kept in `ERRORS`.
"""
from __future__ import annotations

import functools
import json
import logging
import math
from collections import Counter

from megatron_rl.envs.base import (
    ENVIRONMENTS,
    RewardComponent,
    RewardContext,
    RewardOutput,
    RewardSpec,
    SingleTurnEnvironment,
)
from megatron_rl.envs.procedural.contract import LIBRARIES, Item, is_procedural, split_domain
from megatron_rl.envs.rewards import extract_tag, reward
from megatron_rl.envs.types import EnvError, Task

log = logging.getLogger(__name__)

HELDOUT_SEED_OFFSET = 1 << 30
"""Held-out tasks are drawn with seed + this."""
DEFAULT_COUNTS = {"train": 64, "heldout": 16}
"""Tasks a generated domain makes per split when its config says 0."""
INSTRUCTIONS = ("Give your final answer inside <answer> </answer> tags, in the form the question asks for, e.g. "
                "<answer>42</answer>.")
ERRORS: dict[str, Counter] = {"make": Counter(), "score": Counter()}
"""Generator failures in this process, per domain: tasks left out (make), samples masked (score)."""


def split_seed(seed: int, split: str) -> int:
    return seed + HELDOUT_SEED_OFFSET if split == "heldout" else seed


def generate(domain: str, split: str | None = None, counts: dict | None = None, seed: int = 0,
             config: dict | None = None) -> list[Task]:
    """Tasks of library domain `domain` (both splits when `split` is None): counts[split] each (0 or missing:
    `DEFAULT_COUNTS`; fewer when the generator cannot make that many, see `draw`), drawn from `seed` with the
    generator's settings `config`. Made once per process."""
    n = {s: (counts or {}).get(s) or DEFAULT_COUNTS[s] for s in ("train", "heldout")}
    drawn = draw(domain, n["train"], n["heldout"], seed, json.dumps(config or {}, sort_keys=True))
    return [t for s in ([split] if split else ["train", "heldout"]) for t in drawn[s]]


TRAIN_DRAWS = 4
"""Train tasks are drawn from this many times as many candidates (those that raise or repeat a held-out question
are skipped)."""


@functools.lru_cache(maxsize=1024)
def draw(domain: str, n_train: int, n_heldout: int, seed: int, config_json: str) -> dict[str, tuple[Task, ...]]:
    """split -> tasks: `n_heldout` held-out tasks (indices 0.., seed + HELDOUT_SEED_OFFSET), then the first
    `n_train` of TRAIN_DRAWS * n_train train candidates (seed) whose question is no held-out question: disjoint by
    construction. A task the generator raises on is left out and counted (`ERRORS['make']`)."""
    heldout, failed = _make(domain, "heldout", range(n_heldout), n_heldout, seed, config_json)
    held = {t.prompt for t in heldout}
    train, failed_train = [], []
    size = TRAIN_DRAWS * n_train
    for start in range(0, size, n_train):  # in chunks: most generators fill the split from the first chunk
        tasks, bad = _make(domain, "train", range(start, start + n_train), size, seed, config_json)
        train += [t for t in tasks if t.prompt not in held][:n_train - len(train)]
        failed_train += bad
        if len(train) == n_train:
            break
    failed += failed_train
    if failed:
        ERRORS["make"][domain] += len(failed)
        log.warning("%s: the generator raised on %d task(s) (left out), e.g. %s", domain, len(failed), failed[0])
    return {"train": tuple(train), "heldout": tuple(heldout)}


def _make(domain: str, split: str, indices: range, size: int, seed: int, config_json: str
          ) -> tuple[list[Task], list[str]]:
    """Tasks `indices` of `split` (a dataset of `size`), and the errors of those the generator raised on."""
    lib_name, gen = _parts(domain)
    lib, config, s = LIBRARIES.get(lib_name), json.loads(config_json), split_seed(seed, split)
    version, tasks, failed = lib.version(), [], []
    for i in indices:
        try:
            item = _item(domain, s, size, i, config_json)
        except Exception as e:  # a generator bug: this task is left out, counted
            failed.append(f"{split} task {i}: {e.__class__.__name__}: {e}"[:200])
            continue
        prov = {"library": lib_name, "version": version, "generator": gen, "seed": s, "size": size, "index": i,
                "config": config}
        tasks.append(Task(id=f"{split}-{i:05d}", domain=domain, prompt=item.question, split=split,
                          payload={"answer": item.answer, "entry": _json_exact(item.entry), "provenance": prov},
                          source=f"{domain}:{split}:seed={s}:{i}"))
    return tasks, failed


def _parts(domain: str) -> tuple[str, str]:
    parts = split_domain(domain)
    if parts is None or not is_procedural(domain):
        raise EnvError(f"{domain!r} is not a generator of a registered task library (envs.procedural.LIBRARIES: "
                       f"{LIBRARIES.names()})")
    return parts


def _json_exact(entry):
    """`entry` when a JSON round trip gives it back unchanged (tuples, sets, Fractions do not), else None."""
    try:
        return entry if json.loads(json.dumps(entry)) == entry else None
    except (TypeError, ValueError, RecursionError):
        return None


@functools.lru_cache(maxsize=4096)
def _item(domain: str, seed: int, size: int, index: int, config_json: str) -> Item:
    """Task `index` as the library makes it (made once per process)."""
    lib_name, gen = _parts(domain)
    return LIBRARIES.get(lib_name).make(gen, json.loads(config_json), seed, size, index)


def task_entry(task: Task):
    """The library's record of `task` (from the payload, else made again from its seed and index)."""
    if task.payload.get("entry") is not None:
        return task.payload["entry"]
    p = task.payload["provenance"]
    return _item(task.domain, p["seed"], p["size"], p["index"], json.dumps(p["config"], sort_keys=True)).entry


@reward("procedural", version="1")
def procedural_reward(ctx: RewardContext) -> RewardOutput:
    """The generator's own score of the reply's <answer> text; a generator that raises masks the sample."""
    task, p = ctx.task, ctx.task.payload.get("provenance") or {}
    prov = {k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in p.items()}
    answer = extract_tag(ctx.response, "answer")
    if answer is None:
        return RewardOutput(0.0, "no <answer>...</answer>", prov)
    try:
        lib_name, gen = _parts(task.domain)
        score = LIBRARIES.get(lib_name).score(gen, p["config"], p["seed"], p["size"], answer, task_entry(task))
        if not (isinstance(score, (int, float)) and math.isfinite(score) and 0.0 <= score <= 1.0):
            raise ValueError(f"score {score!r} is not in [0, 1]")
    except Exception as e:  # the generator's bug, not the model's answer: mask the sample, count it
        ERRORS["score"][task.domain] += 1
        log.warning("%s: the generator raised while scoring task %s (sample masked): %s", task.domain, task.id, e)
        return RewardOutput(0.0, f"generator failed while scoring: {e.__class__.__name__}: {str(e)[:200]}", prov,
                            status="error")
    return RewardOutput(float(score), f"answer {answer[:60]!r} scored {score:.3g} by {task.domain}", prov)


class ProceduralEnvironment(SingleTurnEnvironment):
    """One answer in <answer> tags, scored by the generator (the base of every library domain's class)."""

    name = "procedural"
    instructions = INSTRUCTIONS

    def reward_spec(self) -> RewardSpec:
        return RewardSpec([RewardComponent("correct", "procedural", 1.0),
                           RewardComponent("format", "format", 0.1, {"kind": "answer_tag"})])

    def compact_prompt(self, task: Task) -> str:
        return self.render_prompt(task) + "\n"

    def reference_response(self, task: Task, corrupt: bool = False) -> str | None:
        """`<answer>reference</answer>`; corrupt: a wrong answer (`wrong_answer`). None when the generator has no
        reference answer."""
        answer = task.payload.get("answer")
        if not isinstance(answer, str):
            return None
        return f"<answer>{wrong_answer(task) if corrupt else answer}</answer>"


def wrong_answer(task: Task) -> str:
    """A wrong but well-formed answer to `task`: another task's reference answer (same generator, settings and
    seed) that the generator does not score 1.0 for this task, else 'none'."""
    p, answer = task.payload["provenance"], task.payload.get("answer")
    lib_name, gen = _parts(task.domain)
    lib, config_json = LIBRARIES.get(lib_name), json.dumps(p["config"], sort_keys=True)
    for j in range(1, min(9, p["size"])):
        try:
            other = _item(task.domain, p["seed"], p["size"], (p["index"] + j) % p["size"], config_json).answer
            if isinstance(other, str) and other.strip() != (answer or "").strip() and lib.score(
                    gen, p["config"], p["seed"], p["size"], other, task_entry(task)) < 1.0:
                return other
        except Exception:  # noqa: S112  (a neighbour the generator cannot make or score: try the next)
            continue
    return "none"


@functools.cache
def environment_class(domain: str) -> type[ProceduralEnvironment]:
    """The environment class of library domain `domain` (named after it)."""
    return type(f"Procedural[{domain}]", (ProceduralEnvironment,), {"name": domain, "__module__": __name__})


def _all_domains() -> list[str]:
    out = []
    for lib in LIBRARIES.names():
        out += [f"{lib}/{g}" for g in LIBRARIES.get(lib).generators()]
    return out


ENVIRONMENTS.add_family(lambda name: environment_class(name) if is_procedural(name) else None, _all_domains)
