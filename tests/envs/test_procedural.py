"""Procedural task libraries as domains (envs/procedural): every reasoning-gym generator makes disjoint train and
held-out tasks and its own reference answer scores 1.0 through our reward path (a wrong one below it); the plugin
contract holds for every registered library; `envs.domains` patterns expand (globs, categories, overrides); bad
input is refused naming it; a generator that raises is masked and counted; a mixture of 100+ domains with a
multi-turn and a judged domain runs episodes on a rollout worker's runner with the scripted test policy."""
from __future__ import annotations

import json
import random

import pytest

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.envs.base import ENVIRONMENTS, make_env
from megatron_rl.envs.mixture import DomainConfig, MixtureConfig
from megatron_rl.envs.procedural import LIBRARIES, Item, TaskLibrary, register_library
from megatron_rl.envs.procedural.domains import expand
from megatron_rl.envs.procedural.env import ERRORS, generate
from megatron_rl.envs.procedural.rgym import ReasoningGym

RG = ReasoningGym()
NO_REFERENCE = {"boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour"}
"""reasoning-gym generators whose tasks have several right answers and no reference (answer None)."""


class Tiny:
    """A second task library in a few lines (the contract's example): 'What is n + 1?'. Generator `flaky` raises
    making every third task and scoring the answer 'boom'."""

    name = "tiny"

    def version(self):
        return "0.1"

    def generators(self):
        return {"succ": "arithmetic", "flaky": "arithmetic"}

    def check_config(self, generator, config):
        unknown = sorted(set(config) - {"span"})
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}; known: ['span']")

    def make(self, generator, config, seed, size, index):
        if generator == "flaky" and index % 3 == 1:
            raise RuntimeError("flaky generator")
        n = random.Random(seed * 100_003 + index).randrange(config.get("span", 10**6))
        return Item(f"What is {n} + 1?", str(n + 1), {"n": n})

    def score(self, generator, config, seed, size, answer, entry):
        if answer == "boom":
            raise RuntimeError("scorer bug")
        return 1.0 if answer == str(entry["n"] + 1) else 0.0


@pytest.fixture()
def tiny():
    register_library(Tiny(), overwrite=True)
    yield "tiny"
    LIBRARIES._items.pop("tiny", None)
    for name in [n for n in ENVIRONMENTS._items if n.startswith("tiny/")]:
        ENVIRONMENTS._items.pop(name)


def play(env, task, response):
    env.reset(task)
    return env.step(response)


SLOW = {"arc_agi", "futoshiki", "intermediate_integration", "knight_swap", "puzzle24", "quantum_lock", "sokoban",
        "zebra_puzzles"}
"""Generators that take over a second of CPU for a few tasks (knight_swap: about a second a task)."""


@pytest.mark.parametrize("generator", [pytest.param(g, marks=pytest.mark.slow) if g in SLOW else g
                                       for g in sorted(RG.generators())])
def test_every_generator_makes_disjoint_splits_and_scores_its_reference(generator):
    domain = f"reasoning_gym/{generator}"
    tasks = generate(domain, counts={"train": 2, "heldout": 2})
    train, heldout = [t for t in tasks if t.split == "train"], [t for t in tasks if t.split == "heldout"]
    assert len(train) == len(heldout) == 2
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    env = make_env(domain)
    for t in tasks:
        prov = t.payload["provenance"]
        assert (prov["library"], prov["version"], prov["generator"]) == ("reasoning_gym", "0.1.25", generator)
        assert prov["seed"] == (0 if t.split == "train" else 1 << 30)
        ref = env.reference_response(t)
        assert (ref is None) == (generator in NO_REFERENCE)
        if ref is not None:
            r = play(env, t, ref)
            assert r.info["status"] == "ok" and r.reward_result.components == {"correct": 1.0, "format": 1.0}, \
                r.reward_result.reasons
        wrong = play(env, t, env.reference_response(t, corrupt=True) or "<answer>none</answer>")
        assert wrong.info["status"] == "error" or wrong.reward_result.components["correct"] < 1.0, \
            wrong.reward_result.reasons


