"""The generated math, code and tool_use suites: sizes, held-out splits kept apart (no shared id or prompt; a
template shared across splits only within one family, whose held-out key values no train task uses), and
every task's reference answer scoring 1 (and a wrong one not) through the domain's real reward path.

Fast tests check a seeded sample of ~20 generated tasks per domain; the slow ones check all of them."""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import importlib
import random
import re

import pytest

from envs.base import make_env
from envs.sandbox import SandboxConfig
from envs.suite_gen import normalise, template
from envs.tasks import load_domain

DOMAINS = ["math", "code", "tool_use"]
SIZES = {"math": (440, 105), "code": (302, 76), "tool_use": (273, 69)}
"""(train, heldout) of the shipped suites."""
MIN_GENERATED = {"math": 400, "code": 300, "tool_use": 300}


def generated(domain: str) -> list:
    return [t for t in load_domain(domain) if "family" in t.payload]


def sample(domain: str, n: int = 20) -> list:
    tasks = generated(domain)
    return random.Random(f"sample-{domain}").sample(tasks, n)


def families(domain: str) -> dict:
    return {fam.name: fam for fam, _ in importlib.import_module(f"envs.{domain}.build_tasks").FAMILIES}


# ------------------------------------------------------------------------------------------- splits
@pytest.mark.parametrize("domain", DOMAINS)
def test_sizes_and_tiers(domain):
    train, held = load_domain(domain, split="train"), load_domain(domain, split="heldout")
    assert (len(train), len(held)) == SIZES[domain]
    gen = generated(domain)
    assert len(gen) >= MIN_GENERATED[domain]
    tiers = collections.Counter((t.payload["tier"], t.split) for t in gen)
    assert tiers[("easy", "train")] >= 60 and tiers[("easy", "heldout")] >= 10, tiers
    assert len(load_domain(domain)) - len(gen) >= 32  # the hand-written tasks are still there


def split_problems(tasks: list, fams: dict) -> list[str]:
    """Why `tasks` do not keep their held-out split apart (empty when they do)."""
    by_split = {s: [t for t in tasks if t.split == s] for s in ("train", "heldout")}
    ids = {t.id for t in by_split["train"]} & {t.id for t in by_split["heldout"]}
    problems = [f"id {i} in both splits" for i in ids]
    prompts = {normalise(t.prompt) for t in by_split["train"]} & {normalise(t.prompt) for t in by_split["heldout"]}
    problems += [f"prompt in both splits: {p[:60]!r}" for p in prompts]
    by_template = collections.defaultdict(list)
    for t in tasks:
        by_template[template(t.prompt)].append(t)
    for group in by_template.values():
        fam_names = {t.payload.get("family") for t in group}
        if len({t.split for t in group}) == 2 and (len(fam_names) > 1 or None in fam_names):
            problems.append(f"template in both splits outside one family: {[t.id for t in group][:4]}")
    for t in tasks:
        fam = fams.get(t.payload.get("family"))
        if fam and fam.is_held(t.payload["params"]) != (t.split == "heldout"):
            problems.append(f"{t.id}: key {fam.key}={t.payload['params'][fam.key]} against the band {fam.held}")
    return problems


@pytest.mark.parametrize("domain", DOMAINS)
def test_held_out_split_kept_apart(domain):
    """No id or (normalised) prompt in both splits; a prompt that differs from one in the other split only in
    its numbers only within one generated family, split by its key parameter's band."""
    tasks, fams = load_domain(domain), families(domain)
    assert split_problems(tasks, fams) == []
    keys = collections.defaultdict(lambda: {"train": set(), "heldout": set()})
    for t in generated(domain):
        keys[t.payload["family"]][t.split].add(t.payload["params"][fams[t.payload["family"]].key])
    assert set(keys) == set(fams)
    for name, k in keys.items():
        assert k["train"] and k["heldout"] and not k["train"] & k["heldout"], name


def test_split_check_catches_leaks():
    tasks, fams = load_domain("math"), families("math")
    held_gen = next(t for t in tasks if t.split == "heldout" and "family" in t.payload)
    held_hand = next(t for t in tasks if t.split == "heldout" and "family" not in t.payload)
    leaks = [
        dataclasses.replace(held_gen, id="leak-1", split="train", prompt=held_gen.prompt + " "),  # same prompt
        dataclasses.replace(held_gen, id="leak-2", split="train", prompt=held_gen.prompt.replace("$", "$ ")),
        dataclasses.replace(held_hand, id="leak-3", split="train", prompt=re.sub(r"\d+", "97", held_hand.prompt)),
    ]
    problems = [split_problems(tasks + [leak], fams) for leak in leaks]
    assert "prompt in both splits" in problems[0][0]
    assert any("against the band" in p for p in problems[1])
    assert any("outside one family" in p for p in problems[2])


