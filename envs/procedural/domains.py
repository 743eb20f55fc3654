"""`envs.domains` by pattern, and the checks of generated domains (before any rank starts).

A key of `envs.domains` is a domain name, or a pattern that stands for several:

    envs:
      domains:
        reasoning_gym/*: {weight: 1, train_tasks: 32}          # a glob over every registered domain
        reasoning_gym:arithmetic: {generator: {seed: 0}}       # a library's category (its package subfolder)
        reasoning_gym/basic_arithmetic: {weight: 3, generator: {min_terms: 2}}   # one domain: overrides
        countdown: {weight: 1}

Patterns apply in the order written, then exact names on top: each sets the fields it names (its shared settings),
and `generator` and `reward_weights` merge key by key, so a per-domain override changes only what it names. A
pattern that matches nothing, an unknown library or category, is refused naming it. The loader replaces the
patterns by the domains they matched (`expand`), keeping pattern -> domains in `envs.patterns`, which the run saves
with its config.yaml and logs.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

from megatron_rl.envs.procedural.contract import (
    LIBRARIES,
    difficulty_levels,
    is_procedural,
    library_domains,
    split_domain,
)

CATEGORY_SEP = ":"
_MERGED = ("generator", "reward_weights")


def is_pattern(key: str) -> bool:
    """Whether an `envs.domains` key is a pattern (a glob or `<library>:<category>`), not a domain name."""
    return any(c in key for c in "*?[") or CATEGORY_SEP in key


def matches(pattern: str, where: str = "envs.domains") -> list[str]:
    """The domains `pattern` stands for (sorted); ConfigError naming it when none or it is malformed."""
    from megatron_rl.config import ConfigError
    from megatron_rl.envs.base import ENVIRONMENTS

    if CATEGORY_SEP in pattern:
        lib, _, category = pattern.partition(CATEGORY_SEP)
        if lib not in LIBRARIES:
            raise ConfigError(f"{where}.{pattern}: {lib!r} is not a registered task library; known: "
                              f"{LIBRARIES.names()} (a category pattern is <library>:<category>)")
        domains = library_domains(lib)
        found = sorted(d for d, c in domains.items() if fnmatch.fnmatchcase(c, category))
        if not found:
            raise ConfigError(f"{where}.{pattern}: no category {category!r} in task library {lib!r}; its "
                              f"categories: {sorted(set(domains.values()))}")
        return found
    found = sorted(n for n in ENVIRONMENTS.names() if fnmatch.fnmatchcase(n, pattern))
    if not found:
        raise ConfigError(f"{where}.{pattern}: the pattern matches no registered domain (libraries: "
                          f"{LIBRARIES.names()}; e.g. reasoning_gym/*, reasoning_gym:arithmetic)")
    return found


def _merge(into: dict, settings: dict) -> None:
    for k, v in settings.items():
        if k in _MERGED and isinstance(v, dict) and isinstance(into.get(k), dict):
            into[k] = {**into[k], **v}
        else:
            into[k] = v


def expand(domains: dict[str, Any], where: str = "envs.domains") -> tuple[dict[str, dict], dict[str, list[str]]]:
    """(domain -> its settings, pattern -> the domains it matched) of a raw `envs.domains` mapping (settings are
    mappings, or None for the defaults)."""
    from megatron_rl.config import ConfigError, to_dict

    out: dict[str, dict] = {}
    patterns: dict[str, list[str]] = {}
    exact = [k for k in domains if not is_pattern(k)]
    for key in [k for k in domains if is_pattern(k)] + exact:
        settings = domains[key] if domains[key] is not None else {}
        if dataclasses.is_dataclass(settings):  # a DomainConfig built in code: every field is set
            settings = to_dict(settings)
        if not isinstance(settings, dict):
            raise ConfigError(f"{where}.{key}: expected a mapping of domain settings, got {settings!r}")
        names = [key]
        if is_pattern(key):
            names = patterns[key] = matches(key, where)
        for name in names:
            _merge(out.setdefault(name, {}), settings)
    return out, patterns


def prepare_mixture(data: dict, prefix: str = "envs") -> dict:
    """The raw `envs:` mapping with its domain patterns expanded (`MixtureConfig.prepare_config`)."""
    domains = data.get("domains")
    if not isinstance(domains, dict) or not any(isinstance(k, str) and is_pattern(k) for k in domains):
        return data
    import megatron_rl.envs  # noqa: F401  (registers the environments the patterns match)

    expanded, patterns = expand(domains, f"{prefix}.domains" if prefix else "envs.domains")
    return {**data, "domains": expanded, "patterns": {**(data.get("patterns") or {}), **patterns}}


def check_domain(name: str, d) -> None:
    """Refuse before any work: settings of a generated domain on another domain, generated tasks with task files,
    unknown generator settings (cheap: runs wherever the mixture loads, rollout workers too)."""
    from megatron_rl.config import ConfigError

    key = f"envs.domains.{name}"
    if not is_procedural(name):
        if d.generator or d.seed or d.levels:
            raise ConfigError(f"{key}: generator, seed and levels apply to a task library's domains (e.g. "
                              f"reasoning_gym/<generator>) only; {name!r} has a task suite")
        return
    if d.task_files:
        raise ConfigError(f"{key}.task_files: {name!r} generates its tasks; drop task_files (set train_tasks, "
                          f"heldout_tasks, seed, generator instead)")
    lib, gen = split_domain(name)
    try:
        LIBRARIES.get(lib).check_config(gen, dict(d.generator))
    except ValueError as e:
        raise ConfigError(f"{key}.generator: {e}") from None
    if d.levels:
        have = len(difficulty_levels(name))
        if not 0 < d.levels <= have:
            raise ConfigError(f"{key}.levels={d.levels}: {name!r} has {have} difficulty level(s) in its generator's "
                              f"curriculum; need 1 <= levels <= {have}" + (" (or 0: fixed settings)" if have else
                                                                           "; set levels: 0"))


def check_splits(name: str, d, tasks) -> None:
    """Refuse a generated domain whose generator cannot fill its splits, or whose held-out questions are train
    questions (makes the tasks: `tasks(split)`, the driver's, before any rank starts)."""
    from megatron_rl.config import ConfigError
    from megatron_rl.envs.procedural.env import DEFAULT_COUNTS, TRAIN_DRAWS

    key = f"envs.domains.{name}"
    train, heldout = tasks("train"), tasks("heldout")
    if not heldout:
        raise ConfigError(f"{key}: the generator raised on every held-out task (see the log); change its "
                          f"generator settings or drop the domain")
    want = d.train_tasks or DEFAULT_COUNTS["train"]
    if len(train) < want:
        raise ConfigError(f"{key}: only {len(train)} of train_tasks={want} train tasks could be made that are no "
                          f"held-out question ({TRAIN_DRAWS * want} drawn; the generator has few distinct tasks at "
                          f"these settings, or raised, see the log): lower train_tasks/heldout_tasks, or make it "
                          f"harder (generator settings)")
    shared = {t.prompt for t in train} & {t.prompt for t in heldout}
    if shared:
        raise ConfigError(f"{key}: {len(shared)} held-out question(s) are also train questions (e.g. "
                          f"{sorted(shared)[0][:120]!r}); the generator is not deterministic")


def unknown_domain_message(name: str) -> str:
    """Why `name` is not a domain: an unknown or excluded generator of a library, or no registered environment."""
    lib, sep, gen = name.partition("/")
    if sep and lib in LIBRARIES:
        library = LIBRARIES.get(lib)
        why = getattr(library, "excluded", {}).get(gen)
        if why:
            return f"{lib}'s generator {gen!r} is not a domain: {why}"
        return f"{lib} has no generator {gen!r}; its generators: {sorted(library.generators())}"
    return ""


def resolved(mixture) -> dict:
    """The run's resolved domain list (saved as <run>/envs_domains.json): each pattern and the domains it matched,
    every domain with its weight (and a generated one's category, task counts, seed, settings), and the tasks each
    generator failed to make in this process."""
    from megatron_rl.envs.procedural.env import ERRORS

    out = {}
    for name, d in mixture.domains.items():
        row = {"weight": d.weight}
        if is_procedural(name):
            lib, gen = split_domain(name)
            row.update(category=LIBRARIES.get(lib).generators()[gen], train_tasks=d.train_tasks,
                       heldout_tasks=d.heldout_tasks, seed=d.seed, generator=dict(d.generator))
        out[name] = row
    return {"patterns": dict(mixture.patterns), "domains": out, "tasks_not_made": dict(ERRORS["make"])}


def describe(mixture) -> str:
    """One line for the run's log: how many domains, from which patterns."""
    pats = "; ".join(f"{p} -> {len(ds)}" for p, ds in mixture.patterns.items())
    return f"envs.domains: {len(mixture.domains)} domains ({pats or 'no patterns'})"
