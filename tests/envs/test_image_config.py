"""The run config names a domain's sandbox image (envs.domains.<d>.image): loaded and validated from YAML, refused
where it cannot be served. Not in the normal-user pass: it needs the whole package."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import ConfigError


@pytest.fixture()
def open_dir():
    d = tempfile.mkdtemp(prefix="mrl-test-imgcfg-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_run_config_yaml_names_a_domain_image_for_every_runner(open_dir, tmp_path):
    """The run config YAML: envs.domains.<d>.image loads (spec validated, unknown spec keys refused), with the
    in-process runner and with dispatched and fleet workers (tests/dispatch/test_image_dispatch_multiproc.py runs them)."""
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    (open_dir / "tool").write_text("x")
    (open_dir / "code.yaml").write_text(yaml.safe_dump({"files": {"/opt/tool": "tool"}}))
    run = tmp_path / "run.yaml"
    run.write_text(f"name: r\noutput_dir: {tmp_path}\ncurriculum:\n  enabled: false\nenvs:\n  domains:\n    code:\n"
                   f"      image: {open_dir}/code.yaml\n")
    assert C.load(RunConfig, str(run), []).envs.domains["code"].image == f"{open_dir}/code.yaml"
    for runner in ("dispatch", "fleet"):
        assert C.load(RunConfig, str(run), [f"episodes.runner={runner}"]).envs.domains["code"].image
    (open_dir / "code.yaml").write_text(yaml.safe_dump({"files": {"/opt/tool": "tool"}, "pakages": ["x"]}))
    with pytest.raises(ConfigError, match="pakages"):
        C.load(RunConfig, str(run), [])
