"""The invoke proxy in front of real upstreams, over real loopback sockets.

The proxy runs in uvicorn in a background thread, three ways: ``fast`` (what
``proxy.config`` gives: ``/fn/`` served from uvicorn's protocol callbacks),
``asgi`` (uvicorn with uvloop/httptools calling ProxyApp as a plain ASGI app) and
``h11`` (uvicorn's pure-Python server on the asyncio loop). Every test runs
against each. Upstreams are a real python3.11 runtime server with the handler
in tests/data/proxy_fns/, and, for misbehaving cases, small socket servers
written here.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import uvicorn

from gitops_sless.metrics import METRICS
from gitops_sless.proxy import Invocation, Limits, ProxyApp, config
from gitops_sless.proxy.http import SANDBOX_CSP, Peer, Withheld, peer_of, request_head
from gitops_sless.proxy.upstream import CLOSED_EARLY
from gitops_sless.state.routes import Declared, Route, RouteTable

from ..paths import DATA, ROOT

SERVER = ROOT / "runtimes" / "python3.11" / "server.py"
FUNCTIONS = DATA / "proxy_fns"
MAX_BODY = 64 * 1024
HEX_ID = re.compile(r"[0-9a-f]{32}")
SANDBOX = SANDBOX_CSP.decode()


# --------------------------------------------------------------------------- plumbing


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_runtime(port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    env.update(
        PORT=str(port),
        SLESS_HOST="127.0.0.1",
        SLESS_ENTRYPOINT="echo.main",
        SLESS_FUNCTION_DIR=str(FUNCTIONS),
        SLESS_TIMEOUT_SEC="10",
    )
    proc = subprocess.Popen([sys.executable, str(SERVER)], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if sock.recv(100).startswith(b"HTTP/1.1 200"):
                    return proc
        except OSError:
            time.sleep(0.02)
    proc.kill()
    _, err = proc.communicate()
    raise RuntimeError(f"runtime server did not start: {err.decode()}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def _read_reply(sock: socket.socket, method: str = "GET") -> Reply:
    response = http.client.HTTPResponse(sock, method=method)
    try:
        response.begin()
        return Reply(response.status, response.headers, response.read())
    finally:
        response.close()


def raw(port: int, data: bytes, method: str = "GET") -> Reply:
    """Send ``data`` as it is (no client-side normalisation) and read one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        return _read_reply(sock, method)


class ProxyServer:
    """A ProxyApp in uvicorn, in a thread, on a free loopback port."""

    MODES: ClassVar[dict[str, dict[str, str]]] = {
        "fast": {},
        "asgi": {"http": "httptools"},
        "h11": {"http": "h11", "loop": "asyncio"},
    }

    def __init__(
        self,
        mode: str,
        front: Callable | None = None,
        trusted: tuple[str, ...] = (),
        limits: Limits | None = None,
        wake: Callable[[str, str], None] | None = None,
    ) -> None:
        """``front(proxy) -> app``: an ASGI app that hands /fn/ to the proxy (default: none);
        ``wake``: the proxy's way to start a function at zero (see proxy.activator)."""
        self.mode = mode
        self.routes = RouteTable()
        self.records: list[Invocation] = []
        self.app = ProxyApp(
            self.routes,
            self.records.append,
            max_body_bytes=MAX_BODY,
            trusted_proxies=trusted,
            wake=wake,
        )
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on sockets that say so,
        # and without it h11's two writes per response meet the client's delayed ACK.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        app = self.app if front is None else front(self.app)
        settings = config(
            app, "127.0.0.1", self.port, proxy=self.app, limits=limits, **self.MODES[mode]
        )
        self.server = uvicorn.Server(settings)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return Reply(response.status, response.headers, response.read())
        finally:
            conn.close()

    def recorded(self, reply: Reply) -> Invocation:
        """The one invocation recorded for ``reply`` (matched by its request id)."""
        request_id = reply.headers["x-request-id"]
        deadline = time.monotonic() + 2
        while True:  # recorded as the response goes out: allow the server thread a moment
            found = [r for r in self.records if r.request_id == request_id]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        assert len(found) == 1, f"{len(found)} invocations recorded for {request_id}"
        assert found[0].status == reply.status
        return found[0]

    def not_recorded(self, reply: Reply, unknown_before: float) -> None:
        """``reply`` was a call to an undeclared name: counted as unknown, never recorded."""
        _wait_for(lambda: _unknown_total() > unknown_before)  # finish() has run for it
        request_id = reply.headers["x-request-id"]
        assert not [r for r in self.records if r.request_id == request_id]


def _unknown_total() -> float:
    return METRICS.proxy_unknown.values.get((), 0)


@dataclass
class Fake:
    """A misbehaving upstream: its port, what it was sent, how its connections ended."""

    port: int
    requests: list[bytes] = field(default_factory=list)
    accepted: int = 0
    eofs: int = 0


