"""WebSocket upgrades through ``/fn/`` (gitops_sless.proxy.tunnel), over real sockets.

The proxy runs as ``serve`` runs it (uvicorn with the fast path); the replicas are
small servers written here that answer the upgrade and then echo raw bytes, so what
the proxy does to the bytes shows: nothing. (The runtimes' own RFC 6455 side is
tests/test_runtime_websockets.py; both together through ``serve`` are
tests/test_websockets_served.py.)
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

import pytest

from gitops_sless.manifests.model import Scale
from gitops_sless.proxy import tunnel
from gitops_sless.state.routes import Route

from . import test_proxy
from .test_proxy import Fake, ProxyServer, _read_head

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
KEY = base64.b64encode(b"0123456789abcdef")
ACCEPT = base64.b64encode(hashlib.sha1(KEY + GUID).digest())


class TunnelProxy(ProxyServer):
    # the image has no WebSocket library for uvicorn (websockets is a test extra): the
    # tunnel must not depend on uvicorn's own WebSocket support either way
    MODES: ClassVar[dict[str, dict[str, str]]] = {"fast": {}, "fast-without-ws": {"ws": "none"}}


@pytest.fixture(scope="module", params=list(TunnelProxy.MODES))
def proxy(request: pytest.FixtureRequest) -> Iterator[ProxyServer]:
    server = TunnelProxy(request.param)
    yield server
    server.stop()


fakes = test_proxy.fakes  # the small upstream servers, on a loop of their own


_names = iter(range(1_000_000))


@pytest.fixture
def route(proxy: ProxyServer) -> Iterator[Callable[..., str]]:
    added: list[str] = []

    def add(*upstreams: tuple[str, int], **fields) -> str:
        name = f"ws-{next(_names)}"
        fields = {"websocket": True, **fields}
        proxy.routes.set(Route("prod", name, fields.pop("timeout", 5), tuple(upstreams), **fields))
        added.append(name)
        return name

    yield add
    for name in added:
        proxy.routes.remove("prod", name)


async def echo(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers the upgrade, then sends back every byte it gets."""
    await _read_head(fake, reader)
    writer.write(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Accept: " + ACCEPT + b"\r\n\r\nhello"
    )
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    fake.eofs += 1


