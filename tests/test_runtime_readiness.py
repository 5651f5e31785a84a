"""What the runtimes tell a supervisor: the ready line on SLESS_READY_FD and /health's load.

Real server processes of both runtimes, started as tests/test_runtimes.py starts
them, with an inherited pipe named by SLESS_READY_FD and PORT=0 (the line says
which port). The handlers are written by the fixture below: they show their
environment, fail at import, or wait until the test creates a release file, so
that the calls in flight are the test's to decide and no assertion rests on a
stopwatch.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from .test_runtimes import NODE, RUNTIMES, RUNTIMES_DIR, Runtime, _env

GUARD_SEC = 30.0  # against a hang only; no assertion is about how long anything took

PYTHON_HANDLER = """\
import os
import time


def main(event):
    path = event["_path"]
    if path == "/env":
        return dict(os.environ)
    if path == "/wait":  # until the release file exists; then write the done file, if asked
        query = event["_query"]
        while not os.path.exists(query["until"]):
            time.sleep(0.005)
        if "done" in query:
            open(query["done"], "w").close()
        return {"released": True}
    return {}
"""

NODE_HANDLER = """\
const fs = require('node:fs');

exports.main = async (event) => {
  if (event._path === '/env') return { ...process.env };
  if (event._path === '/wait') { // until the release file exists; then write the done file
    const query = event._query;
    while (!fs.existsSync(query.until)) await new Promise((resolve) => setTimeout(resolve, 5));
    if (query.done) fs.writeFileSync(query.done, '');
    return { released: true };
  }
  return {};
};
"""


@pytest.fixture(scope="module")
def function_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ready_fns")
    python_dir = root / "python"
    python_dir.mkdir()
    (python_dir / "handler.py").write_text(PYTHON_HANDLER)
    (python_dir / "broken.py").write_text('raise RuntimeError("broken at import")\n')
    node_dir = root / "node"
    node_dir.mkdir()
    (node_dir / "handler.js").write_text(NODE_HANDLER)
    (node_dir / "broken.js").write_text("throw new Error('broken at import');\n")
    return {"python3.11": python_dir, "nodejs20": node_dir}


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request, function_dirs) -> Runtime:
    name = request.param
    if name == "nodejs20":
        if NODE is None:
            pytest.fail("node is not installed: scripts/setup installs it (the nodejs20 runtime)")
        interpreter = NODE
    else:
        interpreter = sys.executable
    return Runtime(name, interpreter, RUNTIMES_DIR / name, function_dirs[name])


@dataclass
class Started:
    """A server process started with a ready pipe, and what came through that pipe."""

    proc: subprocess.Popen
    before: float  # time.monotonic() just before the spawn
    ready: bytes  # everything written to the pipe before it reached EOF
    after: float  # time.monotonic() once the pipe reached EOF
    stderr_path: Path

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    @property
    def line(self) -> dict:
        assert self.ready.endswith(b"\n") and self.ready.count(b"\n") == 1, self.ready
        return json.loads(self.ready)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.line['port']}"

    def health(self, headers: dict[str, str] | None = None) -> dict:
        response = httpx.get(f"{self.url}/health", headers=headers)
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        return response.json()

    def wait(self) -> int:
        return self.proc.wait(timeout=GUARD_SEC)


def _read_to_eof(fd: int) -> bytes:
    data = b""
    end = time.monotonic() + GUARD_SEC
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            raise AssertionError(f"the ready pipe neither had a line nor closed: {data!r}")
        chunk = os.read(fd, 4096)
        if not chunk:
            return data
        data += chunk


@pytest.fixture
def start(runtime, tmp_path) -> Iterator[Callable[..., Started]]:
    """Start ``runtime``'s server with SLESS_READY_FD; each is stopped after the test."""
    procs: list[subprocess.Popen] = []

    def start(entrypoint: str = "handler.main", **env: str) -> Started:
        read_end, write_end = os.pipe()
        stderr_path = tmp_path / f"{runtime.name}-{len(procs)}.stderr"
        settings = {"PORT": "0", "SLESS_HOST": "127.0.0.1", "SLESS_ENTRYPOINT": entrypoint}
        environ = _env(runtime, **{**settings, **env, "SLESS_READY_FD": str(write_end)})
        try:
            with open(stderr_path, "wb") as err:
                before = time.monotonic()
                procs.append(
                    subprocess.Popen(
                        runtime.command("server"),
                        env=environ,
                        pass_fds=(write_end,),
                        stdin=subprocess.DEVNULL,
                        stdout=err,
                        stderr=err,
                    )
                )
            os.close(write_end)
            write_end = -1
            ready = _read_to_eof(read_end)
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
        return Started(procs[-1], before, ready, time.monotonic(), stderr_path)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- the ready line


def test_the_ready_line_has_the_port_and_the_start_phases_in_order(start):
    srv = start()
    line = srv.line
    assert list(line) == ["port", "t"]
    phases = line["t"]
    assert list(phases) == ["start", "runtime", "handler", "listening"]
    # the runtime's clock is the parent's: each phase falls between the spawn and the line
    assert srv.before <= phases["start"] <= phases["runtime"]
    assert phases["runtime"] <= phases["handler"] <= phases["listening"] <= srv.after
    assert srv.health()["status"] == "ok"  # PORT=0: the line names the port it took