def test_the_contract_holds_for_every_registered_library(tiny):
    assert {"reasoning_gym", "tiny"} <= set(LIBRARIES.names())
    for name, lib in LIBRARIES.items():
        assert isinstance(lib, TaskLibrary) and lib.name == name and isinstance(lib.version(), str)
        gens = lib.generators()
        assert gens and all(isinstance(g, str) and isinstance(c, str) for g, c in gens.items())
        for g in gens:
            assert f"{name}/{g}" in ENVIRONMENTS
            lib.check_config(g, {})
            with pytest.raises(ValueError, match="no_such_setting"):
                lib.check_config(g, {"no_such_setting": 1})
        for g in sorted(gens)[:4]:
            a, b = lib.make(g, {}, 7, 4, 0), lib.make(g, {}, 7, 4, 0)
            assert isinstance(a, Item) and a.question == b.question and a.answer == b.answer  # deterministic
            if a.answer is not None:
                assert lib.score(g, {}, 7, 4, a.answer, a.entry) == 1.0


def test_patterns_expand_globs_and_categories_with_overrides():
    raw = {"reasoning_gym/basic_arithmetic": {"weight": 3, "generator": {"min_terms": 3}},
           "reasoning_gym:arithmetic": {"train_tasks": 2, "generator": {"max_terms": 4, "min_terms": 2}},
           "reasoning_gym/*_arithmetic": {"weight": 2},
           "countdown": None}
    domains, patterns = expand(raw)
    arithmetic = [d for d, c in RG.generators().items() if c == "arithmetic"]
    assert patterns["reasoning_gym:arithmetic"] == sorted(f"reasoning_gym/{g}" for g in arithmetic)
    assert "reasoning_gym/complex_arithmetic" in patterns["reasoning_gym/*_arithmetic"]  # an algebra generator
    assert len(arithmetic) == 18 and set(domains) == {*patterns["reasoning_gym:arithmetic"],
                                                       *patterns["reasoning_gym/*_arithmetic"], "countdown"}
    # patterns in order, then the exact name; generator settings merge key by key
    assert domains["reasoning_gym/basic_arithmetic"] == {"weight": 3, "train_tasks": 2,
                                                         "generator": {"max_terms": 4, "min_terms": 3}}
    assert domains["reasoning_gym/gcd"] == {"train_tasks": 2, "generator": {"max_terms": 4, "min_terms": 2}}
    assert domains["reasoning_gym/complex_arithmetic"] == {"weight": 2} and domains["countdown"] == {}


def test_the_config_loader_resolves_patterns_and_records_them():
    mix = from_dict(MixtureConfig, {"domains": {"reasoning_gym:geometry": {"train_tasks": 2, "heldout_tasks": 1},
                                                "reasoning_gym/simple_geometry": {"weight": 0.5, "seed": 3}}})
    assert sorted(mix.domains) == ["reasoning_gym/advanced_geometry", "reasoning_gym/simple_geometry"]
    assert mix.patterns == {"reasoning_gym:geometry": sorted(mix.domains)}
    simple = mix.domains["reasoning_gym/simple_geometry"]
    assert (simple.weight, simple.seed, simple.train_tasks, simple.heldout_tasks) == (0.5, 3, 2, 1)
    mix.check_generated()
    tasks = mix.tasks("train")
    assert {d: len(ts) for d, ts in tasks.items()} == {d: 2 for d in mix.domains}
    assert tasks["reasoning_gym/simple_geometry"][0].payload["provenance"]["seed"] == 3
    # a mixture built in code expands the same way when validated
    code = MixtureConfig(domains={"reasoning_gym:geometry": DomainConfig(weight=2)})
    code.validate()
    assert sorted(code.domains) == sorted(mix.domains) and code.domains["reasoning_gym/simple_geometry"].weight == 2


