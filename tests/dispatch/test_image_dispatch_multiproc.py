"""Domain images on dispatched and fleet workers (submitit's local executor: separate worker processes): the
run config's envs.domains.code.image is built once by the driver (`loop.job.worker_config`) into the store,
the worker spec carries its digest and file, and each worker extracts it into its node cache and runs the
code reward in it. The task's solution imports a module that only the image has: reward 1.0 in the image, 0.0
without it, so a worker that ignored the image fails the test."""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from megatron_rl import config as C
from megatron_rl.config import ConfigError
from megatron_rl.data.shards import read_shard
from megatron_rl.dispatch import DispatchConfig, Dispatcher, GeneratorConfig, episodes_from_tasks
from megatron_rl.envs.base import Task
from megatron_rl.envs.sandbox import domain_images

MOD = "mrl_only_in_image"
SOLUTION = f"```python\ndef add_secret(x):\n    import {MOD}\n    return x + {MOD}.SECRET\n```"


@pytest.fixture()
def open_dir():
    """A folder the sandboxes' slot uids can traverse (pytest's tmp_path is 0700)."""
    d = tempfile.mkdtemp(prefix="mrl-test-imgdisp-")
    os.chmod(d, 0o755)
    yield Path(d)
    domain_images.close_all()
    shutil.rmtree(d, ignore_errors=True)


def code_tasks(n: int) -> list[Task]:
    return [Task(id=f"img-{i}", domain="code", prompt="Write add_secret(x).",
                 payload={"entry_point": "add_secret", "solution": SOLUTION,
                          "tests": [f"assert add_secret({i}) == {i + 7}", "assert add_secret(0) == 7"]})
            for i in range(n)]


def run_config(open_dir: Path, runner: str):
    from megatron_rl.run_config import RunConfig

    (open_dir / f"{MOD}.py").write_text("SECRET = 7\n")
    (open_dir / "code.yaml").write_text(yaml.safe_dump(
        {"files": {f"/usr/local/lib/python3.11/dist-packages/{MOD}.py": f"{MOD}.py"}}))
    run = open_dir / "run.yaml"
    run.write_text(yaml.safe_dump({
        "name": "r", "output_dir": str(open_dir / "out"), "curriculum": {"enabled": False},
        "episodes": {"runner": runner},
        "envs": {"image_store": str(open_dir / "store"), "image_cache": str(open_dir / "cache"),
                 "domains": {"code": {"image": str(open_dir / "code.yaml")}}}}))
    return C.load(RunConfig, str(run), [])


def scripted(worker):
    """The run's worker config with the scripted TEST policy (answers the payload's solution) for the engine."""
    return dataclasses.replace(worker, threads=1, vocab_size=384, generator=GeneratorConfig(kind="scripted"))


def rewards(shard_dir: Path) -> dict[str, float]:
    return {t.episode_id: t.reward for p in sorted(shard_dir.rglob("*.h5")) for t in read_shard(p)}


@pytest.mark.slow
def test_dispatched_workers_run_the_code_reward_in_the_domain_image(open_dir):
    from megatron_rl.loop.job import worker_config

    cfg = run_config(open_dir, "dispatch")  # no longer refused
    worker = worker_config(cfg, open_dir)
    (ref,) = worker.images.values()
    assert list(worker.images) == ["code"] and os.listdir(open_dir / "store") == [os.path.basename(ref["file"])]
    assert not (open_dir / "cache").exists()  # the driver only publishes; workers extract
    eps = episodes_from_tasks(code_tasks(4))
    d = Dispatcher(DispatchConfig(executor="local", folder=str(open_dir / "sub"), episodes_per_task=2),
                   scripted(worker), open_dir / "shards")
    report = d.run(eps)
    assert not report.missing, report
    assert rewards(open_dir / "shards") == {e.episode_id: 1.0 for e in eps}
    assert sorted(os.listdir(open_dir / "cache")) == sorted([ref["digest"], f"{ref['digest']}.lock"])
    # the same worker config without the image: the module is missing in the sandbox and the reward is 0
    bare = dataclasses.replace(scripted(worker), images={})
    report = Dispatcher(DispatchConfig(executor="local", folder=str(open_dir / "sub2"), episodes_per_task=4),
                        bare, open_dir / "bare").run(eps)
    assert not report.missing and set(rewards(open_dir / "bare").values()) == {0.0}


@pytest.mark.slow
def test_fleet_workers_run_the_code_reward_in_the_domain_image(open_dir):
    from megatron_rl.dispatch.fleet import Fleet, FleetConfig
    from megatron_rl.loop.job import worker_config

    cfg = run_config(open_dir, "fleet")
    worker = scripted(worker_config(cfg, open_dir))
    fleet = Fleet(FleetConfig(size=1, episodes_per_lease=2, heartbeat_s=0.5, lease_s=5.0, wait_s=1.0, poll_s=1.0,
                              orphan_exit_s=30.0), worker, open_dir / "fleet").start()
    try:
        eps = episodes_from_tasks(code_tasks(4), prefix="f")
        fleet.run_batch("b0", eps, open_dir / "b0", url="", timeout_s=120)
    finally:
        fleet.close()
    assert rewards(open_dir / "b0") == {e.episode_id: 1.0 for e in eps}
    assert (open_dir / "cache" / worker.images["code"]["digest"]).is_dir()


def test_worker_refuses_an_image_file_it_cannot_read_or_that_is_not_the_digest(open_dir):
    with pytest.raises(ConfigError, match="every worker node mounts"):
        domain_images.worker_sandbox("code", {"digest": "ab" * 32, "file": str(open_dir / "nope.sqfs")})
    (open_dir / ("cd" * 32 + ".tar")).write_bytes(b"")
    with pytest.raises(ConfigError, match="is not image"):
        domain_images.worker_sandbox("code", {"digest": "ab" * 32, "file": str(open_dir / ("cd" * 32 + ".tar"))})
