"""The edge of a real ``gitops-sless serve``, probed with raw bytes over loopback sockets.

One server for the module follows a plain folder (seeded into a bare
repository): ``echo`` answers with its process's instance id, the calls it
has run and what it was sent, ``paused`` is disabled and ``broken`` has an
invalid manifest (both declared, neither served). The server's limits are
shortened through the ``SLESS_PROXY_*`` variables ``proxy.config()`` reads,
so timeouts take about a second.

The first part covers what the edge refuses or bounds (each failed before
the limits existed); the second part is a regression suite for what already
held (smuggling, traversal, body limit, pipelining). Every refused request
must leave the function untouched, and the last test checks that after all
of it the server is healthy and no runtime process was restarted.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import write_files
from ..sless_server import SlessServer

ECHO = """\
import os
import uuid

INSTANCE = uuid.uuid4().hex  # this replica process (in a sandbox, every pid is 1)
CALLS = []  # every call this replica ever ran, in order


def main(event, context):
    CALLS.append(event["_path"])
    return {
        "instance": INSTANCE,
        "calls": CALLS,
        "path": event["_path"],
        "headers": event["_headers"],
        "body": event.get("_body"),
        "numbers": event.get("numbers"),
    }
"""


def _manifest(name: str, *extra: str) -> str:
    lines = [
        "functions:",
        f"  - name: {name}",
        "    runtime: python3.11",
        "    entrypoint: handler.main",
        "    triggers: [{type: http}]",
        *extra,
    ]
    return "\n".join(lines) + "\n"


def _files() -> dict[str, str]:
    return {
        "echo/sless.yaml": _manifest("echo"),
        "echo/handler.py": ECHO,
        "paused/sless.yaml": _manifest("paused", "    enabled: false"),
        "paused/handler.py": ECHO,
        "broken/sless.yaml": _manifest("broken", "    memoryMB: -10"),
        "broken/handler.py": ECHO,
    }


MAX_CONNECTIONS = 16
LIMITS = {
    "SLESS_PROXY_HEAD_TIMEOUT": "1",
    "SLESS_PROXY_BODY_TIMEOUT": "1.5",
    "SLESS_PROXY_IDLE_TIMEOUT": "1",
    "SLESS_PROXY_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
}
MAX_BODY = 1 << 20  # serve's default --max-body-bytes


class Edge:
    """The server, the echo replica's instance at the start, and raw-socket helpers."""

    def __init__(self, server: SlessServer) -> None:
        self.server = server
        self.port = server.port
        self.instance = ""
        self.pids: set[str] = set()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=15)

    def exchange(self, data: bytes) -> bytes:
        """Send ``data`` and read until the server closes the connection."""
        with self.connect() as sock:
            sock.sendall(data)
            return _read_to_eof(sock)

    def reply(self, data: bytes, method: str = "GET") -> tuple[int, dict, bytes]:
        """Send ``data``, read one response: (status, headers, body)."""
        with self.connect() as sock:
            sock.sendall(data)
            return _response(sock, method)

    def metrics(self) -> str:
        return self.server.client.get("/metrics").text

    def echo_calls(self) -> int:
        """Calls the proxy started for ``echo``, whatever their status."""
        pattern = r'^sless_invocations_total\{env="prod",name="echo",[^}]*\} (\S+)$'
        found = re.findall(pattern, self.metrics(), re.MULTILINE)
        return int(sum(float(value) for value in found))

    def handled(self) -> list[str]:
        """The paths of every call the echo handler has run, ending with this one's ``/fence``.

        The handler keeps them: its sandbox lets it write no file the test could read.
        """
        status, _, body = self.reply(_get("/fn/prod/echo/fence"))
        assert status == 200, body
        return json.loads(body)["calls"]

    def unknown(self) -> float:
        found = re.search(r"^sless_proxy_unknown_total (\S+)$", self.metrics(), re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def replica_pids(self) -> set[str]:
        return {path.name for path in (self.server.state_dir / "pids" / "servers").iterdir()}


def _read_to_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _response(sock: socket.socket, method: str = "GET") -> tuple[int, dict, bytes]:
    response = http.client.HTTPResponse(sock, method=method)
    try:
        response.begin()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, response.read()
    finally:
        response.close()


def _refusal(data: bytes, status: int) -> str:
    """The error of the one JSON refusal that is all of ``data``; the server closed after it."""
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), data[:400]
    lowered = head.lower()
    assert b"\r\nconnection: close" in lowered and b"\r\ncontent-type: application/json" in lowered
    return json.loads(body)["error"]


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    root = tmp_path_factory.mktemp("edge")
    repo = write_files(root / "functions", _files())
    server = SlessServer(str(repo), root / "state", env=LIMITS)
    server.start()
    try:
        echo = server.wait(
            lambda: (r := server.call("echo")).status_code == 200 and r.json(), "echo to serve"
        )
        edge = Edge(server)
        edge.instance = echo["instance"]
        edge.pids = edge.replica_pids()
        yield edge
    finally:
        server.stop()