@pytest.mark.parametrize("domains, message", [
    ({"reasoning_gym:nope": {}}, "envs.domains.reasoning_gym:nope: no category 'nope'"),
    ({"nolib:arithmetic": {}}, "'nolib' is not a registered task library"),
    ({"reasoning_gym/zzz*": {}}, "envs.domains.reasoning_gym/zzz*: the pattern matches no registered domain"),
    ({"reasoning_gym/zzz": {}}, "reasoning_gym has no generator 'zzz'"),
    ({"reasoning_gym/game_of_life_halting": {}}, "game_of_life_halting' is not a domain: its score_answer"),
    ({"reasoning_gym/gcd": {"generator": {"difficulty": 3}}},
     "envs.domains.reasoning_gym/gcd.generator: unknown setting(s) ['difficulty']"),
    ({"reasoning_gym/gcd": {"generator": {"min_value": 0}}}, "envs.domains.reasoning_gym/gcd.generator: "),
    ({"countdown": {"generator": {"span": 3}}}, "envs.domains.countdown: generator, seed and levels apply"),
    ({"reasoning_gym/gcd": {"task_files": ["x.jsonl"]}}, "envs.domains.reasoning_gym/gcd.task_files"),
    ({"reasoning_gym/*": "heavy"}, "envs.domains.reasoning_gym/*: expected a mapping"),
])
def test_bad_input_is_refused_naming_it(domains, message):
    with pytest.raises(ConfigError) as e:
        from_dict(MixtureConfig, {"domains": domains})
    assert message in str(e.value)


def test_train_tasks_avoid_heldout_questions_and_a_domain_that_cannot_fill_its_split_is_refused(tiny):
    mix = MixtureConfig(domains={"tiny/succ": DomainConfig(train_tasks=6, heldout_tasks=2, generator={"span": 3})})
    mix.validate()
    mix.check_generated()
    train, held = mix.tasks("train")["tiny/succ"], mix.tasks("heldout")["tiny/succ"]
    assert len(train) == 6 and not {t.prompt for t in train} & {t.prompt for t in held}
    one = MixtureConfig(domains={"tiny/succ": DomainConfig(train_tasks=2, heldout_tasks=2, generator={"span": 1})})
    one.validate()
    with pytest.raises(ConfigError, match=r"envs.domains.tiny/succ: only 0 of train_tasks=2 train tasks"):
        one.check_generated()


def test_a_generator_that_raises_is_masked_and_counted(tiny):
    from megatron_rl.envs.sampler import DomainMetrics

    made = ERRORS["make"]["tiny/flaky"]
    tasks = generate("tiny/flaky", counts={"train": 6, "heldout": 3}, seed=11)
    held = [t for t in tasks if t.split == "heldout"]
    assert [t.id for t in held] == ["heldout-00000", "heldout-00002"]  # task 1 raised: left out
    assert len([t for t in tasks if t.split == "train"]) == 6  # filled from further candidates
    assert ERRORS["make"]["tiny/flaky"] - made == 1 + 4  # held-out 1; train: two chunks of 6 (1, 4, 7, 10)
    env, scored, metrics = make_env("tiny/flaky"), ERRORS["score"]["tiny/flaky"], DomainMetrics()
    bad = play(env, held[0], "<answer>boom</answer>")
    assert bad.info["status"] == "error" and not bad.reward_result.valid  # masked, not a zero to train on
    assert "scorer bug" in bad.reward_result.reasons["correct"]
    good = play(env, held[0], env.reference_response(held[0]))
    assert good.reward == pytest.approx(1.1) and ERRORS["score"]["tiny/flaky"] - scored == 1
    for r in (bad, good):
        metrics.record("tiny/flaky", r.reward_result, r.info["status"])
    m = metrics.summary()
    assert m["tiny/flaky/infra_error_frac"] == 0.5 and m["tiny/flaky/reward_mean"] == pytest.approx(1.1)


