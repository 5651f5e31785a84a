"""WebSocket functions in the runtimes (issue 30), as real processes: a real client (the
``websockets`` library) and, for what a well-behaved client never sends, a raw socket
that frames by hand. Each test checks what the client sees: the messages, the close
codes, the HTTP answers to refused upgrades, and the runtime's log and /health.

The handlers are ``sockets`` in tests/data/runtime_fns/{python,node}/ (the contract in
both runtimes' README).
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from . import test_runtime_streams
from .test_runtimes import Runtime, Server, _env

HOOKS = {
    "SLESS_WEBSOCKET": "1",
    "SLESS_WS_ON_CONNECT": "connect",
    "SLESS_WS_ON_DISCONNECT": "disconnect",
}
LIMIT = 1024  # SLESS_WS_MAX_MESSAGE_BYTES of the shared server

CONTINUATION, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


runtime = test_runtime_streams.runtime  # both runtimes, with the handlers of runtime_fns


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("websocket_logs")


def start(runtime: Runtime, log_dir: Path, **env: str) -> Server:
    return Server(runtime, log_dir, "sockets.handler", **(HOOKS | env)).wait_healthy()


@pytest.fixture(scope="module")
def server(runtime, log_dir) -> Iterator[Server]:
    srv = start(runtime, log_dir, SLESS_TIMEOUT_SEC="1", SLESS_WS_MAX_MESSAGE_BYTES=str(LIMIT))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def own_server(runtime, log_dir) -> Iterator:
    """Start a server of the test's own settings; stopped after the test."""
    started: list[Server] = []

    def make(**env: str) -> Server:
        started.append(start(runtime, log_dir, **env))
        return started[-1]

    yield make
    for srv in started:
        srv.stop()


def wait_for(check, what: str, timeout: float = 15.0):
    return test_runtime_streams.wait_for(check, what, timeout)  # a socket's end: longer


def ws(server: Server, path: str = "/", **options) -> ClientConnection:
    """A real client; it answers pings itself and sends none of its own."""
    options.setdefault("ping_interval", None)
    return connect(f"ws://127.0.0.1:{server.port}{path}", proxy=None, open_timeout=10, **options)


def closed_by_server(client: ClientConnection) -> tuple[int, str]:
    """The close frame the server sent, once the client reads that it closed."""
    with pytest.raises(ConnectionClosed) as closed:
        client.recv(timeout=15)
    assert closed.value.rcvd is not None, "the server sent no close frame"
    return closed.value.rcvd.code, closed.value.rcvd.reason


def inflight(server: Server) -> int:
    return httpx.get(f"{server.url}/health").json()["inflight"]


def disconnect_lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


