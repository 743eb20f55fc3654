"""Layers that only point down: no import cycle between modules, no import against the layer order.

Every import under megatron_rl/, envs/, kernels/ and tools/ counts, also one inside a function (it runs the
moment the function does, and it ties the two modules together just the same). The order, lowest first:

    ground    megatron_rl.{config, registry, slurm_env, parallel, tokenizer} and the leaf helpers justified in
              GROUND below (they import nothing of the project but ground)
    megatron_rl.{kernels, envs}   (the folders kernels/ and envs/, installed under the project's namespace)
    megatron_rl.models
    megatron_rl.convert           (HF <-> Megatron mapping, readers, writers: a library of the product)
    megatron_rl.{data, rl, trainer, rollout, prompts}
    megatron_rl.dispatch
    megatron_rl.loop, megatron_rl.run_config
    megatron_rl.{driver, commands, cli} and the package facade megatron_rl/__init__.py
    megatron_rl.tools             (tools/: operator CLIs on top: they import the product, the product never imports
                                  them)

The folders envs/, kernels/ and tools/ are imported as megatron_rl.envs, megatron_rl.kernels and megatron_rl.tools
(links in megatron_rl/); their old top-level names are imported nowhere (one import style, and no clash with PyPI's
`envs` and `kernels`).

A module may import its own layer or any lower one; a cycle is an error at any distance. Modules of one layer may
import each other (e.g. rollout -> trainer) as long as that makes no cycle. A package's `__init__.py` is a module
of its own (importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` too, but those edges are not counted: a
package that imports its submodules, like `megatron_rl.rl` registering the built-in losses, is no cycle).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("megatron_rl", "envs", "kernels", "tools")

GROUND = {
    "megatron_rl.config": "the config loader: stdlib and yaml only",
    "megatron_rl.registry": "the plug-in registry: stdlib only",
    "megatron_rl.slurm_env": "reads the Slurm/torchrun environment: stdlib only",
    "megatron_rl.parallel": "the parallel layout config: imports config only",
    "megatron_rl.stages": "the pipeline stages' layer split (first/last counts, explicit layout): imports config only",
    "megatron_rl.tokenizer": "the tokenizer: imports config only",
    "megatron_rl.model_init": "what model.init names (kind, folder): path checks only, imports config only",
    "megatron_rl.distributed": "process-group set-up: imports parallel, slurm_env and compat only",
    "megatron_rl.compat": "Megatron-Core on machines it was not written for: imports torch and Megatron only",
    "megatron_rl.monitoring": "metrics sinks and /metrics: stdlib, http_auth and prometheus_text only",
    "megatron_rl.http_auth": "the bearer-token check and JSON error of every HTTP server: stdlib only",
    "megatron_rl.prometheus_text": "the Prometheus text renderer of every /metrics: stdlib only",
    "megatron_rl.eval_report": "pass@k arithmetic over result rows: stdlib only",
}

# (layer rank, module prefixes); the longest matching prefix decides
LAYERS = [
    (0, tuple(GROUND)),
    (1, ("megatron_rl.kernels", "megatron_rl.envs")),
    (2, ("megatron_rl.models",)),
    (3, ("megatron_rl.convert",)),
    (4, ("megatron_rl.data", "megatron_rl.rl", "megatron_rl.trainer", "megatron_rl.rollout",
         "megatron_rl.prompts")),
    (5, ("megatron_rl.dispatch",)),
    (6, ("megatron_rl.loop", "megatron_rl.run_config")),
    (7, ("megatron_rl.driver", "megatron_rl.commands", "megatron_rl.cli", "megatron_rl")),
    (8, ("megatron_rl.tools",)),
]

# cycles not broken yet: frozenset of the modules of one strongly connected component -> the reason
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


def layer_of(module: str) -> int | None:
    """The layer rank of `module`, None for a module outside the project."""
    best = None
    for rank, prefixes in LAYERS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (rank, p)
    return best[0] if best else None


NAMESPACED = ("envs", "kernels", "tools")
"""Top-level folders imported under the project's namespace (megatron_rl/<name> links to ../<name>)."""


def module_name(rel: str) -> str:
    """'envs/code/__init__.py' -> 'megatron_rl.envs.code'; 'megatron_rl/config.py' -> 'megatron_rl.config'."""
    parts = rel.removesuffix(".py").split("/")
    parts = ["megatron_rl", *parts] if parts[0] in NAMESPACED else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules `tree` (the source of `module`) imports, at any depth of the file."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {_owner(m, known) for m in out if _owner(m, known)} - {module}