def _get(path: str, *headers: bytes, host: bytes = b"Host: edge\r\n") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\n" + host + b"".join(headers) + b"\r\n"


# --------------------------------------------------------------------------- declared, not served


def test_declared_functions_that_do_not_serve_are_503_with_their_phase(edge):
    unknown_before = edge.unknown()
    status, headers, body = edge.reply(_get("/fn/prod/paused/x"))
    assert (status, headers["content-type"]) == (503, "application/json")
    paused = json.loads(body)
    assert (paused["error"], paused["phase"], paused["function"]) == (
        "function disabled",
        "Disabled",
        "paused",
    )
    status, _, body = edge.reply(_get("/fn/prod/broken/"))
    broken = json.loads(body)
    assert (status, broken["phase"]) == (503, "Invalid")
    assert "memoryMB" in broken["message"]
    status, _, body = edge.reply(_get("/fn/prod/nobody-declares-this/"))
    assert status == 404 and "phase" not in json.loads(body)

    metrics = edge.server.wait(
        lambda: 'name="broken",status="503"' in (text := edge.metrics()) and text, "metrics"
    )
    assert 'sless_invocations_total{env="prod",name="paused",status="503"} 1' in metrics
    assert 'name=""' not in metrics and "nobody-declares-this" not in metrics
    assert edge.unknown() == unknown_before + 1


# --------------------------------------------------------------------------- the edge's limits


@pytest.mark.parametrize("path", ["/fn/prod/echo/", "/healthz"], ids=["proxy", "api"])
def test_a_head_over_64_kib_is_431(edge, path):
    before = edge.echo_calls()
    data = edge.exchange(_get(path, b"X-Big: " + b"b" * (70 * 1024) + b"\r\n"))
    assert _refusal(data, 431) == "request head larger than 65536 bytes"
    assert edge.echo_calls() == before


def test_a_head_under_the_limit_is_served(edge):
    cookie = b"c" * (40 * 1024)
    status, _, body = edge.reply(_get("/fn/prod/echo/", b"Cookie: " + cookie + b"\r\n"))
    assert status == 200
    assert json.loads(body)["headers"]["cookie"] == cookie.decode()


def test_a_connection_that_never_sends_a_request_is_closed(edge):
    with edge.connect() as sock:
        assert _read_to_eof(sock) == b""  # SLESS_PROXY_IDLE_TIMEOUT=1


@pytest.mark.parametrize("path", ["/fn/prod/echo/", "/api/v1/status"], ids=["proxy", "api"])
def test_a_head_trickled_slower_than_the_head_timeout_is_408(edge, path):
    before = edge.echo_calls()
    head = _get(path, b"X-Slow: " + b"s" * 400 + b"\r\n")
    with edge.connect() as sock:
        for i in range(len(head) - 2):  # one byte every 10 ms, never the final CRLF
            if select.select([sock], [], [], 0.01)[0]:
                break
            sock.sendall(head[i : i + 1])
        data = _read_to_eof(sock)
    assert _refusal(data, 408) == "request head not received within 1s"
    assert edge.echo_calls() == before


def test_a_stalled_body_is_408_on_the_proxy(edge):
    before = edge.echo_calls()
    data = edge.exchange(
        b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: edge\r\nContent-Length: 100\r\n\r\n0123456789"
    )
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"] == "request body stalled for 1.5s"
    assert edge.server.wait(lambda: edge.echo_calls() == before + 1, "the 408 to be counted")


def test_a_stalled_body_is_408_on_the_api(edge):
    data = edge.exchange(
        b"POST /api/v1/webhooks/github HTTP/1.1\r\nHost: edge\r\nContent-Length: 100\r\n"
        b'Content-Type: application/json\r\n\r\n{"ref": '
    )
    assert _refusal(data, 408) == "request body stalled for 1.5s"


