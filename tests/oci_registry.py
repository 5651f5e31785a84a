"""A real image registry on loopback for tests: Debian's ``docker-registry`` (the CNCF
distribution registry v2.8), with deletion enabled and its storage in the test's folder.

The fixture ``oci_registry`` starts one per test on a free port and yields an
``OciRegistry``; it is killed at the end of the test. ``scripts/setup`` installs the
package.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["OciRegistry", "oci_registry"]

START_TIMEOUT_SEC = 15
CONFIG = """\
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
  secret: a-test-upload-secret
"""


@dataclass
class OciRegistry:
    host: str  # 127.0.0.1:<port>, as image references name it
    url: str
    folder: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SEC
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v2/", timeout=1):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    raise RuntimeError(f"docker-registry did not answer in {START_TIMEOUT_SEC} s")


@pytest.fixture
def oci_registry(tmp_path: Path) -> Iterator[OciRegistry]:
    binary = shutil.which("docker-registry")
    if binary is None:
        raise RuntimeError("no docker-registry: scripts/setup --tests installs the Debian package")
    folder = tmp_path / "registry"
    (folder / "data").mkdir(parents=True)
    port = _free_port()
    config = folder / "config.yml"
    config.write_text(CONFIG.format(root=folder / "data", port=port))
    log = folder / "registry.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, "serve", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log)
        yield OciRegistry(f"127.0.0.1:{port}", url, folder)
    finally:
        proc.kill()
        proc.wait(timeout=10)