def _owner(name: str, known: set[str]) -> str | None:
    """The longest known module that `name` is or lies inside (`a.b.func` -> `a.b`)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports, from {relative path: source}."""
    names = {module_name(rel): rel for rel in sources}
    known = set(names)
    return {m: imported(ast.parse(sources[rel]), m, rel.endswith("__init__.py"), known) for m, rel in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str, work: list) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        work.append((v, iter(sorted(graph.get(v, ())))))

    for root in sorted(graph):
        if root in index:
            continue
        work: list = []
        visit(root, work)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    visit(w, work)
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set(stack[stack.index(v):])
                del stack[stack.index(v):]
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for every import of a module in a higher layer than the importer's."""
    bad = []
    for m in sorted(graph):
        lm = layer_of(m)
        for d in sorted(graph[m]):
            ld = layer_of(d)
            if lm is not None and ld is not None and ld > lm:
                bad.append(f"{m} (layer {lm}) -> {d} (layer {ld})")
    return bad


@functools.cache
def project_sources(root: Path = ROOT) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for t in TREES for p in sorted((root / t).rglob("*.py"))}


@functools.cache
def project_graph() -> dict[str, set[str]]:
    return import_graph(project_sources())


def _describe(comp: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in sorted(comp) for b in sorted(graph[a] & comp)]
    return f"{len(comp)} modules: " + "; ".join(edges)


@pytest.mark.slow
def test_no_import_cycle():
    graph = project_graph()
    found = [c for c in cycles(graph) if c not in ALLOWED_CYCLES]
    assert not found, ("import cycles (break them: move the shared part into a lower module both import):\n  "
                       + "\n  ".join(_describe(c, graph) for c in found))


def test_the_allowed_cycles_still_exist():
    stale = set(ALLOWED_CYCLES) - set(cycles(project_graph()))
    assert not stale, f"ALLOWED_CYCLES lists cycles that are gone (remove them): {[sorted(c) for c in stale]}"


def test_no_upward_import():
    bad = upward_imports(project_graph())
    assert not bad, ("imports against the layer order (see this file's docstring; move the code down or pass "
                     "what is needed in from above):\n  " + "\n  ".join(bad))


# the product may name a tools module as a string (imported by name at run time) only here
TOOLS_BY_NAME = {
    "megatron_rl/cli.py": "the `megatron-rl` subcommand table dispatches `convert` and `plan` to the operator CLIs "
                          "by module name: the top of the stack, loaded only when that subcommand runs",
}


def tools_named_by_string(source: str) -> list[str]:
    """String constants of `source` that name a module of tools/ ('megatron_rl.tools.x...')."""
    return [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith("megatron_rl.tools.")]


def test_the_product_never_imports_tools():
    """No import of tools/ (any depth) under megatron_rl/, envs/, kernels/, nor a tools module named as a string
    (importlib) outside TOOLS_BY_NAME."""
    graph = project_graph()
    imports = [f"{m} -> {d}" for m in sorted(graph) if not m.startswith("megatron_rl.tools")
               for d in sorted(graph[m]) if d == "megatron_rl.tools" or d.startswith("megatron_rl.tools.")]
    named = [f"{rel}: {v}" for rel, src in project_sources().items() if not rel.startswith("tools/")
             and rel not in TOOLS_BY_NAME for v in tools_named_by_string(src)]
    assert not imports and not named, f"the product reaches into tools/: {imports + named}"


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in project_graph() if layer_of(m) is None)
    assert not unplaced, f"modules outside every layer (add them to LAYERS): {unplaced}"


def test_the_ground_modules_exist():
    known = set(project_graph())
    missing = [g for g in GROUND if g not in known]
    assert not missing, f"GROUND lists modules that no longer exist: {missing}"


# --- the detector itself ---------------------------------------------------------------------------------------

def test_a_cycle_through_an_import_inside_a_function_is_found():
    graph = import_graph({
        "envs/a.py": "import megatron_rl.envs.b\n",
        "envs/b.py": "def f():\n    from megatron_rl.envs.c import x\n",
        "envs/c.py": "from . import a\n",
        "envs/d.py": "import megatron_rl.envs.a\n",
    })
    assert cycles(graph) == [frozenset({"megatron_rl.envs.a", "megatron_rl.envs.b", "megatron_rl.envs.c"})]


def test_a_relative_import_inside_a_package_resolves():
    graph = import_graph({"envs/p/__init__.py": "from .q import y\n", "envs/p/q.py": "from ..r import z\n",
                          "envs/r.py": ""})
    assert graph == {"megatron_rl.envs.p": {"megatron_rl.envs.p.q"}, "megatron_rl.envs.p.q": {"megatron_rl.envs.r"},
                     "megatron_rl.envs.r": set()}


def test_a_tools_module_named_as_a_string_is_found():
    assert tools_named_by_string("import importlib\nimportlib.import_module('megatron_rl.tools.convert.cli')\n") == [
        "megatron_rl.tools.convert.cli"]
    assert tools_named_by_string("x = 'tools are nice'\n") == []


