"""Every fetch has an overall deadline, also while a server trickles its ref list.

libgit2 calls no callback while it reads the ref advertisement, and each byte of a
trickle arrives well within its per-read timeout: only stopping the process the
fetch runs in ends it (gitops_sless/source/fetcher.py). These servers accept the
connection, read the request and send a real advertisement one byte a second.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gitops_sless.errors import TransientError
from gitops_sless.source.mirror import FetchError, Mirror

from ..gitserver import SmartHttpServer, WorkRepo, git_env, init_bare
from ..sless_server import SlessServer
from ..test_serve import http_function

DEADLINE = 2  # seconds: longer than one byte of the trickle takes, far shorter than all


class Trickle:
    """A git server on loopback that answers every request one byte per ``delay`` seconds.

    ``protocol`` ``"http"`` sends a smart-HTTP ref advertisement, ``"git"`` the
    git:// one. ``sent`` counts the bytes sent; ``finished`` is set if a whole
    answer ever went out.
    """

    def __init__(self, bare: Path, protocol: str, delay: float = 1.0) -> None:
        self.protocol = protocol
        self.delay = delay
        refs = subprocess.run(
            ["git", "upload-pack", "--advertise-refs", str(bare)],
            capture_output=True,
            check=True,
            env=git_env(),
        ).stdout
        if protocol == "http":
            body = b"001e# service=git-upload-pack\n0000" + refs
            head = (
                "HTTP/1.1 200 OK\r\n"
                "Content-Type: application/x-git-upload-pack-advertisement\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            self.answer = head.encode() + body
        else:
            self.answer = refs
        self.sent = 0
        self.finished = threading.Event()
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._threads: list[threading.Thread] = []

    def url(self, name: str) -> str:
        return f"{self.protocol}://127.0.0.1:{self._sock.getsockname()[1]}/{name}"

    def __enter__(self) -> Trickle:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._sock.close()
        for thread in self._threads:
            thread.join(5)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                conn, _ = self._sock.accept()
                self._spawn(self._answer, conn)

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)  # the request: a GET, or git://'s one pkt-line
            for byte in self.answer:
                conn.sendall(bytes([byte]))
                self.sent += 1
                if self._stop.wait(self.delay):
                    return
            self.finished.set()


@pytest.fixture
def bare(tmp_path: Path) -> Path:
    bare = init_bare(tmp_path / "served" / "functions.git")
    work = WorkRepo(tmp_path / "work")
    work.commit("initial", {"a.txt": "one\n"})
    work.push(str(bare))
    return bare


@pytest.mark.parametrize("protocol", ["http", "git"])
def test_a_trickled_ref_list_is_abandoned_at_the_deadline(protocol, bare, tmp_path):
    path = tmp_path / "mirror.git"
    before = Mirror(str(bare), "main", path).fetch().commit
    with Trickle(bare, protocol) as server:
        url = server.url("functions.git")
        mirror = Mirror(url, "main", path, timeout_sec=DEADLINE)
        with pytest.raises(FetchError) as info:
            mirror.fetch()
        # the fetch gave up while the server was still sending its first answer
        assert 0 < server.sent < len(server.answer)
        assert not server.finished.is_set()
    assert str(info.value) == f"fetch {url} (branch 'main'): timed out after {DEADLINE}s"
    assert isinstance(info.value, TransientError)
    assert mirror.head() == before
    mirror.close()


def test_the_next_fetch_works_once_the_server_answers_again(bare, tmp_path):
    with SmartHttpServer(bare.parent) as server:
        mirror = Mirror(
            server.url("functions.git"), "main", tmp_path / "m.git", timeout_sec=DEADLINE
        )
        before = mirror.fetch().commit
        work = WorkRepo(tmp_path / "work")
        after = work.commit("second", {"a.txt": "two\n"})
        work.push(str(bare))
        server.mode, server.slow_bytes, server.slow_delay = "trickle", 1, 1.0
        with pytest.raises(FetchError, match=rf"\): timed out after {DEADLINE}s$"):
            mirror.fetch()
        assert mirror.head() == before
        server.mode = "ok"
        result = mirror.fetch()
        mirror.close()
    assert (result.previous, result.commit) == (before, after)


def test_locks_left_by_a_stopped_fetch_do_not_block_the_next(bare, tmp_path):
    path = tmp_path / "mirror.git"
    before = Mirror(str(bare), "main", path).fetch().commit
    # what a fetch killed while it wrote its refs leaves behind
    leftovers = [
        path / "refs" / "sless" / "incoming" / "main.lock",
        path / "refs" / "heads" / "main.lock",
        path / "packed-refs.lock",
        path / "FETCH_HEAD.lock",
        path / "objects" / "pack" / "pack_git2_a1b2c3",
    ]
    for leftover in leftovers:
        leftover.parent.mkdir(parents=True, exist_ok=True)
        leftover.write_bytes(b"")
    work = WorkRepo(tmp_path / "work")
    after = work.commit("second", {"a.txt": "two\n"})
    work.push(str(bare))
    mirror = Mirror(str(bare), "main", path)
    result = mirror.fetch()
    mirror.close()
    assert (result.previous, result.commit) == (before, after)
    assert [p for p in leftovers if p.exists()] == []


@pytest.fixture
def served(tmp_path: Path) -> Iterator[SmartHttpServer]:
    init_bare(tmp_path / "served" / "functions.git")
    with SmartHttpServer(tmp_path / "served") as server:
        yield server


def test_serve_keeps_serving_while_a_fetch_trickles_and_retries_next_pass(served, tmp_path):
    url = served.url("functions.git")
    work = WorkRepo(tmp_path / "work")
    work.commit("v1", http_function("greet", "v1"))
    work.push(url)
    server = SlessServer(url, tmp_path / "state", fetch_timeout=DEADLINE)
    probe = httpx.Client(base_url=server.base, timeout=10)
    try:
        server.start()
        assert server.call("greet").json()["message"] == "v1", server.output()
        work.commit("v2", http_function("greet", "v2"))
        work.push(url)
        served.mode, served.slow_bytes, served.slow_delay = "trickle", 1, 1.0
        asked = len(served.requests)
        passes: list[dict] = []
        syncing = threading.Thread(target=lambda: passes.append(server.sync(timeout=60)))
        syncing.start()
        server.wait(lambda: len(served.requests) > asked, "the fetch to reach the git server")
        # while the ref list trickles in, the server answers and the last good version serves
        while syncing.is_alive():
            assert probe.get("/healthz").status_code == 200
            answer = probe.get("/fn/prod/greet/")
            assert (answer.status_code, answer.json()["message"]) == (200, "v1")
            syncing.join(0.2)
        (failed,) = passes
        assert failed["result"] == "Failed"
        assert failed["error"] == f"fetch {url} (branch 'main'): timed out after {DEADLINE}s"
        assert server.call("greet").json()["message"] == "v1"

        served.mode = "ok"
        assert server.sync()["result"] != "Failed"
        assert server.call("greet").json()["message"] == "v2"
    finally:
        probe.close()
        server.stop()