Handler = Callable[[Fake, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Fakes:
    """Small upstream servers on loopback, all on one asyncio loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever)
        self.thread.start()
        self.servers: list[asyncio.Server] = []
        self.writers: set[asyncio.StreamWriter] = set()

    def start(self, handler: Handler) -> Fake:
        fake = Fake(0)

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            fake.accepted += 1
            self.writers.add(writer)
            try:
                await handler(fake, reader, writer)
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                self.writers.discard(writer)
                writer.close()

        async def listen() -> asyncio.Server:
            return await asyncio.start_server(serve, "127.0.0.1", 0)

        server = asyncio.run_coroutine_threadsafe(listen(), self.loop).result()
        self.servers.append(server)
        fake.port = server.sockets[0].getsockname()[1]
        return fake

    def close(self) -> None:
        async def shutdown() -> None:
            for server in self.servers:
                server.close()
            for writer in list(self.writers):
                writer.close()
            await asyncio.sleep(0.05)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _read_head(fake: Fake, reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    fake.requests.append(head)
    return head


async def silent(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads everything, answers nothing; counts the connections the proxy drops."""
    while await reader.read(65536):
        pass
    fake.eofs += 1


async def closer(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads a request head and hangs up."""
    await _read_head(fake, reader)


async def hop(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers with every hop-by-hop header, and the request head it got as the body."""
    head = await _read_head(fake, reader)
    writer.write(
        b"HTTP/1.1 200 OK\r\n"
        b"Connection: close, X-Hop\r\nX-Hop: secret\r\nKeep-Alive: timeout=5\r\n"
        b"Proxy-Connection: keep-alive\r\nProxy-Authenticate: Basic\r\nTrailer: X-Sum\r\n"
        b"Upgrade: h2c\r\nTE: trailers\r\nX-End: kept\r\nContent-Type: text/plain\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        b"%x\r\n%b\r\n0\r\n\r\n" % (len(head), head)
    )
    await writer.drain()


def streamer(release: threading.Event) -> Handler:
    """Sends a chunked response whose last chunk waits for ``release``."""

    async def handler(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await _read_head(fake, reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, release.wait, 10)
        writer.write(b"4\r\nlast\r\n0\r\n\r\n")
        await writer.drain()

    return handler


async def drip(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Starts a chunked response, then sends nothing more until the proxy hangs up."""
    await _read_head(fake, reader)
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
    await writer.drain()
    while await reader.read(65536):
        pass
    fake.eofs += 1


BIG = bytes(range(256)) * (8 * 4096)  # 8 MiB: more than the socket buffers hold


async def big(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_head(fake, reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BIG))
    for i in range(0, len(BIG), 65536):
        writer.write(BIG[i : i + 65536])
        await writer.drain()


def answer(response: bytes) -> Handler:
    """Reads a request head, writes ``response`` as it is, hangs up."""

    async def handler(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await _read_head(fake, reader)
        writer.write(response)
        await writer.drain()

    return handler


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runtime() -> Iterator[tuple[str, int]]:
    port = _free_port()
    proc = _start_runtime(port)
    yield ("127.0.0.1", port)
    _stop(proc)


@pytest.fixture(scope="module")
def fakes() -> Iterator[Fakes]:
    fakes = Fakes()
    yield fakes
    fakes.close()


@pytest.fixture(scope="module", params=list(ProxyServer.MODES))
def proxy(request: pytest.FixtureRequest) -> Iterator[ProxyServer]:
    server = ProxyServer(request.param)
    yield server
    server.stop()


_names = iter(range(1_000_000))


@pytest.fixture
def route(proxy: ProxyServer) -> Iterator[Callable[..., str]]:
    """``route(*upstreams, timeout=5, env="prod") -> name``: a function only this test uses."""
    added: list[tuple[str, str]] = []

    def add(*upstreams: tuple[str, int], timeout: float = 5, env: str = "prod") -> str:
        name = f"fn-{next(_names)}"
        proxy.routes.set(Route(env, name, timeout, tuple(upstreams)))
        added.append((env, name))
        return name

    yield add
    for env, name in added:
        proxy.routes.remove(env, name)


def _assert_json_error(reply: Reply, status: int, env: str, name: str) -> dict:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["x-request-id"]
    body = reply.json()
    assert body["function"] == name and body["env"] == env and body["error"]
    return body


# --------------------------------------------------------------------------- forwarding


def test_json_body_path_and_query_reach_the_handler(proxy, route, runtime):
    name = route(runtime)
    reply = proxy.request(
        "POST", f"/fn/prod/{name}/add?title=x", json.dumps({"a": 1}).encode(), {"X-Custom": "yes"}
    )
    assert reply.status == 200, reply.body
    event = reply.json()["event"]
    assert event["a"] == 1
    assert event["_path"] == "/add"
    assert event["_query"] == {"title": "x"}
    assert event["_method"] == "POST"
    assert event["_headers"]["x-custom"] == "yes"
    record = proxy.recorded(reply)
    assert (record.env, record.name, record.method, record.path) == (
        "prod",
        name,
        "POST",
        "/add?title=x",
    )
    assert record.duration_ms > 0 and abs(record.time - time.time()) < 10


@pytest.mark.parametrize("suffix", ["", "/"], ids=["no-slash", "slash"])
def test_no_sub_path_is_root(proxy, route, runtime, suffix):
    name = route(runtime)
    reply = proxy.request("GET", f"/fn/prod/{name}{suffix}")
    assert reply.status == 200
    assert reply.json()["event"]["_path"] == "/"
    assert proxy.recorded(reply).path == "/"


def test_sub_path_keeps_its_percent_encoding(proxy, route, fakes):
    fake = fakes.start(hop)
    name = route(("127.0.0.1", fake.port))
    reply = raw(
        proxy.port, f"GET /fn/prod/{name}/a%2Fb/c%20d?q=%2F&r HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    )
    assert reply.status == 200
    assert fake.requests[0].startswith(b"GET /a%2Fb/c%20d?q=%2F&r HTTP/1.1\r\n")


def test_chunked_request_body_is_streamed_to_the_handler(proxy, route, runtime):
    name = route(runtime)
    parts = [b'{"numbers": [', b"1, 2, ", b"3]}"]
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        conn.request("POST", f"/fn/prod/{name}/sum", body=iter(parts), encode_chunked=True)
        response = conn.getresponse()
        reply = Reply(response.status, response.headers, response.read())
    finally:
        conn.close()
    assert reply.status == 200, reply.body
    assert reply.json()["event"]["numbers"] == [1, 2, 3]
    proxy.recorded(reply)


def test_head_request(proxy, route, runtime):
    name = route(runtime)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        conn.request("HEAD", f"/fn/prod/{name}/")
        head = conn.getresponse()
        assert head.status == 200 and head.read() == b""
        assert int(head.headers["content-length"]) > 0
        conn.request("GET", f"/fn/prod/{name}/again")  # the connection is still usable
        again = conn.getresponse()
        assert json.loads(again.read())["event"]["_path"] == "/again"
    finally:
        conn.close()


# --------------------------------------------------------------------------- errors


CRAFTED = [
    pytest.param("/fn/prod/..%2f..", id="encoded-slash"),
    pytest.param("/fn/prod/%2e%2e/admin", id="encoded-dots"),
    pytest.param("/fn/prod/a/../../x", id="dot-segments"),
    pytest.param("/fn/PROD/x", id="upper-case-env"),
    pytest.param("/fn/prod", id="no-name"),
    pytest.param("/fn/prod/", id="empty-name"),
    pytest.param("/fn//prod/x", id="empty-env"),
    pytest.param("/fn/prod/x%00", id="nul"),
    pytest.param("/fn/prod/-x/", id="leading-dash"),
]


@pytest.mark.parametrize("path", CRAFTED)
def test_unknown_or_crafted_path_is_404_and_reaches_nothing(proxy, fakes, path):
    fake = fakes.start(hop)
    for name in ("x", "admin", "a-x"):  # what a lenient parser might turn these paths into
        proxy.routes.set(Route("prod", name, 5, (("127.0.0.1", fake.port),)))
    unknown = _unknown_total()
    try:
        reply = raw(proxy.port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    finally:
        for name in ("x", "admin", "a-x"):
            proxy.routes.remove("prod", name)
    assert reply.status == 404, reply.body
    assert reply.headers["content-type"] == "application/json"
    assert reply.json()["error"] == "function not found"
    assert fake.accepted == 0
    proxy.not_recorded(reply, unknown)


def test_unknown_function_is_404_counted_but_not_recorded(proxy):
    unknown = _unknown_total()
    reply = proxy.request("GET", "/fn/prod/no-such-function/x", headers={"X-Request-Id": "r-404"})
    body = _assert_json_error(reply, 404, "prod", "no-such-function")
    assert "phase" not in body
    assert reply.headers["x-request-id"] == "r-404"
    proxy.not_recorded(reply, unknown)
    labels = {dict(key).get("name") for key in METRICS.invocations.values}
    assert "no-such-function" not in labels


@pytest.fixture
def declare(proxy: ProxyServer) -> Iterator[Callable[..., None]]:
    """``declare(name, phase, message=None)``: what the reconciler publishes, for this test."""
    declared: dict[str, Declared] = {}

    def add(name: str, phase: str, message: str | None = None) -> None:
        declared[name] = Declared(phase, message)
        proxy.routes.declare("decl", dict(declared))

    yield add
    proxy.routes.declare("decl", {})


@pytest.mark.parametrize(
    ("phase", "message", "error"),
    [
        ("Building", "building python3.11", "function not ready"),
        ("Failed", "pip install failed: no such package", "function not ready"),
        ("Pending", None, "function not ready"),
        ("Disabled", "disabled in sless.yaml", "function disabled"),
    ],
)
def test_declared_function_without_a_route_is_503_with_its_phase(
    proxy, declare, phase, message, error
):
    name = f"fn-{next(_names)}"
    declare(name, phase, message)
    counts = METRICS.invocations.values
    key = (("env", "decl"), ("name", name), ("status", "503"))
    reply = proxy.request("POST", f"/fn/decl/{name}/x?y=1", b"{}")
    body = _assert_json_error(reply, 503, "decl", name)
    assert (body["error"], body["phase"], body["message"]) == (error, phase, message)
    record = proxy.recorded(reply)
    assert (record.env, record.name, record.path) == ("decl", name, "/x?y=1")
    _wait_for(lambda: counts.get(key) == 1)


def test_route_without_upstreams_names_the_declared_phase(proxy, declare):
    name = f"fn-{next(_names)}"
    proxy.routes.set(Route("decl", name, 5, ()))
    try:
        declare(name, "Ready", "a replica ended: OOMKilled: over 128 MiB; restarting")
        reply = proxy.request("GET", f"/fn/decl/{name}/")
    finally:
        proxy.routes.remove("decl", name)
    body = _assert_json_error(reply, 503, "decl", name)
    assert body["phase"] == "Ready"
    assert body["message"] == "a replica ended: OOMKilled: over 128 MiB; restarting"
    proxy.recorded(reply)


def test_a_declaration_elsewhere_does_not_make_a_name_known(proxy, declare):
    name = f"fn-{next(_names)}"
    declare(name, "Building")
    unknown = _unknown_total()
    reply = proxy.request("GET", f"/fn/prod/{name}/")  # declared in "decl", not in "prod"
    _assert_json_error(reply, 404, "prod", name)
    proxy.not_recorded(reply, unknown)


def test_removed_route_is_404_at_once(proxy, route, runtime):
    name = route(runtime)
    assert proxy.request("GET", f"/fn/prod/{name}/").status == 200
    proxy.routes.remove("prod", name)
    _assert_json_error(proxy.request("GET", f"/fn/prod/{name}/"), 404, "prod", name)


def test_route_without_upstreams_is_503(proxy, route):
    name = route()
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    _assert_json_error(reply, 503, "prod", name)
    proxy.recorded(reply)


def test_connection_refused_is_502(proxy, route):
    name = route(("127.0.0.1", _free_port()))
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    _assert_json_error(reply, 502, "prod", name)
    proxy.recorded(reply)


def test_upstream_hanging_up_before_answering_is_502(proxy, route, fakes):
    fake = fakes.start(closer)
    name = route(("127.0.0.1", fake.port))
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    body = _assert_json_error(reply, 502, "prod", name)
    assert body["error"] == CLOSED_EARLY
    proxy.recorded(reply)


def killed(on_request: Callable[[], None]) -> Handler:
    """Reads a request head, runs ``on_request`` (the supervisor's reaction), hangs up."""

    async def handler(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await _read_head(fake, reader)
        on_request()

    return handler


def test_a_replica_killed_mid_call_names_the_reason(proxy, fakes):
    name = f"fn-{next(_names)}"
    reason = "OOMKilled: the replica used more than its 128 MiB"

    def supervisor_kills_it() -> None:  # publishes the route without it, and why it left
        proxy.routes.set(Route("prod", name, 5, (), last_exit=reason))

    fake = fakes.start(killed(supervisor_kills_it))
    proxy.routes.set(Route("prod", name, 5, (("127.0.0.1", fake.port),)))
    try:
        reply = proxy.request("POST", f"/fn/prod/{name}/", b'{"big": true}')
    finally:
        proxy.routes.remove("prod", name)
    body = _assert_json_error(reply, 502, "prod", name)
    assert body["error"] == f"{CLOSED_EARLY}: {reason}"
    assert proxy.recorded(reply).status == 502


def test_an_old_exit_reason_is_not_blamed_for_a_new_failure(proxy, fakes):
    name = f"fn-{next(_names)}"
    fake = fakes.start(closer)
    upstream = ("127.0.0.1", fake.port)
    proxy.routes.set(Route("prod", name, 5, (upstream,), last_exit="OOMKilled: an hour ago"))
    try:
        reply = proxy.request("GET", f"/fn/prod/{name}/")
    finally:
        proxy.routes.remove("prod", name)
    assert _assert_json_error(reply, 502, "prod", name)["error"] == CLOSED_EARLY


class _Dying(RouteTable):
    """The first lookup finds the replica; later ones find it gone, and why."""

    def __init__(self, live: Route, dead: Route) -> None:
        super().__init__()
        self.lookups = [live, dead]

    def get(self, env: str, name: str) -> Route | None:
        return self.lookups.pop(0) if len(self.lookups) > 1 else self.lookups[0]


def test_a_refused_connection_names_the_reason_too(proxy):
    upstream = ("127.0.0.1", _free_port())  # nothing listens: the replica has died
    live = Route("prod", "dying", 5, (upstream,))
    dead = Route("prod", "dying", 5, (), last_exit="exited with code 137 (SIGKILL)")
    routes, proxy.app.routes = proxy.app.routes, _Dying(live, dead)
    try:
        reply = proxy.request("GET", "/fn/prod/dying/")
    finally:
        proxy.app.routes = routes
    error = _assert_json_error(reply, 502, "prod", "dying")["error"]
    assert error.startswith("upstream unavailable: cannot connect to 127.0.0.1:")
    assert error.endswith(": exited with code 137 (SIGKILL)")


def test_no_answer_within_the_route_timeout_is_504(proxy, route, fakes):
    fake = fakes.start(silent)
    name = route(("127.0.0.1", fake.port), timeout=1)
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    # the route's own timeout ended it (the upstream never answers): the error names it
    error = _assert_json_error(reply, 504, "prod", name)["error"]
    assert error == "function did not answer within 1s"
    proxy.recorded(reply)
    _wait_for(lambda: fake.eofs == 1)  # the stuck upstream connection is not kept


def test_content_length_over_the_limit_is_413_before_the_upstream(proxy, route, fakes):
    fake = fakes.start(silent)
    name = route(("127.0.0.1", fake.port))
    head = f"POST /fn/prod/{name}/ HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n"
    reply = raw(proxy.port, head.encode() + b"\r\n")
    _assert_json_error(reply, 413, "prod", name)
    assert reply.headers["connection"] == "close"
    assert fake.accepted == 0
    proxy.recorded(reply)


def test_streamed_body_over_the_limit_is_413_and_drops_the_upstream(proxy, route, fakes):
    fake = fakes.start(silent)
    name = route(("127.0.0.1", fake.port))
    chunk = b"x" * 16384
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        head = f"POST /fn/prod/{name}/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        sock.sendall(head.encode() + b"\r\n")
        for _ in range(MAX_BODY // len(chunk) + 4):
            # Stop sending once the answer is there, so the proxy's close is a clean FIN.
            if select.select([sock], [], [], 0.05)[0]:
                break
            sock.sendall(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        reply = _read_reply(sock)
    _assert_json_error(reply, 413, "prod", name)
    proxy.recorded(reply)
    _wait_for(lambda: fake.eofs == 1)


# --------------------------------------------------------------------------- headers


def test_hop_by_hop_request_headers_are_stripped(proxy, route, runtime):
    name = route(runtime)
    hop_headers = {
        "Connection": "keep-alive, X-Secret",
        "X-Secret": "1",
        "Keep-Alive": "timeout=5",
        "Proxy-Connection": "keep-alive",
        "Proxy-Authorization": "Basic c2VjcmV0",
        "TE": "trailers",
        "Trailer": "X-Sum",
        "Upgrade": "h2c",
        "X-End": "kept",
    }
    reply = proxy.request("POST", f"/fn/prod/{name}/", b"{}", hop_headers)
    assert reply.status == 200, reply.body
    seen = reply.json()["event"]["_headers"]
    for header in hop_headers:
        if header != "X-End":
            assert header.lower() not in seen, header
    assert seen["x-end"] == "kept"
    assert seen["content-length"] == "2"
    assert "connection" not in reply.headers


def test_hop_by_hop_response_headers_are_stripped(proxy, route, fakes):
    fake = fakes.start(hop)
    name = route(("127.0.0.1", fake.port))
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    assert reply.status == 200
    for header in ("x-hop", "keep-alive", "proxy-connection", "proxy-authenticate", "trailer"):
        assert header not in reply.headers, header
    for header in ("upgrade", "te", "connection"):
        assert header not in reply.headers, header
    # The proxy frames the body itself: chunked again, since the upstream gave no length.
    assert reply.headers.get_all("transfer-encoding") == ["chunked"]
    assert reply.headers["x-end"] == "kept"
    assert reply.body == fake.requests[0]
    proxy.recorded(reply)


def test_the_servers_own_credentials_never_reach_a_function(proxy, route, runtime):
    """A handler reads the headers it gets, looking for the dashboard's session or a token."""
    name = route(runtime)
    proxy.app.withheld = Withheld(["the-api-token", "the-read-token", None])
    try:
        for given, cookie in [
            ("theme=dark; sless_session=1.nonce.sig; lang=en", "theme=dark; lang=en"),
            ("sless_session=1.nonce.sig", None),
            ("sless_session_x=1; a=2", "sless_session_x=1; a=2"),
        ]:
            for token in ("the-api-token", "the-read-token"):
                headers = {"Cookie": given, "Authorization": f"Bearer {token}"}
                seen = proxy.request("GET", f"/fn/prod/{name}/", None, headers).json()
                assert seen["event"]["_headers"].get("cookie") == cookie, given
                assert "authorization" not in seen["event"]["_headers"]
        for own in ("Bearer the-functions-own-key", "Basic dXNlcjpwYXNz", "Bearer the-api-tok"):
            headers = {"Authorization": own}
            seen = proxy.request("GET", f"/fn/prod/{name}/", None, headers).json()
            assert seen["event"]["_headers"]["authorization"] == own
    finally:
        proxy.app.withheld = Withheld()


def test_every_response_is_sandboxed_unless_the_function_is_same_origin(proxy, route, fakes):
    """A function's page runs in an opaque origin; its own policy is passed on beside ours."""
    response = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\n"
        b"content-security-policy: default-src *\r\ncontent-length: 2\r\n\r\nhi"
    )
    fake = fakes.start(answer(response))
    name = route(("127.0.0.1", fake.port))
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    assert reply.headers.get_all("content-security-policy") == ["default-src *", SANDBOX]
    error = proxy.request("GET", "/fn/prod/no-such-function/")
    assert error.headers.get_all("content-security-policy") == [SANDBOX]
    proxy.routes.set(Route("prod", name, 5, (("127.0.0.1", fake.port),), same_origin=True))
    opted_out = proxy.request("GET", f"/fn/prod/{name}/")
    assert opted_out.headers.get_all("content-security-policy") == ["default-src *"]


SPOOFED = (
    b"X-Forwarded-For: 203.0.113.7\r\n"
    b"X-Forwarded-Host: spoofed.example\r\n"
    b"X-Forwarded-Prefix: /spoofed\r\n"
    b"X-Forwarded-Proto: https\r\n"
    b"X-Forwarded-Port: 443\r\n"
    b"X-Forwarded-Server: spoofed\r\n"
    b"X-Real-IP: 203.0.113.8\r\n"
    b"Forwarded: for=203.0.113.9;proto=https\r\n"
    b"X-Forwarded-For: 198.51.100.1\r\n"
    b"Forwarded: for=198.51.100.2\r\n"
)


def _forwarded_seen(port: int, name: str) -> dict[str, list[str]]:
    """The forwarding headers the upstream got for a request carrying SPOOFED."""
    head = f"GET /fn/prod/{name}/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
    reply = raw(port, head + SPOOFED + b"\r\n")
    assert reply.status == 200, reply.body
    seen: dict[str, list[str]] = {}
    for line in reply.body.split(b"\r\n")[1:]:  # hop echoes the head it got
        key, _, value = line.decode().partition(": ")
        if "forward" in key.lower() or key.lower() == "x-real-ip":
            seen.setdefault(key.lower(), []).append(value)
    return seen


def test_forwarding_headers_from_the_client_are_replaced(proxy, route, fakes):
    fake = fakes.start(hop)
    name = route(("127.0.0.1", fake.port))
    assert _forwarded_seen(proxy.port, name) == {
        "x-forwarded-for": ["127.0.0.1"],
        "x-forwarded-host": [f"127.0.0.1:{proxy.port}"],
        "x-forwarded-proto": ["http"],
        "x-forwarded-prefix": [f"/fn/prod/{name}"],
        "forwarded": [f'for=127.0.0.1;proto=http;host="127.0.0.1:{proxy.port}"'],
    }


def test_forwarded_for_without_client_header(proxy, route, runtime):
    name = route(runtime)
    seen = proxy.request("GET", f"/fn/prod/{name}/").json()["event"]["_headers"]
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["forwarded"] == f'for=127.0.0.1;proto=http;host="127.0.0.1:{proxy.port}"'


@pytest.mark.parametrize("mode", list(ProxyServer.MODES))
def test_a_trusted_proxy_keeps_its_chain(fakes, mode):
    fake = fakes.start(hop)
    server = ProxyServer(mode, trusted=("10.0.0.0/8", "127.0.0.0/8"))
    try:
        server.routes.set(Route("prod", "echo", 5, (("127.0.0.1", fake.port),)))
        seen = _forwarded_seen(server.port, "echo")
    finally:
        server.stop()
    host = f"127.0.0.1:{server.port}"
    assert seen == {
        # every X-Forwarded-For header, in order, then the peer
        "x-forwarded-for": ["203.0.113.7, 198.51.100.1, 127.0.0.1"],
        "x-forwarded-host": ["spoofed.example"],
        "x-forwarded-proto": ["https"],
        "x-forwarded-prefix": ["/fn/prod/echo"],
        "forwarded": [
            f'for=203.0.113.9;proto=https, for=198.51.100.2, for=127.0.0.1;proto=http;host="{host}"'
        ],
    }


def test_a_peer_outside_the_trusted_networks_is_the_edge(fakes):
    fake = fakes.start(hop)
    server = ProxyServer("fast", trusted=("10.0.0.0/8", "::1/128"))
    try:
        server.routes.set(Route("prod", "echo", 5, (("127.0.0.1", fake.port),)))
        seen = _forwarded_seen(server.port, "echo")
    finally:
        server.stop()
    assert seen["x-forwarded-for"] == ["127.0.0.1"]
    assert seen["x-forwarded-proto"] == ["http"]
    assert "x-real-ip" not in seen
    assert len(seen["forwarded"]) == 1 and seen["forwarded"][0].startswith("for=127.0.0.1;")


def test_malformed_trusted_proxy_is_refused():
    with pytest.raises(ValueError, match="not-a-network"):
        ProxyApp(RouteTable(), trusted_proxies=["10.0.0.0/8", "not-a-network"])


@pytest.mark.parametrize(
    ("address", "node", "trusted"),
    [
        ("2001:db8::17", b'for="[2001:db8::17]"', False),
        ("::ffff:10.1.2.3", None, True),  # IPv4-mapped, in 10/8 (spelt per Python version)
        ("10.1.2.3", b"for=10.1.2.3", True),
        ("192.0.2.1", b"for=192.0.2.1", False),
    ],
)
def test_forwarded_quotes_ipv6_nodes(address, node, trusted):
    peer = peer_of(address, ProxyApp(RouteTable(), trusted_proxies=["10.0.0.0/8"]).trusted)
    assert peer.trusted == trusted
    if node is None:
        assert peer.node.startswith(b'for="[::ffff:') and peer.node.endswith(b']"')
        node = peer.node
    assert peer.node == node
    head, *_ = request_head(b"GET", b"/", [(b"host", b'a"b')], peer, "https", "prod", "f")
    assert b"\r\nforwarded: " + node + b';proto=https;host="a\\"b"\r\n' in head
    assert b"\r\nx-forwarded-for: " + peer.addr + b"\r\n" in head


def test_no_peer_address_is_unknown():
    head, *_ = request_head(b"GET", b"/", [], Peer(b"", b"for=unknown", False), "http", "p", "f")
    assert b"x-forwarded-for" not in head
    assert b"\r\nforwarded: for=unknown;proto=http\r\n" in head


def test_client_request_id_is_kept(proxy, route, runtime):
    name = route(runtime)
    reply = proxy.request("GET", f"/fn/prod/{name}/", headers={"X-Request-Id": "abc-1.2_Z"})
    assert reply.headers["x-request-id"] == "abc-1.2_Z"
    assert reply.json()["event"]["_headers"]["x-request-id"] == "abc-1.2_Z"
    assert reply.json()["request_id"] == "abc-1.2_Z"
    assert proxy.recorded(reply).request_id == "abc-1.2_Z"


@pytest.mark.parametrize(
    "given",
    [
        pytest.param(None, id="none"),
        pytest.param("has space", id="space"),
        pytest.param("a/b", id="slash"),
        pytest.param("x" * 129, id="too-long"),
        pytest.param("", id="empty"),
    ],
)
def test_missing_or_bad_request_id_is_replaced(proxy, route, runtime, given):
    name = route(runtime)
    reply = proxy.request(
        "GET", f"/fn/prod/{name}/", headers={} if given is None else {"X-Request-Id": given}
    )
    request_id = reply.headers["x-request-id"]
    assert HEX_ID.fullmatch(request_id)
    assert reply.json()["event"]["_headers"]["x-request-id"] == request_id
    proxy.recorded(reply)


# --------------------------------------------------------------------------- streaming and pooling


def test_response_is_streamed_as_it_arrives(proxy, route, fakes):
    release = threading.Event()
    fake = fakes.start(streamer(release))
    name = route(("127.0.0.1", fake.port))
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(f"GET /fn/prod/{name}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            received = b""
            while b"first" not in received:  # the last chunk is not sent yet
                data = sock.recv(65536)
                assert data, received
                received += data
            assert b"last" not in received
            release.set()
            while not received.endswith(b"0\r\n\r\n"):
                data = sock.recv(65536)
                assert data, received
                received += data
    finally:
        release.set()
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding: chunked" in head.lower()
    assert body == b"5\r\nfirst\r\n4\r\nlast\r\n0\r\n\r\n"


def test_keep_alive_reuses_upstream_connections(proxy, route, runtime):
    name = route(runtime)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        conn.request("GET", f"/fn/prod/{name}/warm-up")
        conn.getresponse().read()
        opened = proxy.app.upstream_connections_opened
        for i in range(30):
            conn.request("GET", f"/fn/prod/{name}/{i}")
            response = conn.getresponse()
            assert json.loads(response.read())["event"]["_path"] == f"/{i}"
    finally:
        conn.close()
    assert proxy.app.upstream_connections_opened - opened <= 1


def test_restarted_upstream_is_reached_on_a_new_connection(proxy, route):
    port = _free_port()
    name = route(("127.0.0.1", port))
    proc = _start_runtime(port)
    try:
        assert proxy.request("GET", f"/fn/prod/{name}/").status == 200
        _stop(proc)  # the pooled connection to it is now dead
        proc = _start_runtime(port)
        reply = proxy.request("GET", f"/fn/prod/{name}/")
        assert reply.status == 200, reply.body
    finally:
        _stop(proc)


def test_every_call_counts_in_metrics(proxy, route, runtime):
    name = route(runtime)
    counts = METRICS.invocations.values
    key = (("env", "prod"), ("name", name), ("status", "200"))
    before_unknown = _unknown_total()
    for _ in range(3):
        proxy.request("GET", f"/fn/prod/{name}/")
    proxy.request("GET", "/fn/prod/nothing-here/")
    _wait_for(lambda: counts.get(key) == 3 and _unknown_total() == before_unknown + 1)
    assert not [k for k in counts if dict(k)["name"] == "nothing-here"]
    assert "sless_proxy_unknown_total " in METRICS.render()


# --------------------------------------------------------------------------- HTTP corners


def test_expect_100_continue(proxy, route, runtime):
    name = route(runtime)
    body = json.dumps({"late": True}).encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        head = (
            f"POST /fn/prod/{name}/ HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode())
        interim = b""
        while b"\r\n\r\n" not in interim:
            interim += sock.recv(1)  # byte by byte: the final response must stay unread
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n")
        sock.sendall(body)
        reply = _read_reply(sock)
    assert reply.status == 200, reply.body
    event = reply.json()["event"]
    assert event["late"] is True
    assert "expect" not in event["_headers"]


def test_pipelined_requests_are_answered_in_order(proxy, route, runtime):
    name = route(runtime)
    requests = b"".join(
        f"GET /fn/prod/{name}/{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(3)
    )
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(requests)
        stream = sock.makefile("rb")
        try:
            paths = []
            for _ in range(3):
                assert stream.readline().startswith(b"HTTP/1.1 200")
                length = 0
                while (line := stream.readline()) != b"\r\n":
                    name_, _, value = line.partition(b":")
                    if name_.lower() == b"content-length":
                        length = int(value)
                paths.append(json.loads(stream.read(length))["event"]["_path"])
        finally:
            stream.close()
    assert paths == ["/0", "/1", "/2"]


def test_client_leaving_mid_stream_drops_the_upstream(proxy, route, fakes):
    fake = fakes.start(drip)
    name = route(("127.0.0.1", fake.port))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"GET /fn/prod/{name}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        received = b""
        while b"first" not in received:
            received += sock.recv(65536)
    _wait_for(lambda: fake.eofs == 1)
    request_id = re.search(rb"x-request-id: (\S+)", received).group(1).decode()
    _wait_for(lambda: any(r.request_id == request_id for r in proxy.records))
    assert [r.status for r in proxy.records if r.request_id == request_id] == [200]


def test_big_response_to_a_slow_reader_arrives_whole(proxy, route, fakes):
    fake = fakes.start(big)
    name = route(("127.0.0.1", fake.port))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"GET /fn/prod/{name}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        time.sleep(0.3)  # the proxy must stop reading the upstream, not buffer 8 MiB
        reply = _read_reply(sock)
    assert reply.status == 200
    assert reply.body == BIG


def test_http10_client_gets_the_whole_body(proxy, route, fakes):
    fake = fakes.start(hop)  # chunked, no length: an HTTP/1.0 client cannot take chunks
    name = route(("127.0.0.1", fake.port))
    reply = raw(proxy.port, f"GET /fn/prod/{name}/ HTTP/1.0\r\n\r\n".encode())
    assert reply.status == 200
    assert reply.body == fake.requests[0]


@pytest.mark.parametrize(
    ("response", "status", "body"),
    [
        pytest.param(
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
            b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
            201,
            b"ok",
            id="interim-1xx",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
            200,
            b"until the end",
            id="ends-at-close",
        ),
        pytest.param(b"HTTP/1.1 204 No Content\r\n\r\n", 204, b"", id="no-content"),
    ],
)
def test_upstream_response_framings(proxy, route, fakes, response, status, body):
    fake = fakes.start(answer(response))
    name = route(("127.0.0.1", fake.port))
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    assert (reply.status, reply.body) == (status, body)
    assert "link" not in reply.headers
    proxy.recorded(reply)


def test_malformed_upstream_response_is_502(proxy, route, fakes):
    fake = fakes.start(answer(b"SPDY/9 what\r\n\r\n"))
    name = route(("127.0.0.1", fake.port))
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    _assert_json_error(reply, 502, "prod", name)
    proxy.recorded(reply)


def _api_in_front(proxy: ProxyApp) -> Callable:
    """The lead's arrangement: /fn/ to the proxy, the rest to the API (here an echo)."""

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/fn/"):
            await proxy(scope, receive, send)
            return
        if scope["type"] == "lifespan":
            await proxy(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        reply = json.dumps({"api": scope["path"], "body": body.decode()}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(reply))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": reply})

    return app


@pytest.mark.parametrize("mode", list(ProxyServer.MODES))
def test_api_and_proxy_share_connections(runtime, mode):
    server = ProxyServer(mode, front=_api_in_front)
    server.routes.set(Route("prod", "echo", 5, (runtime,)))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for i in range(3):  # one keep-alive connection, alternating between the two
            conn.request("GET", f"/fn/prod/echo/{i}")
            assert json.loads(conn.getresponse().read())["event"]["_path"] == f"/{i}"
            conn.request("POST", f"/api/v1/{i}", body=b"payload")
            assert json.loads(conn.getresponse().read()) == {
                "api": f"/api/v1/{i}",
                "body": "payload",
            }
    finally:
        conn.close()
        server.stop()
    assert [r.path for r in server.records] == ["/0", "/1", "/2"]


def _wait_for(condition: Callable[[], bool], timeout: float = 3) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


# --------------------------------------------------------------------------- the edge's limits

EDGE_LIMITS = Limits(head_timeout=0.5, body_timeout=1.5, idle_timeout=0.5, max_connections=4)
BIG_HEADER = b"X-Big: " + b"a" * (70 * 1024) + b"\r\n"


@pytest.fixture(scope="module", params=["fast", "asgi"])
def edge(request: pytest.FixtureRequest, fakes: Fakes) -> Iterator[ProxyServer]:
    """The httptools server (fast path, or every request over ASGI) with short limits and a
    route "echo" to a `hop` upstream that echoes the head it got."""
    server = ProxyServer(request.param, limits=EDGE_LIMITS)
    server.fake = fakes.start(hop)  # type: ignore[attr-defined]
    server.routes.set(Route("prod", "echo", 5, (("127.0.0.1", server.fake.port),)))  # type: ignore[attr-defined]
    yield server
    server.stop()


def _read_to_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _refusal(data: bytes, status: int) -> dict:
    """The one JSON refusal in ``data`` (all the server sent before closing)."""
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), data[:300]
    assert b"\r\nconnection: close" in head.lower()
    assert b"\r\ncontent-type: application/json" in head.lower()
    return json.loads(body)


EDGE_CASES = [
    pytest.param(b"GET /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\n" + BIG_HEADER, 431, id="head-70k"),
    pytest.param(b"GET /fn/prod/echo/\r\nHost: x\r\n", 400, id="no-version"),
    pytest.param(b"GET /fn/prod/echo/a\nX-Injected: two HTTP/1.1\r\nHost: x\r\n", 400, id="lf"),
    pytest.param(b"GET /fn/prod/echo/ HTTP/2.0\r\nHost: x\r\n", 505, id="http-2.0"),
    pytest.param(b"GET /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\nHost: y\r\n", 400, id="two-hosts"),
    pytest.param(b"GET /fn/prod/echo/ HTTP/1.1\r\nX-A: b\r\n", 400, id="no-host"),
    pytest.param(
        b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n"
        b"\r\n5\r\nhello\r\n0\r\n",
        501,
        id="gzip-chunked",
    ),
    pytest.param(
        b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n",
        501,
        id="gzip-then-chunked-headers",
    ),
    pytest.param(
        b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\nhello",
        400,
        id="chunked-not-last",
    ),
    pytest.param(
        b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: identity\r\n\r\n0\r\n",
        400,
        id="chunked-then-identity",
    ),
    pytest.param(
        b"POST /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, chunked\r\n"
        b"\r\n0\r\n",
        400,
        id="chunked-twice",
    ),
    pytest.param(b"GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n", 400, id="two-hosts-not-fn"),
]


@pytest.mark.parametrize(("head", "status"), EDGE_CASES)
def test_malformed_requests_are_refused_before_any_function(edge, head, status):
    accepted = edge.fake.accepted
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        sock.sendall(head + b"\r\n")
        data = _read_to_eof(sock)
    assert _refusal(data, status)["error"]
    assert edge.fake.accepted == accepted


def test_a_head_over_the_limit_sent_in_pieces_is_431(edge):
    head = b"GET /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\n" + BIG_HEADER + b"\r\n"
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        for i in range(0, len(head), 4096):
            if select.select([sock], [], [], 0)[0]:
                break  # answered already
            sock.sendall(head[i : i + 4096])
            time.sleep(0.002)
        data = _read_to_eof(sock)
    assert _refusal(data, 431)["error"] == "request head larger than 65536 bytes"


def test_large_heads_within_the_limit_and_http10_without_host_are_served(edge):
    cookie = b"c" * (32 * 1024)
    reply = raw(edge.port, b"GET /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\nCookie: %b\r\n\r\n" % cookie)
    assert reply.status == 200
    assert b"\r\ncookie: " + cookie + b"\r\n" in reply.body
    reply = raw(edge.port, b"GET /fn/prod/echo/ HTTP/1.0\r\n\r\n")
    assert reply.status == 200


def test_a_refusal_waits_for_the_pipelined_response_before_it(edge):
    good = b"GET /fn/prod/echo/first HTTP/1.1\r\nHost: x\r\n\r\n"
    bad = b"GET /fn/prod/echo/second HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n"
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        sock.sendall(good + bad)
        data = _read_to_eof(sock)
    first, _, rest = data.partition(b"\r\n0\r\n\r\n")  # the end of hop's chunked answer
    assert first.startswith(b"HTTP/1.1 200 ") and b"GET /first HTTP/1.1" in first
    assert _refusal(rest, 400)["error"] == "more than one Host header"


def test_a_connection_that_sends_nothing_is_closed(edge):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        assert _read_to_eof(sock) == b""


def test_a_head_trickled_past_its_timeout_is_408(edge):
    accepted = edge.fake.accepted
    head = b"GET /fn/prod/echo/ HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 200
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        for byte in head:  # a byte every 20 ms: the timer runs from the first one regardless
            if select.select([sock], [], [], 0.02)[0]:
                break
            sock.sendall(bytes([byte]))
        data = _read_to_eof(sock)
    assert _refusal(data, 408)["error"] == "request head not received within 0.5s"
    assert edge.fake.accepted == accepted


def test_a_stalled_body_is_408_and_drops_the_upstream(edge, fakes):
    fake = fakes.start(silent)
    edge.routes.set(Route("prod", "stall", 5, (("127.0.0.1", fake.port),)))
    try:
        with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
            sock.sendall(
                b"POST /fn/prod/stall/ HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789"
            )
            data = _read_to_eof(sock)
    finally:
        edge.routes.remove("prod", "stall")
    assert _refusal(data, 408)["error"] == "request body stalled for 1.5s"
    _wait_for(lambda: fake.eofs == 1)  # the upstream connection with half a body is dropped
    # The fast path records its 408; over ASGI the application saw the client leave.
    status = 408 if edge.mode == "fast" else 499
    _wait_for(lambda: [r.status for r in edge.records if r.name == "stall"] == [status])


def test_a_body_that_stalls_after_the_answer_only_closes(edge):
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        sock.sendall(b"POST /fn/prod/nowhere/ HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\nabc")
        data = _read_to_eof(sock)
    assert data.startswith(b"HTTP/1.1 404 ")
    assert data.count(b"HTTP/1.1 ") == 1  # no 408 after the answer


def test_a_slow_but_steady_body_is_not_cut(edge, runtime):
    edge.routes.set(Route("prod", "steady", 5, (runtime,)))
    body = json.dumps({"numbers": list(range(10))}).encode()
    try:
        with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
            sock.sendall(
                b"POST /fn/prod/steady/ HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                % len(body)
            )
            for i in range(0, len(body), len(body) // 4 + 1):  # over 1.2 s, body_timeout 1.5
                time.sleep(0.3)
                sock.sendall(body[i : i + len(body) // 4 + 1])
            reply = _read_reply(sock)
    finally:
        edge.routes.remove("prod", "steady")
    assert reply.status == 200, reply.body
    assert reply.json()["event"]["numbers"] == list(range(10))


@pytest.mark.parametrize("mode", list(ProxyServer.MODES))
def test_connections_past_the_limit_are_503(runtime, mode):
    server = ProxyServer(mode, limits=Limits(max_connections=3))
    server.routes.set(Route("prod", "echo", 5, (runtime,)))
    held: list[socket.socket] = []
    try:
        for i in range(4):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            held.append(sock)
            sock.sendall(f"GET /fn/prod/echo/{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            reply = _read_reply(sock)
            if i < 3:  # kept alive: each holds its place
                assert reply.status == 200, reply.body
        assert reply.status == 503
        assert reply.headers["connection"] == "close"
        if mode != "h11":  # uvicorn's own cap answers text
            assert "connections" in reply.json()["error"]
        held.pop().close()
        held.pop().close()
        _wait_for(lambda: len(server.server.server_state.connections) < 3)
        assert server.request("GET", "/fn/prod/echo/again").status == 200
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_limits_from_the_environment():
    limits = Limits.from_env(
        {"SLESS_PROXY_HEAD_TIMEOUT": "2.5", "SLESS_PROXY_MAX_CONNECTIONS": "9"}
    )
    assert limits == Limits(head_timeout=2.5, max_connections=9)
    assert Limits.from_env({}) == Limits()
    with pytest.raises(ValueError, match="SLESS_PROXY_BODY_TIMEOUT"):
        Limits.from_env({"SLESS_PROXY_BODY_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="positive"):
        Limits.from_env({"SLESS_PROXY_MAX_HEAD_BYTES": "0"})
