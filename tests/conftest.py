"""Shared fixtures. Slurm tests get a real single-node cluster (started once per session, stopped after)."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.slurm_fixtures import slurm_cluster  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of `pytest -n N` (scripts/test.sh)
        totals: dict[str, float] = {}
        for item in items:
            totals[_group(item.nodeid)] = totals.get(_group(item.nodeid), 0.0) + _cost(item)
        items.sort(key=lambda item: -totals[_group(item.nodeid)])  # costliest group first; stable within


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """MRL_TEST_CPU_LOG=FILE appends one JSON line per test: wall seconds and CPU seconds (user + sys) of this
    process and of the children it reaped (torchrun worlds, servers, scripts; not Slurm jobs, whose processes
    belong to slurmd). CPU is what the 2-core CI runner runs out of (docs/test_time.md), and unlike wall time
    it hardly moves with the machine's load."""
    log = os.environ.get("MRL_TEST_CPU_LOG")
    if not log:
        yield
        return
    import json
    import time

    t0, w0 = os.times(), time.monotonic()
    yield
    t1, w1 = os.times(), time.monotonic()
    row = {"test": item.nodeid, "marks": sorted(m for m in ("slow", "multiproc", "slurm") if m in item.keywords),
           "outcome": item.stash.get(_OUTCOME, "?"),
           "wall_s": round(w1 - w0, 2),
           "cpu_self_s": round(t1.user - t0.user + t1.system - t0.system, 2),
           "cpu_children_s": round(t1.children_user - t0.children_user + t1.children_system - t0.children_system, 2)}
    with open(log, "a") as f:
        f.write(json.dumps(row) + "\n")


_OUTCOME = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The test's outcome for MRL_TEST_CPU_LOG's row: the worst of its phases (failed > skipped > passed)."""
    report = (yield).get_result()
    rank = {"?": 0, "passed": 1, "skipped": 2, "failed": 3}
    if rank[report.outcome] > rank[item.stash.get(_OUTCOME, "?")]:
        item.stash[_OUTCOME] = report.outcome


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_Scheduler(), "megatron-rl-scheduler")


class _Scheduler:
    """`pytest -n N --dist loadfile` (scripts/test.sh), with one change: all Slurm test files (`*_slurm.py`)
    are one group, run one test after another on one worker, since they share the dev cluster (12 CPUs:
    two jobs at once would queue behind each other). A file's tests stay on one worker, so its module
    fixtures (a shared warm-up, a converted checkpoint) are built once. Groups start costliest first, the
    cost estimated from the markers (`_cost`), so that the last group to finish is a short one."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getoption("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        class SlurmTogether(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return _group(nodeid)

        return SlurmTogether(config, log)


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return "slurm" if path.endswith("_slurm.py") else path


def _cost(item) -> float:
    """Rough seconds: a Slurm test ~60, a multi-process one ~20, another slow one ~3, a fast one ~0.1."""
    kw = item.keywords
    return 60 if "slurm" in kw else 20 if "multiproc" in kw else 3 if "slow" in kw else 0.1


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def venv_python() -> str:
    return sys.executable


@pytest.fixture()
def clean_env(monkeypatch):
    """An environment without launcher variables (torchrun, Slurm, MPI) leaking in from outside."""
    for k in list(os.environ):
        if k.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_")) or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                      "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    """The tiny HF tokenizer of tests/hf_tiny.py (BPE with ChatML tokens and a chat template), built here."""
    from megatron_rl.tokenizer import HFTokenizer
    from tests.hf_tiny import tiny_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    tiny_tokenizer(folder)
    return HFTokenizer(folder)


@pytest.fixture(scope="module")
def sandbox():
    """The default sandbox (bubblewrap), closed after the module."""
    from megatron_rl.envs.sandbox import SandboxConfig

    sb = SandboxConfig().build()
    yield sb
    sb.close()



@pytest.fixture(scope="session")
def demo_warm(tmp_path_factory):
    """The shortened warm-up of `megatron-rl train configs/demo_cpu.yaml` (tests/demo_warmup.py), built once per
    test session, also across pytest-xdist workers: (its run folder, the launch's output). Read or copy it."""
    from tests.demo_warmup import demo_warmup

    return demo_warmup(tmp_path_factory)