async def refuse(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Refuses the upgrade as onConnect would, and keeps the connection (keep-alive)."""
    await _read_head(fake, reader)
    body = b'{"error": "refused"}'
    writer.write(
        b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    await writer.drain()
    await reader.read(65536)


async def mute(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_head(fake, reader)
    await reader.read(65536)


_opened: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def upgrade(proxy: ProxyServer, name: str, extra: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    _opened.append(sock)
    sock.sendall(
        b"GET /fn/prod/" + name.encode() + b"/chat?room=1 HTTP/1.1\r\nHost: example.test\r\n"
        b"Upgrade: websocket\r\nConnection: keep-alive, Upgrade\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + KEY + b"\r\n\r\n" + extra
    )
    return sock


def read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    got = b""
    while b"\r\n\r\n" not in got:
        data = sock.recv(65536)
        assert data, f"closed before a head: {got!r}"
        got += data
    head, _, rest = got.partition(b"\r\n\r\n")
    return head, rest


def read_exactly(sock: socket.socket, count: int, got: bytes = b"") -> bytes:
    while len(got) < count:
        data = sock.recv(65536)
        assert data, f"closed after {len(got)} of {count} bytes"
        got += data
    return got


def read_to_end(sock: socket.socket) -> bytes:
    got = b""
    while data := sock.recv(65536):
        got += data
    return got


def wait_for(check: Callable[[], object], what: str, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_the_upgrade_reaches_the_replica_and_bytes_flow_both_ways_untouched(proxy, route, fakes):
    fake = fakes.start(echo)
    name = route(("127.0.0.1", fake.port))
    sock = upgrade(proxy, name, extra=b"early")  # sent before the 101: kept, then delivered
    head, rest = read_head(sock)
    assert head.startswith(b"HTTP/1.1 101 ")
    lines = head.lower().split(b"\r\n")
    assert b"upgrade: websocket" in lines and b"connection: upgrade" in lines
    assert b"sec-websocket-accept: " + ACCEPT.lower() in lines
    assert any(line.startswith(b"x-request-id: ") for line in lines)
    # what the replica sent with its head, then the echo of what the client sent early
    assert read_exactly(sock, len(b"helloearly"), rest) == b"helloearly"
    payload = bytes(range(256)) * 4096  # 1 MiB: more than the socket buffers hold
    sock.sendall(payload)
    assert read_exactly(sock, len(payload)) == payload
    sent = fake.requests[0].lower()
    assert sent.startswith(b"get /chat?room=1 http/1.1\r\n")
    assert b"\r\nupgrade: websocket\r\n" in sent and b"\r\nconnection: upgrade\r\n" in sent
    assert b"\r\nsec-websocket-key: " + KEY.lower() + b"\r\n" in sent
    assert b"\r\nx-forwarded-prefix: /fn/prod/" + name.encode() + b"\r\n" in sent
    sock.close()
    wait_for(lambda: fake.eofs == 1, "the replica to see the client leave")


def test_a_socket_is_one_call_in_flight_until_it_closes_and_is_recorded_once(proxy, route, fakes):
    fake = fakes.start(echo)
    name = route(("127.0.0.1", fake.port), concurrency=4)  # counted: its load is kept
    sock = upgrade(proxy, name)
    read_head(sock)
    load = proxy.routes.get("prod", name).load
    assert load.inflight == 1
    time.sleep(0.2)  # open a while: its duration shows it
    sock.close()
    wait_for(lambda: load.inflight == 0, "the socket to leave the load")
    records = [r for r in proxy.records if r.name == name]
    assert len(records) == 1
    assert records[0].status == 101 and records[0].duration_ms >= 200


def test_the_replica_closing_closes_the_client(proxy, route, fakes):
    async def bye(fake, reader, writer):
        await _read_head(fake, reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\n\r\nbye"
        )
        await writer.drain()

    fake = fakes.start(bye)
    sock = upgrade(proxy, route(("127.0.0.1", fake.port)))
    head, rest = read_head(sock)
    assert head.startswith(b"HTTP/1.1 101 ")
    assert rest + read_to_end(sock) == b"bye"


def test_a_refusal_reaches_the_client_whole_and_the_connection_closes(proxy, route, fakes):
    fake = fakes.start(refuse)
    name = route(("127.0.0.1", fake.port))
    sock = upgrade(proxy, name)
    head, rest = read_head(sock)
    assert head.startswith(b"HTTP/1.1 403 ")
    assert b"connection: close" in head.lower().split(b"\r\n")
    assert rest + read_to_end(sock) == b'{"error": "refused"}'  # then closed, not kept
    wait_for(lambda: any(r.name == name and r.status == 403 for r in proxy.records), "record")


def test_a_function_without_a_websocket_trigger_refuses_the_upgrade_and_calls_nothing(
    proxy, route, fakes
):
    fake = fakes.start(echo)
    name = route(("127.0.0.1", fake.port), websocket=False)
    sock = upgrade(proxy, name)
    head, rest = read_head(sock)
    assert head.startswith(b"HTTP/1.1 404 ")
    assert b"function has no websocket trigger" in rest + read_to_end(sock)
    assert fake.accepted == 0


def test_a_replica_that_never_answers_the_upgrade_is_504_at_the_timeout(proxy, route, fakes):
    fake = fakes.start(mute)
    sock = upgrade(proxy, route(("127.0.0.1", fake.port), timeout=0.5))
    head, rest = read_head(sock)
    assert head.startswith(b"HTTP/1.1 504 ")
    assert b"did not answer within 0.5s" in rest + read_to_end(sock)


def test_a_replica_that_cannot_be_reached_is_502(proxy, route):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    sock = upgrade(proxy, route(("127.0.0.1", port)))
    head, rest = read_head(sock)
    assert head.startswith(b"HTTP/1.1 502 ")
    assert b"cannot connect" in rest + read_to_end(sock)


def test_an_upgrade_to_a_function_at_zero_waits_for_its_start(proxy, fakes):
    fake = fakes.start(echo)
    name = f"ws-{next(_names)}"
    proxy.routes.set(Route("prod", name, 5, (), websocket=True, scale=Scale(0, 1)))
    started: list[str] = []

    def wake(env: str, fn: str) -> None:  # what a backend does: a replica, then its route
        started.append(fn)
        proxy.routes.set(
            Route("prod", name, 5, (("127.0.0.1", fake.port),), websocket=True, scale=Scale(0, 1))
        )

    proxy.app.activator.wake = wake
    try:
        sock = upgrade(proxy, name)
        head, rest = read_head(sock)
        assert head.startswith(b"HTTP/1.1 101 ")
        assert started == [name]
        sock.sendall(b"ping")
        assert read_exactly(sock, len(b"helloping"), rest) == b"helloping"
        sock.close()
    finally:
        proxy.routes.remove("prod", name)


def test_a_plain_call_to_a_function_with_only_a_websocket_trigger_is_404(proxy, route, fakes):
    fake = fakes.start(echo)
    name = route(("127.0.0.1", fake.port), plain=False)
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    assert reply.status == 404
    assert reply.json()["error"] == "function has no http trigger (a websocket trigger only)"
    assert fake.accepted == 0
    sock = upgrade(proxy, name)  # its sockets are served
    assert read_head(sock)[0].startswith(b"HTTP/1.1 101 ")


def test_an_upgrade_pipelined_behind_a_call_never_overtakes_its_answer(proxy, route, fakes):
    async def slow(fake, reader, writer):  # answers a plain call late
        await _read_head(fake, reader)
        await asyncio.sleep(0.3)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nslow")
        await writer.drain()
        await reader.read(65536)

    fake = fakes.start(slow)
    name = route(("127.0.0.1", fake.port))
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    _opened.append(sock)
    sock.sendall(
        b"GET /fn/prod/" + name.encode() + b"/ HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /fn/prod/" + name.encode() + b"/ HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: "
        + KEY
        + b"\r\n\r\n"
    )
    head, rest = read_head(sock)
    assert head.startswith(b"HTTP/1.1 200 "), head  # the call's answer comes first, whole
    assert read_exactly(sock, 4, rest)[:4] == b"slow"


def test_bytes_sent_before_the_101_are_held_back_not_buffered_without_bound(proxy, route, fakes):
    fake = fakes.start(mute)  # never answers the upgrade
    sock = upgrade(proxy, route(("127.0.0.1", fake.port), timeout=3))
    sock.setblocking(False)
    sent = 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until the proxy stops reading: writes would block
        try:
            sent += sock.send(b"x" * 65536)
        except BlockingIOError:
            time.sleep(0.2)
            try:
                sent += sock.send(b"x" * 65536)
            except BlockingIOError:
                break
    # what the kernel's buffers and the proxy's 64 KiB hold: far from the 5 s of loopback
    assert sent < 32 * 1024 * 1024, sent


def test_an_upgrade_to_a_websocket_function_not_ready_is_503_not_404(proxy, route):
    name = route(plain=False)  # a websocket trigger only, no replica ready
    sock = upgrade(proxy, name)
    head, _ = read_head(sock)
    assert head.startswith(b"HTTP/1.1 503 "), head


def test_a_client_that_stops_reading_is_cut_and_its_call_ends(proxy, route, fakes, monkeypatch):
    monkeypatch.setattr(tunnel, "STALL_SEC", 0.5)

    async def flood(fake, reader, writer):  # answers, then writes without end
        await _read_head(fake, reader)
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
        )
        while True:
            writer.write(b"x" * 65536)
            await writer.drain()

    fake = fakes.start(flood)
    name = route(("127.0.0.1", fake.port), concurrency=4)
    sock = upgrade(proxy, name)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    read_head(sock)  # and then nothing more is read
    load = proxy.routes.get("prod", name).load
    wait_for(lambda: load.inflight == 0, "the stalled socket to be cut", 10)
    assert any(r.name == name and r.status == 101 for r in proxy.records)
