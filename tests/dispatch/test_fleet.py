"""The persistent rollout fleet: the lease queue (expiry, fencing, give-up), its config checks, and real worker
processes (submitit local executor) surviving kill -9 of a worker, a resize, and kill -9 of the driver."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.dispatch import EpisodeSpec, FaultConfig, GeneratorConfig, WorkerConfig, episodes_from_tasks
from megatron_rl.dispatch.fleet import Fleet, FleetConfig
from megatron_rl.dispatch.lease_queue import LeaseQueue
from megatron_rl.envs.tasks import load_domain
from megatron_rl.loop.dispatched import read_episodes

REPO = Path(__file__).resolve().parents[2]
TASKS = load_domain("countdown", split="train")


def eps(n: int, prefix: str = "e") -> list[EpisodeSpec]:
    return [EpisodeSpec(episode_id=f"{prefix}{i}", env="countdown") for i in range(n)]


def test_lease_expiry_requeues_only_the_unpublished_and_fences_the_old_holder():
    q = LeaseQueue(lease_s=10, max_attempts=3)
    q.put("b", eps(5), {"shard_dir": "x"})
    a = q.lease("w1", 3, now=0.0)
    b = q.lease("w2", 3, now=0.0)
    assert [e.episode_id for e in a.episodes] == ["e0", "e1", "e2"] and len(b.episodes) == 2
    assert q.lease("w3", 3, now=0.0) is None and not q.done("b")
    assert q.heartbeat("w1", [a.id], now=8.0) == []  # extended to 18
    assert [le.id for le in q.expired(now=12.0)] == [b.id]  # w2 fell silent; w1's heartbeat kept its lease
    q.requeue(b, published={"e3"}, reason="lease expired")  # e3 made it into a shard before w2 died
    assert q.heartbeat("w2", [b.id], now=12.5) == [b.id]  # the old holder hears "lost": it must not publish
    c = q.lease("w3", 8, now=13.0)
    assert [e.episode_id for e in c.episodes] == ["e4"] and c.attempt == 1
    assert q.complete(a.id, ["e0", "e2"], {"e1": "timeout: server down"})  # e1 goes back to the queue
    assert not q.complete(b.id, ["e3", "e4"])  # a revoked lease reported late is refused
    d = q.lease("w1", 8, now=14.0)
    assert [e.episode_id for e in d.episodes] == ["e1"]
    assert q.complete(c.id, ["e4"]) and q.complete(d.id, ["e1"]) and q.done("b")
    assert q.pop("b").published == {f"e{i}" for i in range(5)}
    assert q.counters["leases_expired"] == 1 and q.counters["episodes_requeued"] == 2
    assert q.counters["fenced_heartbeats"] == 1


def test_a_committed_lease_outlives_its_lost_worker_until_the_deadline_and_a_revoked_one_cannot_commit():
    q = LeaseQueue(lease_s=10)
    q.put("b", eps(4), {})
    a, b = q.lease("w1", 2, now=0.0), q.lease("w2", 2, now=0.0)
    assert q.commit("w1", a.id, now=5.0)  # w1 may publish; then its job is reported ended
    assert q.revoke_worker("w1") == [] and q.revoke_worker("w2") == [b]  # w2 had not committed: revoked now
    q.requeue(b, set(), "job ended")
    assert not q.commit("w2", b.id, now=5.5)  # a worker still alive after its job ended publishes nothing
    assert q.expired(now=14.0) == [] and q.expired(now=15.5) == [a]  # committed: settled at its deadline
    q.requeue(a, {"e0", "e1"}, "lease expired")  # from the shards: w1 did publish both
    assert [e.episode_id for e in q.lease("w3", 8, now=16.0).episodes] == ["e2", "e3"]


def test_an_episode_lost_max_attempts_times_is_given_up_with_the_reason():
    q = LeaseQueue(lease_s=1, max_attempts=2)
    q.put("b", eps(1), {})
    for t in (0.0, 5.0):
        le = q.lease("w", 1, now=t)
        (lost,) = q.expired(now=t + 2)
        q.requeue(lost, set(), "lease expired")
    assert q.done("b") and q.lease("w", 1, now=9.0) is None
    assert "lease expired" in q.pop("b").given_up["e0"] and le.attempt == 1
    assert q.counters["episodes_given_up"] == 1


class FakeJob:
    """A submitted worker job that still runs (hung): records its cancellation."""

    def __init__(self):
        self.cancelled = 0

    def done(self) -> bool:
        return False

    def cancel(self, check: bool = True) -> None:
        self.cancelled += 1


def test_a_heartbeating_worker_without_progress_is_hung_its_job_cancelled_and_its_episodes_requeued(tmp_path):
    """No processes: the monitor's tick on a fleet whose worker w1 (job J1) has held a lease for longer than
    hung_s, heartbeating all along (alive, no progress), while w2 (job J2) published its lease in time."""
    fleet = Fleet(FleetConfig(size=2, lease_s=2.0, heartbeat_s=0.5, hung_s=5.0), scripted(), tmp_path / "fleet")
    fleet.folder.mkdir(parents=True)
    fleet._stop.set()  # no top-up submissions from the tick: only the decision is under test
    st, now = fleet.state, time.monotonic()
    st.queue.put("b", eps(4), {"shard_dir": str(tmp_path / "shards")})
    jobs = {"J1": FakeJob(), "J2": FakeJob()}
    fleet.jobs = dict(jobs)
    stuck = st.lease({"worker": "w1", "job": "J1", "max": 2, "wait_s": 0})["lease"]
    fresh = st.lease({"worker": "w2", "job": "J2", "max": 2, "wait_s": 0})["lease"]
    st.queue.leases[stuck["id"]].granted = now - 6.0  # handed out 6 s ago ...
    st.queue.leases[fresh["id"]].granted = now - 4.0
    assert st.heartbeat({"worker": "w1", "job": "J1", "leases": [stuck["id"]]})["lost"] == []  # ... kept alive
    fleet._tick()
    assert jobs["J1"].cancelled == 1 and jobs["J2"].cancelled == 0
    assert fleet.counters["workers_hung"] == 1 and fleet.counters["workers_lost"] == 1
    assert sorted(fleet.jobs) == ["J2"] and list(st.workers) == ["w2"] and fleet._alive() == 1  # room for one more
    assert [e.episode_id for e in st.queue.batches["b"].pending] == [e["episode_id"] for e in stuck["episodes"]]
    # if it wakes up, it hears that its lease is lost and that it must stop; it may not publish
    assert st.heartbeat({"worker": "w1", "job": "J1", "leases": [stuck["id"]]}) == {"lost": [stuck["id"]],
                                                                                    "stop": True}
    assert st.commit({"worker": "w1", "job": "J1", "lease": stuck["id"]}) == {"ok": False}
    fleet._tick()  # once only
    assert jobs["J1"].cancelled == 1 and fleet.counters["workers_hung"] == 1


def test_a_silent_worker_is_dropped_after_lease_s_and_cancelled_after_silent_s_unless_it_returns(tmp_path):
    fleet = Fleet(FleetConfig(size=3, lease_s=2.0, heartbeat_s=0.5, silent_s=6.0), scripted(), tmp_path / "fleet")
    fleet.folder.mkdir(parents=True)
    fleet._stop.set()  # no top-up submissions from the tick: only the decision is under test
    st, now = fleet.state, time.monotonic()
    st.queue.put("b", eps(2), {"shard_dir": str(tmp_path / "shards")})
    jobs = {j: FakeJob() for j in ("J1", "J2", "J3")}
    fleet.jobs = dict(jobs)
    lease = st.lease({"worker": "w1", "job": "J1", "max": 2, "wait_s": 0})["lease"]
    for w, j in (("w2", "J2"), ("w3", "J3")):
        st.heartbeat({"worker": w, "job": j, "leases": []})
    for w in ("w1", "w2"):
        st.workers[w]["last_seen"] = now - 3.0  # silent for longer than lease_s
    fleet._tick()
    assert sorted(st.workers) == ["w3"] and fleet.counters["workers_lost"] == 2  # dropped ...
    assert len(st.queue.batches["b"].pending) == 2 and not any(j.cancelled for j in jobs.values())  # not cancelled
    assert fleet._alive() == 3  # their jobs still count: a requeued worker may come back
    st.heartbeat({"worker": "w2", "job": "J2", "leases": []})  # w2 is back (a requeue, a network blip)
    fleet._dropped["w1"] = ("J1", now - 7.0, 0)  # w1 still silent after silent_s
    fleet._tick()
    assert jobs["J1"].cancelled == 1 and jobs["J2"].cancelled == 0 and fleet.counters["workers_hung"] == 1
    assert sorted(fleet.jobs) == ["J2", "J3"] and fleet._alive() == 2 and not fleet._dropped  # room for one more
    assert st.commit({"worker": "w1", "job": "J1", "lease": lease["id"]}) == {"ok": False}  # fenced if it wakes


def test_fleet_config_is_checked_with_the_fix_named():
    with pytest.raises(ConfigError, match="heartbeat_s .* below lease_s"):
        FleetConfig(heartbeat_s=30, lease_s=30).validate()
    with pytest.raises(ConfigError, match="poll_s must be >= 1 s"):
        FleetConfig(poll_s=0.2).validate()
    with pytest.raises(ConfigError, match="local, slurm or external"):
        FleetConfig(executor="debug").validate()
    with pytest.raises(ConfigError, match=r"hung_s \(20\) must be 0 \(off\) or above lease_s"):
        FleetConfig(hung_s=20, lease_s=30).validate()
    with pytest.raises(ConfigError, match=r"silent_s \(10\) must be >= lease_s \(30\)"):
        FleetConfig(silent_s=10, lease_s=30).validate()
    from megatron_rl import config as C
    from megatron_rl.run_config import RunConfig

    with pytest.raises(ConfigError, match="unknown config key 'episodes.fleet.sise'"):
        C.load(RunConfig, REPO / "configs" / "demo_cpu.yaml", ["episodes.runner=fleet", "episodes.fleet.sise=3"])
    cfg = C.load(RunConfig, REPO / "configs" / "demo_cpu.yaml", ["episodes.runner=fleet", "episodes.fleet.size=5",
                                                                  "episodes.fleet.executor=slurm"])
    assert cfg.episodes.fleet.size == 5 and cfg.episodes.fleet.executor == "slurm"


FAST = dict(heartbeat_s=0.5, lease_s=3.0, wait_s=1.0, poll_s=1.0, orphan_exit_s=30.0)


def scripted(delay_s: float = 0.0) -> WorkerConfig:
    """Scripted TEST policy, 90% wrong answers (no sandbox run needed) -> cheap episodes."""
    return WorkerConfig(threads=1, generator=GeneratorConfig(wrong_fraction=0.9), faults=FaultConfig(delay_s=delay_s))


def published_counts(root: Path) -> dict[str, int]:
    from megatron_rl.data.shards import read_shard

    counts: dict[str, int] = {}
    for p in root.rglob("*.h5"):
        for t in read_shard(p):
            counts[t.episode_id] = counts.get(t.episode_id, 0) + 1
    return counts


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run_killing_a_busy_worker(fleet, batch, folder: Path, kill, lease_wait_s: float) -> dict:
    """`fleet.run_batch(batch)` in a thread while `kill(pid)` ends the first worker seen holding a lease (mid-lease:
    its episodes are not published yet); the batch's report."""
    import threading

    out: dict = {}
    t = threading.Thread(target=lambda: out.update(fleet.run_batch("b0", batch, folder, url="")))
    t.start()
    busy = wait_for(lambda: [w for w in fleet.status()["workers"].values() if w["leases"]], lease_wait_s, "a lease")
    kill(busy[0]["pid"])
    t.join(90)
    assert not t.is_alive(), "the batch did not finish after the kill"
    return out


