"""slurm/dev-cluster.sh: the session cluster's status and partitions, idempotent start, and a full
lifecycle (stale daemons, stop with a running job, wipe) on a second, private cluster."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm_fixtures import cluster_env, dev_cluster

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd-gpunode", "slurmd-cpunode")


def daemon_pids(status_stdout: str) -> dict[str, int]:
    """{'slurmctld': pid, 'slurmd-gpunode': pid, ...} from `status` output (running daemons only)."""
    found = re.findall(r"^\S+\s+running\s+pid (\d+)\s+\((\S+)\)$", status_stdout, flags=re.M)
    return {name.replace("mysqld", "mariadbd"): int(pid) for pid, name in found}


def nodes(cluster_or_env) -> dict[str, str]:
    env = getattr(cluster_or_env, "env", cluster_or_env)
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return dict(line.split() for line in out.splitlines())


def test_status_shows_all_daemons_and_two_idle_nodes(slurm_cluster):
    res = dev_cluster("status", env=slurm_cluster.env)
    assert res.returncode == 0, res.stdout + res.stderr
    pids = daemon_pids(res.stdout)
    assert set(pids) == set(DAEMONS), res.stdout
    for pid in pids.values():
        assert Path(f"/proc/{pid}").exists()
    assert nodes(slurm_cluster) == {"cpunode": "idle", "gpunode": "idle"}


def test_sinfo_partitions(slurm_cluster):
    out = slurm_cluster.run(["sinfo", "-h", "-o", "%P|%N|%c|%G|%a"]).stdout
    rows = sorted(line.split("|") for line in out.splitlines())
    assert rows == [["cpu*", "cpunode", "8", "(null)", "up"], ["gpu", "gpunode", "4", "gpu:2", "up"]]


def test_env_prints_exports_for_this_state_dir(slurm_cluster):
    res = dev_cluster("env", env=slurm_cluster.env)
    assert res.returncode == 0
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", res.stdout, flags=re.M))
    assert exports["SLURM_CONF"] == slurm_cluster.slurm_conf
    assert Path(exports["SLURM_CONF"]).is_file()


def test_start_twice_is_idempotent(slurm_cluster):
    before = daemon_pids(dev_cluster("status", env=slurm_cluster.env).stdout)
    for _ in range(2):
        res = dev_cluster("start", env=slurm_cluster.env)
        assert res.returncode == 0, res.stderr
    after = daemon_pids(dev_cluster("status", env=slurm_cluster.env).stdout)
    assert after == before  # nothing restarted
    assert nodes(slurm_cluster) == {"cpunode": "idle", "gpunode": "idle"}


# ----------------------------------------------------------------------- private cluster lifecycle
def _free_port_base(start: int = 17817, span: int = 4) -> int:
    for base in range(start, start + 2000, 10):
        try:
            for p in range(base, base + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no 4 consecutive free TCP ports found for a private cluster")


def _tagged_pids(state: Path) -> list[int]:
    """Processes that belong to the cluster in `state`: daemons (tagged) and job processes."""
    tag = f"MRL_SLURM_DAEMON_OF={state}".encode()
    conf = f"SLURM_CONF={state}/etc/slurm.conf".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if tag in env or (conf in env and any(e.startswith(b"SLURM_JOB_ID=") for e in env)):
            found.append(int(d.name))
    return found


@pytest.fixture()
def private_cluster(tmp_path):
    state = Path(f"/tmp/mrl-slurm-test-{os.getpid()}")
    env = cluster_env(state)
    env.update(MRL_SLURM_STATE=str(state), MRL_SLURM_PORT_BASE=str(_free_port_base()), MRL_SLURM_CLUSTER="t")
    yield state, env
    dev_cluster("stop", "--wipe", env=env)
    Path(f"{state}.lock").unlink(missing_ok=True)


def _start(env) -> subprocess.CompletedProcess:
    res = dev_cluster("start", env=env)
    assert res.returncode == 0, res.stderr
    assert nodes(env) == {"cpunode": "idle", "gpunode": "idle"}, res.stderr
    return res


def _describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            out.append(f"{pid}: {cmdline}")
        except OSError:
            out.append(f"{pid}: (gone)")
    return out


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """The process has exited (gone, or a zombie its parent has not reaped yet) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def test_lifecycle_stale_daemons_running_job_stop_and_wipe(private_cluster):
    state, env = private_cluster
    _start(env)
    pids = daemon_pids(dev_cluster("status", env=env).stdout)
    assert set(pids) == set(DAEMONS)

    # A stale pid file (slurmctld died hard) and a daemon whose pid file is gone: start repairs both.
    os.kill(pids["slurmctld"], 9)
    (state / "run" / "slurmd-cpunode.pid").unlink()
    _start(env)
    status = dev_cluster("status", env=env).stdout
    now = daemon_pids(status)
    assert set(now) == set(DAEMONS), status
    assert now["slurmctld"] != pids["slurmctld"]
    assert now["slurmd-cpunode"] != pids["slurmd-cpunode"]  # the untracked one was replaced
    assert _gone(pids["slurmd-cpunode"])
    assert now["slurmdbd"] == pids["slurmdbd"]  # healthy daemons are left alone

    # stop with a job running: no daemon, step daemon or job process of this cluster survives.
    job = subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 300"], env=env,
                         capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    deadline = time.monotonic() + 30
    while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True,
                         timeout=30).stdout.strip() != "RUNNING":
        assert time.monotonic() < deadline, f"job {job} did not start"
        time.sleep(0.2)
    assert _tagged_pids(state), "expected daemons and the job's processes to be found"
    res = dev_cluster("stop", env=env)
    assert res.returncode == 0, res.stderr
    assert _describe(_tagged_pids(state)) == [], res.stderr
    assert dev_cluster("status", env=env).returncode == 3  # all stopped
    assert (state / "ctld").is_dir()  # plain stop keeps the state

    res = dev_cluster("stop", "--wipe", env=env)
    assert res.returncode == 0, res.stderr
    assert not state.exists()