def test_connections_past_the_cap_are_503(edge):
    held: list[socket.socket] = []
    statuses: list[int] = []
    try:
        for i in range(MAX_CONNECTIONS + 2):
            sock = edge.connect()
            held.append(sock)
            sock.sendall(_get(f"/fn/prod/echo/{i}"))
            status, headers, body = _response(sock)
            statuses.append(status)
            if status == 503:
                assert headers["connection"] == "close"
                assert json.loads(body)["error"] == "too many connections (the limit is 16)"
        served = statuses.count(200)
        # the test's own HTTP client may hold a connection or two of the 16
        assert MAX_CONNECTIONS - 3 <= served <= MAX_CONNECTIONS, statuses
        assert statuses == [200] * served + [503] * (len(statuses) - served)
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 15
    while edge.reply(_get("/fn/prod/echo/after"))[0] != 200:  # the places free up
        assert time.monotonic() < deadline, "no place freed up"
        time.sleep(0.05)


# --------------------------------------------------------------------------- forwarding headers


def test_client_forwarding_headers_are_replaced_by_the_edges_own(edge):
    status, _, body = edge.reply(
        _get(
            "/fn/prod/echo/",
            b"X-Forwarded-For: 203.0.113.7\r\n",
            b"X-Forwarded-For: 198.51.100.1\r\n",
            b"X-Forwarded-Host: spoofed.example\r\n",
            b"X-Forwarded-Proto: https\r\n",
            b"X-Forwarded-Port: 443\r\n",
            b"X-Real-IP: 203.0.113.8\r\n",
            b"Forwarded: for=203.0.113.9;proto=https\r\n",
            host=f"Host: 127.0.0.1:{edge.port}\r\n".encode(),
        )
    )
    assert status == 200
    seen = json.loads(body)["headers"]
    forwarding = {k: v for k, v in seen.items() if "forward" in k or k == "x-real-ip"}
    assert forwarding == {
        "x-forwarded-for": "127.0.0.1",
        "x-forwarded-host": f"127.0.0.1:{edge.port}",
        "x-forwarded-proto": "http",
        "x-forwarded-prefix": "/fn/prod/echo",
        "forwarded": f'for=127.0.0.1;proto=http;host="127.0.0.1:{edge.port}"',
    }


@pytest.mark.parametrize(
    ("data", "status", "error"),
    [
        pytest.param(
            _get("/fn/prod/echo/", b"Host: other\r\n"), 400, "more than one Host header", id="two"
        ),
        pytest.param(
            _get("/fn/prod/echo/", host=b"X-No-Host: 1\r\n"), 400, "missing Host header", id="none"
        ),
    ],
)
def test_host_must_be_there_once(edge, data, status, error):
    before = edge.echo_calls()
    assert _refusal(edge.exchange(data), status) == error
    assert edge.echo_calls() == before


# --------------------------------------------------------------------------- the request line


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GET /fn/prod/echo/\r\nHost: edge\r\n\r\n", id="no-version"),
        pytest.param(
            b"GET /fn/prod/echo/a\nX-Injected: two HTTP/1.1\r\nHost: edge\r\n\r\n", id="bare-lf"
        ),
    ],
)
def test_a_request_line_without_a_version_is_400(edge, data):
    before = edge.echo_calls()
    assert _refusal(edge.exchange(data), 400) == "request line without an HTTP version"
    assert edge.echo_calls() == before


def test_a_transfer_coding_before_chunked_is_501(edge):
    before = edge.echo_calls()
    data = edge.exchange(
        b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: edge\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    )
    assert "gzip, chunked" in _refusal(data, 501)
    assert edge.echo_calls() == before


# --------------------------------------------------------------------------- what already held