@pytest.mark.slow
def test_local_fleet_survives_kill_9_of_a_worker_and_shrinks_on_the_size_file(tmp_path):
    fleet = Fleet(FleetConfig(size=2, episodes_per_lease=4, **FAST), scripted(delay_s=0.15), tmp_path / "fleet").start()
    try:
        batch = episodes_from_tasks(TASKS[:24], prefix="k")
        out = run_killing_a_busy_worker(fleet, batch, tmp_path / "b0", lambda pid: os.kill(pid, signal.SIGKILL), 30)
        assert out["given_up"] == {}
        counts = published_counts(tmp_path / "b0")
        assert counts == {e.episode_id: 1 for e in batch}  # all 24, each once
        assert fleet.state.queue.counters["leases_expired"] >= 1 and fleet.counters["workers_lost"] >= 1
        # one replacement, once the scheduler query sees the job ended (it may come after the batch, under load)
        wait_for(lambda: fleet.counters["workers_submitted"] == 3, 30, "the replacement")
        assert fleet.counters["submissions"] == 2
        # the fleet shrinks while the run goes on: one worker is told to stop, the next batch runs on the other
        (tmp_path / "fleet" / "size").write_text("1\n")
        wait_for(lambda: len(fleet.state.surplus) == 1, 20, "a surplus worker")
        rep = fleet.run_batch("b1", episodes_from_tasks(TASKS[24:32], prefix="s"), tmp_path / "b1", url="")
        assert rep["given_up"] == {} and len(published_counts(tmp_path / "b1")) == 8
        assert len(fleet.state.active()) == 1 and fleet.counters["submissions"] == 2
    finally:
        fleet.close()
    assert all(j.done() for j in fleet.jobs.values())  # every worker gone after close


