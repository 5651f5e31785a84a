"""Streamed responses from the runtimes (issue 30), as real processes called over HTTP:
each value a handler yields goes out as a chunk once it is produced, the client's going
away closes the handler's iteration, and a stream that fails, idles or runs too long
ends unfinished (no last chunk), with the reason in the log.

The handlers are ``streams`` in tests/data/runtime_fns/{python,node}/.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .test_runtimes import FUNCTIONS_DIR, NODE, RUNTIMES, RUNTIMES_DIR, Runtime, Server, _env


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request) -> Runtime:
    name = request.param
    if name == "nodejs20" and NODE is None:
        pytest.fail("node is not installed: scripts/setup installs it (the nodejs20 runtime)")
    interpreter = NODE if name == "nodejs20" else sys.executable
    folder = FUNCTIONS_DIR / ("node" if name == "nodejs20" else "python")
    return Runtime(name, str(interpreter), RUNTIMES_DIR / name, folder)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stream_logs")


def start(runtime: Runtime, log_dir: Path, **env: str) -> Server:
    return Server(runtime, log_dir, "streams.handler", **env).wait_healthy()


@pytest.fixture(scope="module")
def server(runtime, log_dir) -> Iterator[Server]:
    srv = start(runtime, log_dir, SLESS_TIMEOUT_SEC="1", SLESS_STREAM_HEARTBEAT_SEC="0.3")
    try:
        yield srv
    finally:
        srv.stop()


def wait_for(check, what: str, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def raw_call(server: Server, target: str, version: str = "HTTP/1.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(f"GET {target} {version}\r\nHost: x\r\n\r\n".encode())
    return sock


def read_until(sock: socket.socket, needle: bytes, got: bytes = b"") -> bytes:
    while needle not in got:
        data = sock.recv(65536)
        if not data:
            raise AssertionError(f"connection closed before {needle!r}: {got!r}")
        got += data
    return got


@pytest.mark.parametrize("path", ["/gen", "/async"])
def test_the_first_value_arrives_before_the_handler_produces_the_second(server, tmp_path, path):
    signal = tmp_path / f"signal{path.replace('/', '-')}"
    with httpx.stream("GET", f"{server.url}{path}", params={"signal": str(signal)}) as response:
        assert response.status_code == 200
        assert response.headers["transfer-encoding"] == "chunked"
        chunks = response.iter_raw()
        first = next(chunks)  # the handler waits for the signal: buffered, this would hang
        assert first == b"first\n"
        signal.write_text("go")
        assert b"".join(chunks) == b"second\n"


def test_an_async_stream_started_by_the_handler_goes_on_where_it_started(server):
    assert httpx.get(f"{server.url}/made-on-its-loop").text == "first\nsecond\n"


def test_values_other_than_text_are_json_lines(server):
    response = httpx.get(f"{server.url}/ndjson")
    assert response.headers["content-type"] == "application/x-ndjson"
    assert response.text == '{"n":1}\n{"n":2}\n[3]\n'


def test_a_status_form_streams_its_body_with_its_status_and_headers(server):
    response = httpx.get(f"{server.url}/form")
    assert response.status_code == 201
    assert response.headers["x-kind"] == "form"
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"a": 1}


def test_an_empty_stream_is_an_empty_complete_body(server):
    response = httpx.get(f"{server.url}/empty")
    assert response.status_code == 200 and response.content == b""


def test_server_sent_events_have_their_fields_and_a_heartbeat_while_quiet(server):
    response = httpx.get(f"{server.url}/sse", params={"quiet": "1"})
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    text = response.text
    assert text.startswith(
        'event: tick\nid: 1\ndata: {"n":1}\n\nretry: 500\ndata: two\ndata: lines\n\n'
    )
    assert ": heartbeat\n\n" in text  # quiet for 1 s, a comment every 0.3 s
    assert text.endswith("data: after\n\n")


@pytest.mark.parametrize("path", ["/counting", "/async-counting"])
def test_a_client_that_goes_away_closes_the_handlers_iteration(server, tmp_path, path):
    mark = tmp_path / "mark"
    with raw_call(server, f"{path}?mark={mark}") as sock:
        read_until(sock, b"tick 1\n")
    said = wait_for(lambda: mark.exists() and mark.read_text(), "the iteration to end")
    # closed within seconds: run to its end for nobody, it would take 100 s
    assert "finished" not in said


def test_an_exception_mid_stream_ends_the_body_unfinished_and_is_logged(server):
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("GET", f"{server.url}/boom") as response,
    ):
        assert response.status_code == 200
        b"".join(response.iter_raw())
    wait_for(lambda: "broke mid-stream" in server.stderr, "the traceback")
    assert "raised mid-stream" in server.stderr


def test_an_exception_before_the_first_value_is_a_500(server):
    response = httpx.get(f"{server.url}/boom-first")
    assert response.status_code == 500


def test_the_timeout_bounds_the_time_to_the_first_value(server):
    response = httpx.get(f"{server.url}/slow-first", params={"sleep": "3"})
    assert response.status_code == 504


def test_a_stream_idle_past_idle_sec_ends_unfinished(runtime, log_dir):
    srv = start(runtime, log_dir, SLESS_STREAM_IDLE_SEC="0.5")
    try:
        got = b""
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream("GET", f"{srv.url}/idle", params={"sleep": "5"}) as response,
        ):
            for chunk in response.iter_raw():
                got += chunk
        assert got == b"first\n"
        # the watchdog says why as its stream's thread cuts it: the line may come just after
        wait_for(lambda: "sent nothing for 0.5s (stream.idleSec)" in srv.stderr, "the reason")
    finally:
        srv.stop()


def test_a_stream_whose_handler_is_stuck_ends_and_is_no_longer_in_flight(runtime, log_dir):
    srv = start(runtime, log_dir, SLESS_STREAM_IDLE_SEC="0.5")
    try:
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream("GET", f"{srv.url}/stuck") as response,
        ):
            b"".join(response.iter_raw())

        def inflight() -> int:
            return httpx.get(f"{srv.url}/health").json()["inflight"]

        # the handler may never let go: the stream ended all the same, for the load too
        wait_for(lambda: inflight() == 0, "no call in flight")
    finally:
        srv.stop()


def test_a_stream_past_max_sec_ends_unfinished_and_its_iteration_is_closed(
    runtime, log_dir, tmp_path
):
    srv = start(runtime, log_dir, SLESS_STREAM_MAX_SEC="1")
    mark = tmp_path / "mark"
    try:
        got = b""
        with (
            pytest.raises(httpx.RemoteProtocolError),
            httpx.stream("GET", f"{srv.url}/counting", params={"mark": str(mark)}) as r,
        ):
            for chunk in r.iter_raw():
                got += chunk
        assert got.startswith(b"tick 0\ntick 1\n")
        wait_for(lambda: "ran for 1s (stream.maxSec)" in srv.stderr, "the reason")
        assert wait_for(lambda: mark.exists() and mark.read_text(), "the iteration") == "closed\n"
    finally:
        srv.stop()


def test_an_http_1_0_client_gets_the_stream_until_the_connection_closes(server):
    got = b""
    with raw_call(server, "/gen", "HTTP/1.0") as sock:
        while data := sock.recv(65536):
            got += data
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    assert body == b"first\nsecond\n"


def test_ordinary_results_are_unchanged(server):
    response = httpx.get(f"{server.url}/plain")
    assert response.json() == {"path": "/plain"}
    assert "content-length" in response.headers


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("SLESS_STREAM_IDLE_SEC", "soon", "is not a number of seconds"),
        ("SLESS_STREAM_MAX_SEC", "0", "must be a positive number of seconds"),
        ("SLESS_STREAM_HEARTBEAT_SEC", "-5", "must be a positive number of seconds"),
    ],
)
def test_a_stream_limit_that_is_not_a_duration_stops_the_start_and_says_which(
    runtime, name, value, why
):
    started = subprocess.run(
        runtime.command("server"),
        env=_env(runtime, PORT="0", SLESS_ENTRYPOINT="streams.handler", **{name: value}),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert started.returncode == 1
    # node says "must be a positive number" for both: Number("soon") is NaN
    said = started.stderr
    assert f"{name}={value!r}" in said or f'{name}="{value}"' in said, said
    assert why in said or "must be a positive number of seconds" in said, said


def test_head_of_a_stream_claims_no_length(server):
    # a GET would stream an unknown length: HEAD must not say it is empty
    reply = httpx.head(f"{server.url}/gen")
    assert reply.status_code == 200
    assert "content-length" not in reply.headers
    assert reply.content == b""
