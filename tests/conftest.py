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

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


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