@pytest.mark.slow
def test_a_stopped_worker_is_cancelled_and_replaced_and_nothing_is_lost_or_duplicated(tmp_path):
    """SIGSTOP of the worker holding a lease (alive, no heartbeat, no progress): lease_s later it is dropped and
    its lease re-queued, silent_s later its job is cancelled (the local controller kills it) and a replacement
    submitted; every episode once."""
    import threading

    cfg = FleetConfig(size=2, episodes_per_lease=4, silent_s=5.0, **FAST)
    fleet = Fleet(cfg, scripted(delay_s=0.15), tmp_path / "fleet").start()
    try:
        batch = episodes_from_tasks(TASKS[:24], prefix="h")
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(fleet.run_batch("b0", batch, tmp_path / "b0", url="")))
        t.start()
        busy = wait_for(lambda: [w for w in fleet.status()["workers"].values() if w["leases"]], 30, "a lease")
        pid = busy[0]["pid"]
        os.kill(pid, signal.SIGSTOP)  # hung: the process lives on, its heartbeats stop
        t.join(90)
        assert not t.is_alive() and out["given_up"] == {}
        assert published_counts(tmp_path / "b0") == {e.episode_id: 1 for e in batch}  # all 24, each once
        # silent_s after its last word (the batch may be done by then, under load): cancelled, one replacement
        wait_for(lambda: fleet.counters["workers_submitted"] == 3, 30, "the replacement")
        assert fleet.counters["workers_hung"] == 1 and fleet.counters["workers_lost"] >= 1
        assert fleet.counters["submissions"] == 2
        assert busy[0]["job"] not in fleet.jobs and busy[0]["job"] in fleet.state.ended_jobs
        wait_for(lambda: not _alive(pid), 20, "the stopped worker to be killed")
        logs = (tmp_path / "fleet" / "submitit").rglob("*_log.err")
        assert sum("episode runner ready" in p.read_text() for p in logs) >= 2  # built before the first lease
    finally:
        fleet.close()