@pytest.mark.slow
def test_a_100_domain_mixture_with_multi_turn_and_judged_domains_runs_on_a_worker(tmp_path):
    """Every reasoning-gym domain plus tool_use (multi-turn) and docqa (judged; rules only without a judge), one
    train task each, played on a rollout worker's runner (the worker builds its environments from the spec's
    mixture) by the scripted test policy, which answers from the task's reference."""
    from megatron_rl.data.shards import read_shard
    from megatron_rl.dispatch import GeneratorConfig, WorkerConfig, WorkerSpec, episodes_from_tasks
    from megatron_rl.dispatch.publisher import ShardPublisher
    from megatron_rl.dispatch.worker import EpisodeRunner

    mix = MixtureConfig(domains={"reasoning_gym/*": DomainConfig(train_tasks=2, heldout_tasks=2),  # as above: made once
                                 "tool_use": DomainConfig(max_turns=3), "docqa": DomainConfig()})
    mix.validate()
    assert len(mix.domains) >= 100 and mix.patterns["reasoning_gym/*"] == sorted(
        f"reasoning_gym/{g}" for g in RG.generators())
    tasks = [ts[0] for ts in mix.tasks("train").values()]
    spec = WorkerSpec(episodes=episodes_from_tasks(tasks), shard_dir=str(tmp_path / "shards"),
                      worker=WorkerConfig(threads=2, max_tokens=1 << 16, envs=mix, generator=GeneratorConfig()))
    runner = EpisodeRunner(spec, ShardPublisher(tmp_path / "shards", "w", 0))
    try:
        runner.run(iter(spec.episodes))
        runner.publisher.flush()
    finally:
        runner.close()
    trajs = [t for p in sorted((tmp_path / "shards").rglob("*.h5")) for t in read_shard(p)]
    by_env = {t.env: t for t in trajs}
    assert set(by_env) == set(mix.domains) and not runner.failed
    for name, t in by_env.items():
        if name.startswith("reasoning_gym/"):
            assert t.provenance["task.library"] == "reasoning_gym" and json.loads(t.provenance["task.index"]) >= 0
            if name.split("/")[1] not in NO_REFERENCE:  # the reference answer scores 1 (masked: status error)
                assert t.status == "error" or t.reward_components["correct"] == 1.0, (name, t.reward_components)
    assert sum(t.reward_components.get("correct") == 1.0 for t in trajs) >= 95
    assert by_env["tool_use"].status in ("ok", "truncated") and by_env["docqa"].status == "ok"