SMUGGLING = [
    pytest.param(
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\nGET /fn/prod/echo/smuggled HTTP/1.1\r\nHost: edge\r\n\r\n",
        id="cl-and-te",
    ),
    pytest.param(b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", id="two-lengths"),
    pytest.param(b"Content-Length: 3\r\nContent-Length: 3\r\n\r\nabc", id="same-length-twice"),
    pytest.param(b"Content-Length: +3\r\n\r\nabc", id="signed-length"),
    pytest.param(b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n", id="te-space-before-colon"),
    pytest.param(b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", id="te-xchunked"),
    pytest.param(b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", id="chunk-zz"),
    pytest.param(b"Transfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n", id="chunk-neg"),
    pytest.param(
        b"Transfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
        id="chunk-overflow",
    ),
]


@pytest.mark.parametrize("rest", SMUGGLING)
def test_ambiguous_framing_is_400_and_never_reaches_the_function(edge, rest):
    handled = edge.handled()
    data = edge.exchange(b"POST /fn/prod/echo/smuggle HTTP/1.1\r\nHost: edge\r\n" + rest)
    assert data.startswith(b"HTTP/1.1 400 "), data[:300]
    assert data.count(b"HTTP/1.1 ") == 1  # nothing smuggled behind it was answered
    # the handler never ran; a call whose body broke off is recorded as that 400
    assert edge.handled() == [*handled, "/fence"]  # calls are handled in order


def test_pipelined_requests_on_a_kept_alive_connection_are_answered_in_order(edge):
    requests = b"".join(_get(f"/fn/prod/echo/{i}") for i in range(4))
    with edge.connect() as sock:
        sock.sendall(requests)
        # one buffered reader for all four: a reader per response (http.client's) may
        # swallow the start of the next one when they arrive in one segment
        stream = sock.makefile("rb")
        paths = [json.loads(_next_body(stream))["path"] for _ in range(4)]
    assert paths == ["/0", "/1", "/2", "/3"]


def _next_body(stream: Any) -> bytes:
    """The body of the next response on ``stream`` (framed by Content-Length)."""
    assert stream.readline().startswith(b"HTTP/1.1 200 ")
    length = 0
    while (line := stream.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return stream.read(length)


@pytest.mark.parametrize(
    "target",
    ["/fn/prod/..%2f..%2fapi/v1/status", "/fn/prod/%2e%2e/echo/", "/fn/prod/echo%2f..%2fpaused/"],
)
def test_traversal_stays_in_the_routing_table(edge, target):
    status, _, body = edge.reply(_get(target))
    assert status == 404, body
    assert json.loads(body)["error"] == "function not found"


def test_traversal_below_a_function_stays_in_that_function(edge):
    status, _, body = edge.reply(_get("/fn/prod/echo/..%2f..%2foff/x"))
    assert status == 200
    seen = json.loads(body)
    assert seen["instance"] == edge.instance  # echo's own replica: the sub-path is echo's business
    assert seen["path"] == "/../../off/x"  # as the runtime decodes it


def test_an_absolute_form_target_never_reaches_its_host(edge):
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.setblocking(False)
        port = trap.getsockname()[1]
        status, _, body = edge.reply(_get(f"http://127.0.0.1:{port}/fn/prod/echo/abs"))
        assert status == 200 and json.loads(body)["path"] == "/abs"  # served by the table's echo
        with pytest.raises(BlockingIOError):
            trap.accept()


def test_a_body_over_1_mib_is_413_before_the_function(edge):
    before = edge.echo_calls()
    status, headers, body = edge.reply(
        b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: edge\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)
    )
    assert (status, headers["connection"]) == (413, "close")
    assert json.loads(body)["error"] == f"request body larger than {MAX_BODY} bytes"
    assert edge.server.wait(lambda: edge.echo_calls() == before + 1, "the 413 to be counted")


def test_a_streamed_body_over_1_mib_is_413(edge):
    chunk = b"x" * 65536
    with edge.connect() as sock:
        sock.sendall(
            b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: edge\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(MAX_BODY // len(chunk) + 4):
            if select.select([sock], [], [], 0.01)[0]:
                break  # answered: stop sending, so the close is clean
            sock.sendall(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        status, _, body = _response(sock)
    assert status == 413
    assert json.loads(body)["error"] == f"request body larger than {MAX_BODY} bytes"


def test_a_body_sent_slowly_but_steadily_is_served(edge):
    body = json.dumps({"numbers": list(range(20))}).encode()
    with edge.connect() as sock:
        sock.sendall(
            b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: edge\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        step = len(body) // 4 + 1
        for i in range(0, len(body), step):  # 4 pieces 0.4 s apart: 1.6 s, each pause < 1.5 s
            time.sleep(0.4)
            sock.sendall(body[i : i + step])
        status, _, reply = _response(sock)
    assert status == 200
    assert json.loads(reply)["numbers"] == list(range(20))


# --------------------------------------------------------------------------- last: no harm done


def test_after_all_of_it_the_server_is_healthy_and_nothing_restarted(edge):
    assert edge.server.client.get("/healthz").status_code == 200
    status, _, body = edge.reply(_get("/fn/prod/echo/still-there"))
    assert status == 200
    assert json.loads(body)["instance"] == edge.instance  # the same replica process throughout
    assert edge.replica_pids() == edge.pids
    assert edge.server.process is not None and edge.server.process.poll() is None
    assert Path(edge.server.log).exists()