class Raw:
    """A WebSocket client over a bare socket: frames exactly as the test writes them."""

    def __init__(self, server: Server, path: str = "/") -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        self.buf = b""
        head = self._until(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101 "), head

    def _until(self, needle: bytes) -> bytes:
        while needle not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(needle)
        return head

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError(f"the server ended the connection; unread: {self.buf!r}")
        self.buf += data

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._more()
        taken, self.buf = self.buf[:n], self.buf[n:]
        return taken

    def send(
        self,
        opcode: int,
        payload: bytes = b"",
        fin: bool = True,
        masked: bool = True,
        length: int | None = None,
    ) -> None:
        """One frame; ``length``: the length its header declares, whatever is sent."""
        n = len(payload) if length is None else length
        head = bytes([(0x80 if fin else 0) | opcode])
        bit = 0x80 if masked else 0
        if n < 126:
            head += bytes([bit | n])
        elif n < 65536:
            head += bytes([bit | 126]) + n.to_bytes(2, "big")
        else:
            head += bytes([bit | 127]) + n.to_bytes(8, "big")
        if masked:
            mask = os.urandom(4)
            head += mask
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(head + payload)

    def recv(self) -> tuple[int, bytes]:
        b0, b1 = self._take(2)
        assert not b1 & 0x80, "a server frame must not be masked"
        assert b0 & 0x80, "this server sends no fragments"
        n = b1 & 0x7F
        if n == 126:
            n = int.from_bytes(self._take(2), "big")
        elif n == 127:
            n = int.from_bytes(self._take(8), "big")
        return b0 & 0x0F, self._take(n)

    def recv_close(self) -> tuple[int, str]:
        """The server's close frame (its pings unanswered, skipped)."""
        while True:
            opcode, payload = self.recv()
            if opcode == CLOSE:
                return int.from_bytes(payload[:2], "big"), payload[2:].decode()
            assert opcode in (PING, PONG), (opcode, payload)

    def close(self) -> None:
        self.sock.close()


# ----------------------------------------------------------------------------- messages


def test_text_and_binary_messages_are_echoed_as_they_came(server):
    with ws(server) as client:
        client.send("hello, wörld")
        assert client.recv(timeout=10) == "hello, wörld"
        client.send(b"\x00\xffbytes")
        assert client.recv(timeout=10) == b"\x00\xffbytes"  # bytes: a binary frame


def test_a_result_that_is_neither_text_nor_bytes_is_json_text(server):
    with ws(server) as client:
        client.send("json")
        answer = client.recv(timeout=10)
    assert isinstance(answer, str)
    assert answer.replace(" ", "") == '{"kind":"json","ok":true}'


def test_what_the_handler_sends_comes_before_its_result_in_order(server):
    with ws(server) as client:
        client.send("push:3")
        got = [client.recv(timeout=10) for _ in range(4)]
    assert got == ["push 1", "push 2", "push 3", "pushed 3"]


def test_a_handler_returning_nothing_sends_nothing(server):
    with ws(server) as client:
        client.send("none")
        client.send("after")
        assert client.recv(timeout=10) == "after"


def test_the_connection_id_is_the_upgrades_request_id(server):
    with ws(server, additional_headers={"x-request-id": "ws-id-7"}) as client:
        client.send("id")
        assert client.recv(timeout=10) == "ws-id-7"


def test_what_a_handler_prints_is_tagged_with_the_upgrades_request_id(server):
    with ws(server, additional_headers={"x-request-id": "ws-print-1"}) as client:
        client.send("print:hello from a socket")
        assert client.recv(timeout=10) == "printed"
    wait_for(
        lambda: any(
            line.startswith("[request_id=ws-print-1 trace_id=")
            and line.endswith("] hello from a socket")
            for line in server.stdout_path.read_text().splitlines()
        ),
        "the tagged line",
    )


def test_a_fragmented_text_message_is_reassembled_before_the_handler(server):
    raw = Raw(server)
    try:
        raw.send(TEXT, b"frag", fin=False)
        raw.send(CONTINUATION, b"ment", fin=False)
        raw.send(CONTINUATION, "ed é".encode())  # a character whole only once reassembled
        assert raw.recv() == (TEXT, "fragmented é".encode())
    finally:
        raw.close()


def test_a_ping_is_answered_with_its_payload_even_between_fragments(server):
    raw = Raw(server)
    try:
        raw.send(PING, b"are you there")
        assert raw.recv() == (PONG, b"are you there")
        raw.send(TEXT, b"one ", fin=False)
        raw.send(PING, b"mid-message")
        assert raw.recv() == (PONG, b"mid-message")  # before the message is complete
        raw.send(CONTINUATION, b"message")
        assert raw.recv() == (TEXT, b"one message")
    finally:
        raw.close()


# ----------------------------------------------------------------------------- the handshake


def test_an_upgrade_refused_by_on_connect_is_its_http_response(server):
    with pytest.raises(InvalidStatus) as refused:
        ws(server, "/?refuse=1")
    response = refused.value.response
    assert response.status_code == 403
    assert response.body.replace(b" ", b"") == b'{"error":"refused"}'
    assert "upgrade" not in {name.lower() for name in response.headers}


def test_an_on_connect_that_raises_is_a_500_and_logged_tagged(server):
    with pytest.raises(InvalidStatus) as refused:
        ws(server, "/?boom=1", additional_headers={"x-request-id": "ws-connect-boom"})
    assert refused.value.response.status_code == 500
    assert b"connect failed" not in refused.value.response.body  # not a preview: no detail
    wait_for(
        lambda: any(
            line.startswith("[request_id=ws-connect-boom ") and "connect failed" in line
            for line in server.stderr.splitlines()
        ),
        "the exception in the log, tagged",
    )


def test_the_subprotocol_on_connect_chooses_is_answered(server):
    with ws(server, "/?protocol=chat.v2", subprotocols=["chat.v1", "chat.v2"]) as client:
        assert client.subprotocol == "chat.v2"
        client.send("still echoes")
        assert client.recv(timeout=10) == "still echoes"


def test_a_bad_handshake_is_answered_in_http(server):
    headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
    no_key = httpx.get(f"{server.url}/", headers=headers)
    assert no_key.status_code == 400
    old = httpx.get(
        f"{server.url}/",
        headers=headers | {"Sec-WebSocket-Version": "8", "Sec-WebSocket-Key": "a" * 22 + "=="},
    )
    assert old.status_code == 426
    assert old.headers["sec-websocket-version"] == "13"


def test_with_a_replica_key_an_upgrade_without_it_is_refused(own_server):
    key = "only-the-proxy-knows"
    srv = own_server(SLESS_REPLICA_KEY=key)
    with pytest.raises(InvalidStatus) as refused:
        ws(srv)
    assert refused.value.response.status_code == 403
    with ws(srv, additional_headers={"X-Sless-Replica": key}) as client:
        client.send("through the proxy")
        assert client.recv(timeout=10) == "through the proxy"


def test_without_sless_websocket_an_upgrade_is_an_ordinary_call(runtime, log_dir):
    srv = Server(runtime, log_dir, "handlers.main").wait_healthy()
    try:
        response = httpx.get(
            f"{srv.url}/plain",
            headers={
                "Upgrade": "websocket",
                "Connection": "Upgrade",
                "Sec-WebSocket-Version": "13",
                "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
            },
        )
    finally:
        srv.stop()
    assert response.status_code == 200
    event = response.json()  # handlers.main answers with the event it was given
    assert event["_path"] == "/plain" and event["_headers"]["upgrade"] == "websocket"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SLESS_WS_ON_CONNECT", "no_such_hook"),
        ("SLESS_WS_ON_DISCONNECT", "no_such_hook"),
        ("SLESS_WS_MAX_MESSAGE_BYTES", "lots"),
        ("SLESS_STREAM_DRAIN_SEC", "soon"),
    ],
)
def test_a_bad_websocket_setting_stops_the_start_and_names_it(runtime, name, value):
    started = subprocess.run(
        runtime.command("server"),
        env=_env(runtime, PORT="0", SLESS_ENTRYPOINT="sockets.handler", **(HOOKS | {name: value})),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert started.returncode == 1
    assert name in started.stderr and value in started.stderr, started.stderr


# ----------------------------------------------------------------------------- protocol errors


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        pytest.param([(TEXT, b"\xff\xfe not utf-8", {})], 1007, id="invalid-utf8"),
        pytest.param([(TEXT, b"unmasked", {"masked": False})], 1002, id="unmasked"),
        pytest.param([(CONTINUATION, b"orphan", {})], 1002, id="continuation-without-start"),
        pytest.param(
            [(TEXT, b"a", {"fin": False}), (BINARY, b"b", {})], 1002, id="new-message-mid-message"
        ),
        pytest.param([(PING, b"p" * 126, {})], 1002, id="ping-over-125-bytes"),
        pytest.param([(TEXT, b"x", {"length": 100 * LIMIT})], 1009, id="frame-over-the-limit"),
        pytest.param(
            [(TEXT, b"a" * 600, {"fin": False}), (CONTINUATION, b"b" * 600, {})],
            1009,
            id="message-over-the-limit",
        ),
    ],
)
def test_a_protocol_violation_closes_the_socket_with_its_code(server, frames, code):
    raw = Raw(server)
    try:
        for opcode, payload, options in frames:
            # frame-over-the-limit: the header declares 100 KiB, 1 byte follows; a server
            # that read the payload before deciding would wait here until the timeout
            raw.send(opcode, payload, **options)
        assert raw.recv_close()[0] == code
    finally:
        raw.close()