def _driver(out: Path, steps: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megatron_rl.dispatch", "fleet", "--executor", "local", "--steps", str(steps),
           "--per-step", "12", "--size", "2", "--episodes-per-lease", "3", "--wrong-fraction", "0.9", "--threads", "1",
           "--delay-s", "0.1", "--heartbeat-s", "0.5", "--lease-s", "3", "--wait-s", "1", "--poll-s", "1",
           "--orphan-exit-s", "30", "--out", str(out)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "driver.log", "a") as log:  # a file, not a pipe: the workers outlive the driver and keep it
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_driver_kill_9_and_restart_adopts_the_workers_and_loses_nothing(tmp_path):
    out = tmp_path / "run"
    first = _driver(out, steps=3)
    wait_for(lambda: (out / "steps.jsonl").exists() and list((out / "shards" / "step0001").glob("*.h5")), 60,
             "step 1 under way")
    first.kill()  # the driver dies mid-step; its workers do not
    first.wait()
    workers = json.loads((out / "fleet" / "jobs.json").read_text())
    second = _driver(out, steps=3)
    assert second.wait(timeout=120) == 0, (out / "driver.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["recovered"] >= 3  # step 1's published leases were not run again
    assert rows[-1]["workers_submitted"] == 0  # the restarted driver adopted the running workers
    counts = published_counts(out / "shards")
    assert len(counts) == 36 and set(counts.values()) == {1}, counts  # every episode exactly once
    assert all(read_episodes(out / "shards" / f"step{s:04d}", set(counts)) for s in range(3))
    for job in workers:  # the adopted workers stopped when the second driver closed the fleet
        wait_for(lambda job=job: not _alive(int(job)), 20, f"worker {job} to exit")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.slow
def test_workers_that_cannot_start_break_the_fleet_with_their_error_not_an_endless_resubmission(tmp_path):
    cfg = FleetConfig(size=2, setup=["echo 'no such module: rollout-env' >&2", "exit 3"], **FAST)
    fleet = Fleet(cfg, scripted(), tmp_path / "fleet").start()
    try:
        with pytest.raises(RuntimeError, match="2 worker jobs in a row ended before joining") as err:
            fleet.run_batch("b0", episodes_from_tasks(TASKS[:4]), tmp_path / "b0", url="", timeout_s=60)
        assert "episodes.fleet.setup" in str(err.value)  # (the local executor keeps no log of a failed setup)
        assert fleet.counters["submissions"] == 1 and fleet.counters["workers_submitted"] == 2
    finally:
        fleet.close()


@pytest.mark.slow
def test_external_workers_lost_mid_lease_are_dropped_and_their_episodes_requeued_never_replaced(tmp_path):
    """executor=external (workers started by the job script, as in slurm/rl_hetjob.sbatch): the driver submits
    nothing and cannot replace a lost worker, but a worker killed (-9) mid-lease is dropped lease_s later and
    its unpublished episodes go to the surviving worker: every episode once."""
    folder = tmp_path / "fleet"
    fleet = Fleet(FleetConfig(executor="external", size=2, episodes_per_lease=4, **FAST), scripted(delay_s=0.15),
                  folder).start()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "megatron_rl.dispatch.fleet_worker", str(folder)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    try:
        batch = episodes_from_tasks(TASKS[:24], prefix="x")
        killed: list[subprocess.Popen] = []

        def kill(pid: int) -> None:
            killed.append(next(p for p in procs if p.pid == pid))
            killed[-1].kill()

        out = run_killing_a_busy_worker(fleet, batch, tmp_path / "b0", kill, 60)
        victim = killed[0]
        assert out["given_up"] == {}
        assert published_counts(tmp_path / "b0") == {e.episode_id: 1 for e in batch}  # all 24, each once
        assert fleet.state.queue.counters["leases_expired"] >= 1 and fleet.counters["workers_lost"] >= 1
        requeued = fleet.state.queue.counters["episodes_requeued"]
        assert requeued >= 1
        assert fleet.counters["submissions"] == fleet.counters["workers_submitted"] == 0  # none replaced
    finally:
        fleet.close()  # every live worker is told to stop; each then exits on its own
        exits = [_exit_within(p, STOP_GRACE_S) for p in procs]
    survivor = next(p for p in procs if p is not victim)
    assert exits[procs.index(survivor)] == 0  # it exited by itself once told to stop
    report = json.loads(survivor.stdout.read().strip().splitlines()[-1])
    assert report["episodes"] >= requeued  # it ran the lost worker's episodes too


STOP_GRACE_S = 30.0
"""How long a worker told to stop may take to exit: `Fleet.close`'s grace_s (after it, a job is cancelled)."""


def _exit_within(proc: subprocess.Popen, timeout: float) -> int | None:
    """`proc`'s exit status once it ends within `timeout` s; None (and killed) if it is still alive then."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def test_the_queue_endpoint_refuses_requests_without_the_fleet_token_and_odd_bodies():
    """Every route needs the fleet token as `Authorization: Bearer` (a missing, wrong or non-ASCII one, or the
    token in the old X-Fleet-Token header, gets 401, never a crashed handler); a JSON body that is not an object
    gets 400."""
    import http.client
    import json

    from megatron_rl.dispatch.fleet_server import FleetState, serve
    from megatron_rl.dispatch.lease_queue import LeaseQueue

    httpd = serve(FleetState(LeaseQueue(60.0)), "s3cret", "127.0.0.1")
    port = httpd.server_address[1]

    def call(method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.putrequest(method, path)
        for k, v in {**headers, "Content-Length": str(len(body or b""))}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Fleet-Token": "s3cret"},
                        {"Authorization": "Bearer s3cr\u00e9t".encode().decode("latin-1")}):
            assert call("GET", "/status", None, headers)[0] == 401
            assert call("POST", "/lease", b'{"worker": "w"}', headers)[0] == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert call("GET", "/status", None, ok)[0] == 200
        status, out = call("POST", "/heartbeat", b"[1, 2]", ok)
        assert status == 400 and "worker" in out["error"]["message"] and out["error"]["code"] == 400
    finally:
        httpd.shutdown()
        httpd.server_close()
