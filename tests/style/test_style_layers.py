"""Layers that only point down: no import cycle between modules, no import against the layer order.

Every import under megatron_rl/, envs/, kernels/ and tools/ counts, also one inside a function (it runs the
moment the function does, and it ties the two modules together just the same). The order, lowest first:

    ground    megatron_rl.{config, registry, slurm_env, parallel, tokenizer} and the leaf helpers justified in
              GROUND below (they import nothing of the project but ground)
    kernels, envs
    megatron_rl.models
    megatron_rl.convert           (HF <-> Megatron mapping, readers, writers: a library of the product)
    megatron_rl.{data, rl, trainer, rollout, prompts}
    megatron_rl.dispatch
    megatron_rl.loop, megatron_rl.run_config
    megatron_rl.{driver, commands, cli} and the package facade megatron_rl/__init__.py
    tools                         (operator CLIs on top: they import the product, the product never imports them)

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
    "megatron_rl.monitoring": "metrics sinks and /metrics: stdlib only",
    "megatron_rl.eval_report": "pass@k arithmetic over result rows: stdlib only",
}

# (layer rank, module prefixes); the longest matching prefix decides
LAYERS = [
    (0, tuple(GROUND)),
    (1, ("kernels", "envs")),
    (2, ("megatron_rl.models",)),
    (3, ("megatron_rl.convert",)),
    (4, ("megatron_rl.data", "megatron_rl.rl", "megatron_rl.trainer", "megatron_rl.rollout",
         "megatron_rl.prompts")),
    (5, ("megatron_rl.dispatch",)),
    (6, ("megatron_rl.loop", "megatron_rl.run_config")),
    (7, ("megatron_rl.driver", "megatron_rl.commands", "megatron_rl.cli", "megatron_rl")),
    (8, ("tools",)),
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


def module_name(rel: str) -> str:
    """'envs/code/__init__.py' -> 'envs.code'."""
    parts = rel.removesuffix(".py").split("/")
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
    """String constants of `source` that name a module of tools/ ('tools.x...')."""
    return [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.startswith("tools.")]


def test_the_product_never_imports_tools():
    """No import of tools/ (any depth) under megatron_rl/, envs/, kernels/, nor a tools module named as a string
    (importlib) outside TOOLS_BY_NAME."""
    graph = project_graph()
    imports = [f"{m} -> {d}" for m in sorted(graph) if not m.startswith("tools")
               for d in sorted(graph[m]) if d == "tools" or d.startswith("tools.")]
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
        "envs/a.py": "import envs.b\n",
        "envs/b.py": "def f():\n    from envs.c import x\n",
        "envs/c.py": "from . import a\n",
        "envs/d.py": "import envs.a\n",
    })
    assert cycles(graph) == [frozenset({"envs.a", "envs.b", "envs.c"})]


def test_a_relative_import_inside_a_package_resolves():
    graph = import_graph({"envs/p/__init__.py": "from .q import y\n", "envs/p/q.py": "from ..r import z\n",
                          "envs/r.py": ""})
    assert graph == {"envs.p": {"envs.p.q"}, "envs.p.q": {"envs.r"}, "envs.r": set()}


def test_a_tools_module_named_as_a_string_is_found():
    assert tools_named_by_string("import importlib\nimportlib.import_module('tools.convert.cli')\n") == [
        "tools.convert.cli"]
    assert tools_named_by_string("x = 'tools are nice'\n") == []


def test_an_upward_import_is_found():
    graph = import_graph({"envs/a.py": "def f():\n    from megatron_rl.loop import setup\n",
                          "megatron_rl/loop/setup.py": "", "megatron_rl/loop/__init__.py": ""})
    assert upward_imports(graph) == ["envs.a (layer 1) -> megatron_rl.loop.setup (layer 6)"]


def test_the_product_importing_tools_is_upward():
    graph = import_graph({"megatron_rl/models/source.py": "from tools.convert.cli import main\n",
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