def test_an_upward_import_is_found():
    graph = import_graph({"envs/a.py": "def f():\n    from megatron_rl.loop import setup\n",
                          "megatron_rl/loop/setup.py": "", "megatron_rl/loop/__init__.py": ""})
    assert upward_imports(graph) == ["megatron_rl.envs.a (layer 1) -> megatron_rl.loop.setup (layer 6)"]


def test_the_product_importing_tools_is_upward():
    graph = import_graph({"megatron_rl/models/source.py": "from megatron_rl.tools.convert.cli import main\n",
                          "tools/convert/cli.py": ""})
    assert len(upward_imports(graph)) == 1


@pytest.mark.parametrize("code", [
    "from megatron_rl.config import ConfigError",  # ground
    "import megatron_rl.registry",
    "from megatron_rl.models.gpt import ModelConfig",  # one layer down
    "from megatron_rl.rollout.engine import Engine",  # own layer, another package
    "import numpy",  # outside the project
])
def test_an_allowed_import_passes(code):
    graph = import_graph({"megatron_rl/trainer/x.py": code, "megatron_rl/config.py": "",
                          "megatron_rl/registry.py": "", "megatron_rl/models/gpt.py": "",
                          "megatron_rl/rollout/engine.py": ""})
    assert upward_imports(graph) == [] and cycles(graph) == []


# --- one import style: the namespaced folders' old top-level names --------------------------------------------

def old_names(source: str) -> list[str]:
    """Imports in `source` of a namespaced folder by its old top-level name ('envs.x' instead of
    'megatron_rl.envs.x')."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        out += [n for n in names if n.split(".")[0] in NAMESPACED]
    return out


def test_nothing_imports_the_old_top_level_names():
    """Product, tests and benchmarks import envs/, kernels/ and tools/ only as megatron_rl.envs/kernels/tools (a
    second name would load every module twice, two registries; and PyPI's `envs`/`kernels` could win)."""
    files = [p for t in (*TREES, "tests", "benchmarks") for p in sorted((ROOT / t).rglob("*.py"))
             if "tasks" not in p.relative_to(ROOT).parts]
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in files for n in old_names(p.read_text())]
    assert not bad, f"import these as megatron_rl.<name>: {bad}"


def test_an_old_top_level_import_is_found():
    assert old_names("import envs\nfrom kernels.logprob import x\ndef f():\n    import tools.plan\n") == [
        "envs", "kernels.logprob", "tools.plan"]
    assert old_names("import megatron_rl.envs\nfrom megatron_rl.tools import plan\nfrom . import envs\n") == []


def test_the_namespaced_folders_are_links_in_the_package():
    for name in NAMESPACED:
        link = ROOT / "megatron_rl" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), link


# --- generic code names no domain -----------------------------------------------------------------------------

def domain_packages(root: Path = ROOT) -> set[str]:
    """The domain packages: folders of envs/ whose modules register an environment (`@ENVIRONMENTS.register`)."""
    return {f"megatron_rl.envs.{p.parent.relative_to(root / 'envs').parts[0]}" for p in (root / "envs").rglob("*.py")
            if len(p.relative_to(root / "envs").parts) > 1 and "ENVIRONMENTS.register(" in p.read_text()}


def domain_imports(graph: dict[str, set[str]], domains: set[str]) -> list[str]:
    """Imports of a domain package (any module in it) by a module outside megatron_rl.envs and tools (generic
    layers: a domain's knowledge stays in its package, reached through envs' registries)."""
    return [f"{m} -> {d}" for m in sorted(graph) if not m.startswith(("megatron_rl.envs", "megatron_rl.tools"))
            for d in sorted(graph[m]) if any(d == p or d.startswith(p + ".") for p in domains)]


def test_the_domain_packages_are_found():
    assert {"megatron_rl.envs.countdown", "megatron_rl.envs.code", "megatron_rl.envs.harbor"} <= domain_packages()


def test_generic_layers_import_no_domain():
    bad = domain_imports(project_graph(), domain_packages())
    assert not bad, ("generic code imports a domain package (give the domain a hook in envs -- a registry, the "
                     "Environment interface, envs.task_source -- and call that):\n  " + "\n  ".join(bad))


def test_a_domain_import_by_generic_code_is_found():
    graph = import_graph({"megatron_rl/run_config.py": "from megatron_rl.envs.countdown.curriculum import C\n",
                          "envs/countdown/curriculum.py": "", "envs/countdown/__init__.py": "",
                          "envs/mixture.py": "from megatron_rl.envs.countdown import curriculum\n"})
    assert domain_imports(graph, {"megatron_rl.envs.countdown"}) == [
        "megatron_rl.run_config -> megatron_rl.envs.countdown.curriculum"]