# ----------------------------------------------------------------------------- closing


def test_a_client_close_is_echoed_with_its_code(server, tmp_path):
    log = tmp_path / "disconnect.log"
    with ws(server, f"/?log={log}", additional_headers={"x-request-id": "ws-close-1"}) as client:
        client.send("hi")
        assert client.recv(timeout=10) == "hi"
        client.close(4000, "done")
        echoed = client.protocol.close_rcvd
    assert echoed is not None and echoed.code == 4000
    wait_for(lambda: inflight(server) == 0, "the socket to be done")
    assert disconnect_lines(log) == ["disconnect 4000 ws-close-1"]  # exactly once


def test_a_handler_closing_the_socket_gives_its_code_and_reason(server, tmp_path):
    log = tmp_path / "disconnect.log"
    with ws(server, f"/?log={log}", additional_headers={"x-request-id": "ws-close-2"}) as client:
        client.send("close:4001:bye")
        assert closed_by_server(client) == (4001, "bye")
    wait_for(lambda: inflight(server) == 0, "the socket to be done")
    assert disconnect_lines(log) == ["disconnect 4001 ws-close-2"]


def test_a_ping_after_the_servers_close_does_not_cut_the_handshake(server, tmp_path):
    # no pong is due once the close is sent; the peer's close still is, and its code
    log = tmp_path / "disconnects.log"
    raw = Raw(server, f"/?log={log}")
    raw.send(TEXT, b"close:4001:bye")
    assert raw.recv_close() == (4001, "bye")
    raw.send(PING, b"late")
    raw.send(CLOSE, (4001).to_bytes(2, "big"))
    wait_for(lambda: disconnect_lines(log), "onDisconnect")
    assert disconnect_lines(log)[0].startswith("disconnect 4001 ")
    raw.close()