# ------------------------------------------------------------------------------------------ rewards
def _math_scores(tasks):
    env = make_env("math")
    out = []
    for t in tasks:
        row = []
        for answer in (t.payload["answer"], f"{t.payload['answer']} + 1"):
            env.reset(t)
            row.append(env.step(f"So the answer is \\boxed{{{answer}}}.").reward_result.components["correct"])
        out.append((t.id, row))
    return out


def _tool_scores(tasks):
    env = make_env("tool_use")
    out = []
    for t in tasks:
        gold = t.payload["answer"]
        wrong = f"{gold}x" if isinstance(gold, str) else gold + 1
        row = []
        for answer in (gold, wrong):
            env.reset(t)
            row.append(env.step(f"<answer>{answer}</answer>").reward_result.components["correct"])
        out.append((t.id, row))
    return out


def _code_scores(tasks, workers: int = 2):
    sb = SandboxConfig(workers=workers).build()

    def one(t):
        env = make_env("code", sandbox=sb)
        rewards = []
        wrong = f"def {t.payload['entry_point']}(*args):\n    return None\n"
        for text in ("```python\n" + t.payload["canonical_solution"] + "```", f"```python\n{wrong}```", ""):
            env.reset(t)
            r = env.step(text)
            assert r.reward_result.valid, (t.id, r.reward_result.reasons)
            rewards.append(r.reward_result.components["tests"])
        return t.id, rewards

    try:
        with concurrent.futures.ThreadPoolExecutor(workers * 2) as ex:
            return list(ex.map(one, tasks))
    finally:
        sb.close()


def _assert_right_and_wrong(scores):
    bad = [(tid, s) for tid, s in scores if s[0] != 1.0 or any(x == 1.0 for x in s[1:])]
    assert not bad, bad[:5]


def test_math_sample_rewards():
    _assert_right_and_wrong(_math_scores(sample("math")))


def test_tool_use_sample_rewards():
    _assert_right_and_wrong(_tool_scores(sample("tool_use")))


@pytest.mark.slow
def test_code_sample_rewards():
    _assert_right_and_wrong(_code_scores(sample("code")))


@pytest.mark.slow
def test_math_all_rewards():
    _assert_right_and_wrong(_math_scores(generated("math")))


@pytest.mark.slow
def test_tool_use_all_rewards():
    _assert_right_and_wrong(_tool_scores(generated("tool_use")))


@pytest.mark.slow
def test_code_all_rewards():
    _assert_right_and_wrong(_code_scores(generated("code")))


def test_tool_use_builder_rejects_an_answer_its_recheck_disagrees_with(monkeypatch):
    builder = importlib.import_module("envs.tool_use.build_tasks")
    fam, render = builder.FAMILIES[0]

    def off_by_one(params):
        prompt, files, answer, tol, check = render(params)
        return prompt, files, answer + 1, tol, check

    monkeypatch.setattr(builder, "FAMILIES", [(fam, off_by_one)])
    with pytest.raises(AssertionError, match="recomputed"):
        builder.generated()


def test_code_builder_rejects_a_solution_that_fails_its_asserts(monkeypatch):
    builder = importlib.import_module("envs.code.build_tasks")
    fam, spec = builder.FAMILIES[0]
    wrong = dataclasses.replace(spec, source=lambda p: f"def {spec.entry}(x):\n    return x\n")
    monkeypatch.setattr(builder, "FAMILIES", [(fam, wrong)])
    with pytest.raises(AssertionError, match="canonical solution fails"):
        builder.generated()


def test_math_builder_rejects_a_wrong_answer(monkeypatch):
    builder = importlib.import_module("envs.math.build_tasks")
    monkeypatch.setattr(builder, "FAMILIES", builder.FAMILIES[:1])
    monkeypatch.setattr(builder, "_tex", lambda v: str(v + 1))
    with pytest.raises(AssertionError, match="does not equal the recomputed"):
        builder.build()
