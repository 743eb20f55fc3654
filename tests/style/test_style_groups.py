"""Style rule 2 of the brief: library code receives its process groups explicitly.

A call to torch.distributed's rank/size queries or collectives without a group (positional or keyword) runs on
the default group, whatever group the caller's component was built for. This check walks the AST of every file
under megatron_rl/, tools/ and envs/ and fails on such a call, except in the modules that own the default group
(listed below with the reason).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("megatron_rl", "tools", "envs")

OWNERS = {
    "megatron_rl/distributed.py": "creates the default group (init_process_group) and probes it",
    "megatron_rl/driver.py": "top of the stack: runs the whole job on the world it was started with",
    "megatron_rl/cli.py": "command-line entry: the process is the job",
    "megatron_rl/commands": "one module per command (train, eval, export...): each starts and owns its job",
}

# torch.distributed function -> the index of its `group` parameter when passed positionally
GROUP_ARG = {
    "get_rank": 0, "get_world_size": 0, "barrier": 0, "monitored_barrier": 0,
    "broadcast": 2, "broadcast_object_list": 2, "all_reduce": 2, "reduce": 3,
    "all_gather": 2, "all_gather_object": 2, "all_gather_into_tensor": 2, "gather": 3, "gather_object": 3,
    "scatter": 4, "scatter_object_list": 3, "reduce_scatter": 3, "reduce_scatter_tensor": 3,
    "all_to_all": 2, "all_to_all_single": 4,
}


def _dist_names(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names bound to torch.distributed (`import torch.distributed as dist`) and functions imported from it."""
    modules, funcs = {"torch.distributed"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and not node.level:
            modules.update(a.asname or a.name for a in node.names if a.name == "distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            funcs.update({a.asname or a.name: a.name for a in node.names if a.name in GROUP_ARG})
    return modules, funcs


def _called(func: ast.expr, modules: set[str], funcs: dict[str, str]) -> str | None:
    """The torch.distributed function this call target names, if any."""
    if isinstance(func, ast.Name):
        return funcs.get(func.id)
    if isinstance(func, ast.Attribute) and func.attr in GROUP_ARG and ast.unparse(func.value) in modules:
        return func.attr
    return None


def default_group_calls(source: str) -> list[tuple[int, str]]:
    """(line, code) of every torch.distributed call in `source` that names no process group, and of every use of
    the default group by name (`dist.group.WORLD`)."""
    tree = ast.parse(source)
    modules, funcs = _dist_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "WORLD" and ast.unparse(node.value) in {
                f"{m}.group" for m in modules}:
            found.append((node.lineno, ast.unparse(node)))  # the default group by name: take DistContext.world
        if not isinstance(node, ast.Call):
            continue
        name = _called(node.func, modules, funcs)
        if name is None:
            continue
        positional = len(node.args) > GROUP_ARG[name] and not any(isinstance(a, ast.Starred) for a in node.args)
        if not positional and not any(k.arg in ("group", None) for k in node.keywords):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _owned(rel: str) -> bool:
    return any(rel == o or rel.startswith(o + "/") for o in OWNERS)


def library_files() -> list[Path]:
    files = [p for t in TREES for p in sorted((ROOT / t).rglob("*.py"))]
    return [p for p in files if not _owned(p.relative_to(ROOT).as_posix())]


@pytest.mark.slow
def test_library_code_passes_its_process_groups():
    offences = [f"{p.relative_to(ROOT)}:{line}: {call}" for p in library_files()
                for line, call in sorted(default_group_calls(p.read_text()))]
    assert not offences, ("calls on the default process group in library code (pass the component's group, "
                          "e.g. group=ctx.world, src=dist.get_global_rank(group, 0)):\n  " + "\n  ".join(offences))


@pytest.mark.parametrize("code", [
    "import torch.distributed as dist\ndist.get_rank()",
    "import torch.distributed as dist\ndist.broadcast_object_list(box, src=0)",
    "import torch\ntorch.distributed.barrier()",
    "from torch import distributed as d\nd.all_reduce(t, op)",
    "from torch.distributed import all_gather_object as ago\nago(parts, obj)",
    "import torch.distributed as dist\ndist.get_world_size() if dist.is_initialized() else 1",
    "import torch.distributed as dist\nf(group=dist.group.WORLD)",
])
def test_a_call_without_a_group_is_found(code):
    assert len(default_group_calls(code)) == 1


@pytest.mark.parametrize("code", [
    "import torch.distributed as dist\ndist.get_rank(g)",
    "import torch.distributed as dist\ndist.get_rank(group=g)",
    "import torch.distributed as dist\ndist.broadcast_object_list(box, src, g)",
    "import torch.distributed as dist\ndist.all_reduce(t, group=self.group)",
    "import torch.distributed as dist\ndist.all_gather_object(parts, obj, g)",
    "import torch.distributed as dist\ndist.all_reduce(t, **kw)",
    "import torch.distributed as dist\ndist.get_global_rank(g, 0)",
    "x.get_rank()",
])
def test_a_call_with_a_group_or_not_on_torch_distributed_passes(code):
    assert default_group_calls(code) == []


def test_the_owners_exist():
    missing = [o for o in OWNERS if not (ROOT / o).exists()]
    assert not missing, f"OWNERS lists paths that no longer exist: {missing}"