def test_a_client_that_vanishes_is_disconnected_with_1006(server, tmp_path):
    log = tmp_path / "disconnect.log"
    raw = Raw(server, f"/?log={log}")
    raw.send(TEXT, b"hello")
    assert raw.recv() == (TEXT, b"hello")
    raw.close()  # no close frame: the TCP connection just ends
    lines = wait_for(lambda: disconnect_lines(log), "onDisconnect")
    assert len(lines) == 1 and lines[0].startswith("disconnect 1006 ")
    wait_for(lambda: inflight(server) == 0, "the socket to be done")
    assert len(disconnect_lines(log)) == 1


def test_a_handler_that_raises_closes_with_1011_and_is_logged(server):
    with ws(server, additional_headers={"x-request-id": "ws-boom-1"}) as client:
        client.send("boom")
        assert closed_by_server(client)[0] == 1011
    wait_for(
        lambda: any(
            line.startswith("[request_id=ws-boom-1 ") and "message failed" in line
            for line in server.stderr.splitlines()
        ),
        "the traceback, tagged",
    )


def test_a_handler_past_the_timeout_closes_with_1011_and_is_logged(server):
    with ws(server, additional_headers={"x-request-id": "ws-slow-1"}) as client:
        client.send("sleep:3")  # SLESS_TIMEOUT_SEC=1
        assert closed_by_server(client)[0] == 1011
    line = "[sless] the message handler ran past timeoutSec (1s); the socket is closed"
    wait_for(
        lambda: any(
            line in said and said.startswith("[request_id=ws-slow-1 ")
            for said in server.stderr.splitlines()
        ),
        "the timeout's line",
    )


def test_an_open_socket_is_a_call_in_flight_until_it_ends(server):
    wait_for(lambda: inflight(server) == 0, "the other tests' sockets to be done")
    with ws(server) as client:
        client.send("x")
        assert client.recv(timeout=10) == "x"
        assert inflight(server) == 1
    wait_for(lambda: inflight(server) == 0, "no call in flight")


# ----------------------------------------------------------------------------- limits


def test_a_client_that_answers_pings_is_not_idle(own_server):
    srv = own_server(SLESS_STREAM_IDLE_SEC="1", SLESS_STREAM_HEARTBEAT_SEC="0.3")
    with ws(srv) as client:
        # it sends nothing for twice idleSec; the runtime's pings, answered, keep it open
        with pytest.raises(TimeoutError):
            client.recv(timeout=2.5)
        client.send("still here")
        assert client.recv(timeout=10) == "still here"


def test_a_client_that_does_not_answer_pings_is_closed_as_idle(own_server):
    srv = own_server(SLESS_STREAM_IDLE_SEC="1", SLESS_STREAM_HEARTBEAT_SEC="0.3")
    raw = Raw(srv)
    try:
        opcode, _ = raw.recv()
        assert opcode == PING  # quiet for heartbeatSec: the runtime asks
        assert raw.recv_close() == (1001, "idle")
    finally:
        raw.close()
    wait_for(
        lambda: (
            "[sless] the socket received nothing for 1s (stream.idleSec); it is closed"
            in srv.stderr
        ),
        "the idle line",
    )


def test_a_socket_open_for_max_sec_is_closed(own_server):
    srv = own_server(SLESS_STREAM_MAX_SEC="1")
    with ws(srv) as client:
        assert closed_by_server(client) == (1001, "maxSec")
    wait_for(
        lambda: "[sless] the socket was open for 1s (stream.maxSec); it is closed" in srv.stderr,
        "the maxSec line",
    )


def test_sigterm_closes_open_sockets_with_1001_after_the_drain_and_exits_0(own_server, tmp_path):
    srv = own_server(SLESS_STREAM_DRAIN_SEC="1")
    log = tmp_path / "disconnect.log"
    with ws(srv, f"/?log={log}") as client:
        client.send("before")
        assert client.recv(timeout=10) == "before"
        srv.proc.terminate()
        assert closed_by_server(client)[0] == 1001
    assert srv.proc.wait(timeout=30) == 0
    lines = disconnect_lines(log)
    assert len(lines) == 1 and lines[0].startswith("disconnect 1001 ")


def test_sigterm_gives_an_open_stream_the_drain_time_not_the_call_timeout(runtime, log_dir):
    """Streamed HTTP responses share the drain: 60 more ticks (3 s) after SIGTERM outlive
    the call timeout's drain (1 s + 1 s) by far."""
    srv = Server(
        runtime, log_dir, "streams.handler", SLESS_TIMEOUT_SEC="1", SLESS_STREAM_DRAIN_SEC="60"
    ).wait_healthy()
    try:
        with httpx.stream("GET", f"{srv.url}/counting") as response:
            lines = response.iter_lines()
            assert next(lines) == "tick 0"
            srv.proc.terminate()
            ticks = [next(lines) for _ in range(60)]
            assert ticks[-1].startswith("tick ")
        # the client went away: the stream ended, nothing is left to wait for
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()