def test_the_handler_does_not_see_the_ready_fd(start):
    srv = start()
    seen = httpx.get(f"{srv.url}/env").json()
    assert "SLESS_READY_FD" not in seen
    assert seen["SLESS_ENTRYPOINT"] == "handler.main"


def test_a_handler_that_fails_to_import_closes_the_fd_without_a_line(start):
    srv = start("broken.main")
    assert srv.ready == b""
    assert srv.wait() == 1
    assert "runtime: error: cannot load SLESS_ENTRYPOINT=" in srv.stderr
    assert "broken at import" in srv.stderr


def test_a_port_it_cannot_listen_on_closes_the_fd_without_a_line(start):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        srv = start(PORT=str(taken.getsockname()[1]))
        assert srv.ready == b""
        assert srv.wait() == 1
    assert "runtime: error: cannot listen on 127.0.0.1:" in srv.stderr


def test_a_stop_right_after_the_ready_line_is_a_clean_stop(start):
    srv = start()
    assert srv.line["port"] > 0
    srv.proc.send_signal(signal.SIGTERM)  # its handler is in place before the line is written
    assert srv.wait() == 0


# ----------------------------------------------------------------------------- /health's load


def _wait(srv: Started, release: Path, done: Path | None = None) -> httpx.Response:
    params = {"until": str(release)}
    if done is not None:
        params["done"] = str(done)
    return httpx.get(f"{srv.url}/wait", params=params, timeout=GUARD_SEC)


def _health_until(srv: Started, ready: Callable[[dict], bool]) -> dict:
    end = time.monotonic() + GUARD_SEC
    while time.monotonic() < end:
        report = srv.health()
        if ready(report):
            return report
        time.sleep(0.01)
    raise AssertionError(f"/health never got there: {report}")


def test_health_reports_the_calls_in_flight_and_the_busy_seconds(start, tmp_path):
    srv = start(SLESS_TIMEOUT_SEC="60")
    assert srv.health() == {"status": "ok", "inflight": 0, "requests": 0, "busySeconds": 0}
    release = tmp_path / "release"
    with ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(_wait, srv, release) for _ in range(3)]
        seen = _health_until(srv, lambda report: report["inflight"] >= 3)
        seen_at = time.monotonic()  # the three were in flight when /health answered, before this
        assert seen["inflight"] == 3
        assert seen["requests"] == 0
        time.sleep(0.2)
        released_at = time.monotonic()  # the three are still in flight now, until the release
        release.touch()
        assert [call.result().json() for call in calls] == [{"released": True}] * 3
    report = srv.health()
    assert report["inflight"] == 0
    assert report["requests"] == 3
    assert report["busySeconds"] >= 3 * (released_at - seen_at)
    assert report["busySeconds"] >= seen["busySeconds"] + 3 * (released_at - seen_at)
    head = httpx.head(f"{srv.url}/health")
    assert head.status_code == 200
    assert head.content == b""


def test_a_call_past_its_timeout_stops_counting_once_and_only_once(start, tmp_path):
    srv = start(SLESS_TIMEOUT_SEC="1")
    release, done = tmp_path / "release", tmp_path / "done"
    assert _wait(srv, release, done).status_code == 504
    report = srv.health()
    assert report["inflight"] == 0
    assert report["requests"] == 1
    # it ran its timeout: Node's timers may fire a fraction of a millisecond early by the
    # monotonic clock that counts busy time (a clean-clone run saw 0.99957)
    assert report["busySeconds"] >= 0.99
    release.touch()  # the handler, abandoned but still running, now returns
    end = time.monotonic() + GUARD_SEC
    while not done.exists() and time.monotonic() < end:
        time.sleep(0.01)
    assert done.exists()
    time.sleep(0.05)  # for the abandoned call to return through the runtime (no bound on it)
    after = srv.health()
    assert (after["inflight"], after["requests"]) == (0, 1)


def test_with_a_replica_key_health_needs_none_and_refused_calls_are_not_counted(start):
    key = "k3y-only-the-proxy-knows"
    srv = start(SLESS_REPLICA_KEY=key)
    proxy = {"X-Sless-Replica": key}
    assert httpx.get(f"{srv.url}/env").status_code == 403
    assert srv.health(proxy) == {"status": "ok", "inflight": 0, "requests": 0, "busySeconds": 0}
    assert httpx.get(f"{srv.url}/env", headers=proxy).status_code == 200
    assert srv.health(proxy)["requests"] == 1


def test_a_neighbour_without_the_key_learns_nothing_of_the_load(start):
    """Sandboxes share the loopback: another function may reach /health, not the figures."""
    key = "k3y-only-the-proxy-knows"
    srv = start(SLESS_REPLICA_KEY=key)
    assert httpx.get(f"{srv.url}/env", headers={"X-Sless-Replica": key}).status_code == 200
    assert srv.health() == {"status": "ok"}
    assert srv.health({"X-Sless-Replica": "a-guess"}) == {"status": "ok"}
    assert srv.health({"X-Sless-Replica": key})["requests"] == 1