@pytest.mark.slow  # a fresh interpreter importing the whole library (~10 CPU-s)
def test_without_pycosat_the_library_loads_and_only_zebra_puzzles_is_refused_naming_it():
    """The default set-up installs reasoning-gym with --no-deps (pycosat has no wheel for Python 3.11 and compiles
    C). In a process where pycosat cannot be imported, reasoning-gym still loads (it imports every generator's
    module on import), every other generator is a domain, and reasoning_gym/zebra_puzzles is refused before any
    work, naming pycosat and the fix."""
    import subprocess
    import sys

    code = """
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pycosat":
            raise ModuleNotFoundError("No module named 'pycosat'", name="pycosat")
sys.meta_path.insert(0, Block())
from megatron_rl.envs.mixture import MixtureConfig
from megatron_rl.envs.procedural.env import generate
from megatron_rl.envs.procedural.rgym import ReasoningGym
from megatron_rl.config import ConfigError, from_dict
gens = ReasoningGym().generators()
tasks = generate("reasoning_gym/basic_arithmetic", counts={"train": 1, "heldout": 1})
try:
    from_dict(MixtureConfig, {"domains": {"reasoning_gym/zebra_puzzles": {}}})
    err = ""
except ConfigError as e:
    err = str(e)
import inspect
stub_probe = hasattr(sys.modules["pycosat"], "__file__")  # module probes (inspect, torch) see a plain module
import torch.distributed.tensor  # registers custom ops: inspect.getmodule walks every module in sys.modules
try:
    sys.modules["pycosat"].itersolve([[1]])
    call = ""
except ModuleNotFoundError as e:
    call = str(e)
print(json.dumps({"n": len(gens), "zebra": "zebra_puzzles" in gens, "tasks": len(tasks), "err": err,
                  "probe": stub_probe, "call": call}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    here = RG.generators()  # this process: zebra_puzzles is a domain only where pycosat is installed
    assert got["n"] == len(here) - ("zebra_puzzles" in here) and not got["zebra"] and got["tasks"] == 2
    assert "zebra_puzzles' is not a domain: it needs pycosat" in got["err"] and "pip install pycosat" in got["err"]
    assert got["probe"] is False and "pycosat is not installed" in got["call"]


def test_difficulty_levels_come_from_the_generators_own_curriculum_and_climb_from_level_0():
    """reasoning-gym's curricula give each generator's settings per level (easiest first; only what the curriculum
    moves); `envs.domains.<d>.levels: N` makes train tasks per level with those settings (own seed, ids L<i>-...,
    none a held-out question), scored with the settings they were made with; the run's task lists carry them."""
    from megatron_rl.envs.procedural.contract import difficulty_levels

    levels = difficulty_levels("reasoning_gym/basic_arithmetic")
    assert len(levels) >= 3 and levels[0]["max_terms"] < levels[2]["max_terms"]
    for settings in levels:
        RG.check_config("basic_arithmetic", settings)  # each level is a valid setting of the generator
    assert difficulty_levels("tiny/succ") == [] and difficulty_levels("countdown") == []
    d = "reasoning_gym/basic_arithmetic"
    mix = from_dict(MixtureConfig, {"domains": {d: {"levels": 3, "train_tasks": 6, "heldout_tasks": 4,
                                                    "generator": {"allow_negation": False}}}}, prefix="envs")
    per_level = mix.level_tasks()[d]
    held = {t.prompt for t in mix.tasks("heldout")[d]}
    assert len(per_level) == 3 and all(per_level)
    for i, tasks in enumerate(per_level):
        config = {**levels[i], "allow_negation": False}
        assert all(t.id.startswith(f"L{i}-train-") and t.prompt not in held for t in tasks)
        assert all(t.payload["provenance"]["config"] == config for t in tasks)
        env = make_env(d)
        assert play(env, tasks[0], f"<answer>{tasks[0].payload['answer']}</answer>").reward == pytest.approx(1.1)
    assert len({t.id for ts in per_level for t in ts}) == sum(map(len, per_level))


def test_levels_are_refused_where_they_cannot_apply(tiny):
    with pytest.raises(ConfigError, match=r"envs.domains.countdown: generator, seed and levels apply to a task "):
        from_dict(MixtureConfig, {"domains": {"countdown": {"levels": 2}}}, prefix="envs")
    with pytest.raises(ConfigError, match=r"envs.domains.tiny/succ.levels=1: 'tiny/succ' has 0 difficulty level"):
        from_dict(MixtureConfig, {"domains": {"tiny/succ": {"levels": 1}}}, prefix="envs")
    have = len(RG.levels("basic_arithmetic"))
    with pytest.raises(ConfigError, match=rf"levels={have + 1}: .* has {have} difficulty level\(s\) .* need 1 <= "):
        from_dict(MixtureConfig, {"domains": {"reasoning_gym/basic_arithmetic": {"levels": have + 1}}}, prefix="envs")


def test_the_run_builds_its_sampler_over_the_levels(repo_root):
    """The product path: a run config with levels -> task_lists/fitting (prompts that fit the context) -> the
    loop's sampler draws from level 0 of that domain first."""
    from megatron_rl import load_config
    from megatron_rl.envs.sampler import DomainSampler
    from megatron_rl.loop.job import fitting, task_lists

    d = "reasoning_gym/chain_sum"
    cfg = load_config(str(repo_root / "configs" / "post_train_cpu.yaml"),
                      [f"envs.domains={{{d}: {{levels: 2, train_tasks: 4, heldout_tasks: 2}}}}"])
    tasks = fitting(task_lists(cfg), cfg.tokenizer.build(cfg.model), cfg)  # the main job's model and tokenizer
    assert [len(ts) for ts in tasks["levels"][d]] == [4, 4]
    sampler = DomainSampler(tasks["rl"], {d: 1.0}, seed=0, curriculum=cfg.envs.curriculum, levels=tasks["levels"])
    assert sampler.next().id.startswith("L0-") and sampler.level_metrics() == {f"{d}/level": 0.0}
