"""Routes through a gateway (routes.Gateway), e.g. the Kubernetes API server's service proxy.

The gateway here is a small HTTP server on loopback, plain or TLS (certificates
from ``trustme``), that records each request it receives and answers 200. The
proxy runs as in tests/proxy/test_proxy.py, each test on the fast path and over ASGI
(uvloop/httptools and asyncio/h11).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from gitops_sless.state.routes import Gateway, Route

from .test_proxy import ProxyServer, Reply, _free_port

PREFIX = "/api/v1/namespaces/prod/services/hello:80/proxy"
TOKEN = "gateway-token-a1b2c3"  # the gateway's credentials; must reach nothing but the gateway
ANSWER = b"answered through the gateway"


# --------------------------------------------------------------------------- a gateway


@dataclass
class Received:
    """One request as the gateway read it: its request line, headers (names lower-case), body."""

    line: str
    headers: list[tuple[str, str]]
    body: bytes
    client_cert: bool  # the client presented a certificate (TLS only)

    def header(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key == name]


@dataclass
class Recorder:
    port: int = 0
    received: list[Received] = field(default_factory=list)
    accepted: int = 0  # connections


class Gateways:
    """Recording HTTP/1.1 servers (keep-alive, Content-Length bodies) on one loop in a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever)
        self.thread.start()
        self.servers: list[asyncio.Server] = []
        self.writers: set[asyncio.StreamWriter] = set()

    def start(self, context: ssl.SSLContext | None = None) -> Recorder:
        recorder = Recorder()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            recorder.accepted += 1
            self.writers.add(writer)
            client_cert = bool(writer.get_extra_info("peercert"))
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    line, *lines = head.decode("latin-1").split("\r\n")[:-2]
                    headers = [
                        (name.strip().lower(), value.strip())
                        for name, value in (each.split(":", 1) for each in lines)
                    ]
                    length = int(dict(headers).get("content-length", "0"))
                    body = await reader.readexactly(length)
                    recorder.received.append(Received(line, headers, body, client_cert))
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Gateway: seen\r\n"
                        b"Content-Length: %d\r\n\r\n%b" % (len(ANSWER), ANSWER)
                    )
                    await writer.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                self.writers.discard(writer)
                writer.close()

        async def listen() -> asyncio.Server:
            return await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)

        server = asyncio.run_coroutine_threadsafe(listen(), self.loop).result()
        self.servers.append(server)
        recorder.port = server.sockets[0].getsockname()[1]
        return recorder

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


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gateways() -> Iterator[Gateways]:
    gateways = Gateways()
    yield gateways
    gateways.close()


@pytest.fixture(scope="module")
def gateway(gateways: Gateways) -> Recorder:
    return gateways.start()


@pytest.fixture(scope="module", params=list(ProxyServer.MODES))
def proxy(request: pytest.FixtureRequest) -> Iterator[ProxyServer]:
    server = ProxyServer(request.param)
    yield server
    server.stop()


_names = iter(range(1_000_000))


@pytest.fixture
def route(proxy: ProxyServer) -> Iterator[Any]:
    """``route(gateway=None, upstream=...) -> name``: a function only this test uses."""
    added: list[str] = []

    def add(gateway: Gateway | None, upstream: tuple[str, int] = ("hello.prod.svc", 80)) -> str:
        name = f"gw-{next(_names)}"
        proxy.routes.set(Route("prod", name, 5, (upstream,), gateway=gateway))
        added.append(name)
        return name

    yield add
    for name in added:
        proxy.routes.remove("prod", name)


def _through(recorder: Recorder, **settings: Any) -> Gateway:
    headers = (("Authorization", f"Bearer {TOKEN}"),)
    return Gateway("127.0.0.1", recorder.port, PREFIX, headers, **settings)


def _call(proxy: ProxyServer, method: str, path: str, body: bytes | None = None) -> Reply:
    headers = {
        "Host": "front.example",
        "Authorization": "Bearer client-credentials",
        "Impersonate-User": "system:admin",
        "Impersonate-Group": "system:masters",
    }
    if body is not None:
        headers["Content-Type"] = "application/json"
    return proxy.request(method, path, body, headers)


def _last(recorder: Recorder, count_before: int) -> Received:
    assert len(recorder.received) == count_before + 1, recorder.received[count_before:]
    return recorder.received[-1]


# --------------------------------------------------------------------------- plain HTTP


def test_call_reaches_the_gateway_under_its_prefix_with_its_credentials(proxy, route, gateway):
    name = route(_through(gateway))
    before = len(gateway.received)
    body = json.dumps({"a": 1}).encode()
    reply = _call(proxy, "POST", f"/fn/prod/{name}/a/b%2Fc?x=1&y=%2F", body)
    assert reply.status == 200, reply.body
    assert reply.body == ANSWER and reply.headers["x-gateway"] == "seen"
    assert reply.headers["x-request-id"]
    got = _last(gateway, before)
    assert got.line == f"POST {PREFIX}/a/b%2Fc?x=1&y=%2F HTTP/1.1"
    assert got.body == body
    assert got.header("content-type") == ["application/json"]
    # the gateway's credentials and Host; never the client's Authorization
    assert got.header("authorization") == [f"Bearer {TOKEN}"]
    # nor headers the API server would act on with the gateway's credentials
    assert got.header("impersonate-user") == [] and got.header("impersonate-group") == []
    assert got.header("host") == [f"127.0.0.1:{gateway.port}"]
    # the forwarding headers are what they are without a gateway
    assert got.header("x-forwarded-host") == ["front.example"]
    assert got.header("x-forwarded-prefix") == [f"/fn/prod/{name}"]
    assert got.header("x-forwarded-for") == ["127.0.0.1"]
    assert got.header("forwarded") == ["for=127.0.0.1;proto=http;host=front.example"]
    assert got.header("x-request-id") == [reply.headers["x-request-id"]]
    record = proxy.recorded(reply)
    assert (record.method, record.path, record.status) == ("POST", "/a/b%2Fc?x=1&y=%2F", 200)


@pytest.mark.parametrize("suffix", ["", "/"], ids=["no-slash", "slash"])
def test_no_sub_path_is_the_prefix_and_a_slash(proxy, route, gateway, suffix):
    name = route(_through(gateway))
    before = len(gateway.received)
    reply = _call(proxy, "GET", f"/fn/prod/{name}{suffix}")
    assert reply.status == 200, reply.body
    got = _last(gateway, before)
    assert got.line == f"GET {PREFIX}/ HTTP/1.1"
    assert got.body == b""


def test_connection_cannot_name_the_gateway_headers_away(proxy, route, gateway):
    name = route(_through(gateway))
    before = len(gateway.received)
    headers = {"Host": "front.example", "Connection": "keep-alive, Authorization, Host"}
    reply = proxy.request("GET", f"/fn/prod/{name}/x", headers=headers)
    assert reply.status == 200, reply.body
    got = _last(gateway, before)
    assert got.header("authorization") == [f"Bearer {TOKEN}"]
    assert got.header("host") == [f"127.0.0.1:{gateway.port}"]


def test_without_a_gateway_the_client_authorization_and_host_pass(proxy, route, gateway):
    name = route(None, ("127.0.0.1", gateway.port))
    before = len(gateway.received)
    reply = _call(proxy, "GET", f"/fn/prod/{name}/x?q=1")
    assert reply.status == 200, reply.body
    got = _last(gateway, before)
    assert got.line == "GET /x?q=1 HTTP/1.1"
    assert got.header("authorization") == ["Bearer client-credentials"]
    assert got.header("host") == ["front.example"]


def test_routes_through_one_gateway_share_its_connections(proxy, route, gateways):
    recorder = gateways.start()
    first, second = route(_through(recorder)), route(_through(recorder))
    for name in (first, second, first, second):
        assert _call(proxy, "GET", f"/fn/prod/{name}/").status == 200
    assert [got.line for got in recorder.received] == [f"GET {PREFIX}/ HTTP/1.1"] * 4
    assert recorder.accepted == 1


def test_an_unreachable_gateway_is_a_json_502_without_its_credentials(proxy, route):
    port = _free_port()
    name = route(Gateway("127.0.0.1", port, PREFIX, (("Authorization", f"Bearer {TOKEN}"),)))
    reply = _call(proxy, "GET", f"/fn/prod/{name}/")
    assert reply.status == 502, reply.body
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error.startswith(f"upstream unavailable: cannot connect to 127.0.0.1:{port}")
    assert TOKEN not in reply.body.decode()


# --------------------------------------------------------------------------- TLS


@dataclass
class Tls:
    gateway: Recorder
    trusting: ssl.SSLContext  # trusts the gateway's CA, presents a client certificate
    untrusting: ssl.SSLContext  # trusts another CA


@pytest.fixture(scope="module")
def tls(gateways: Gateways) -> Tls:
    import trustme  # a test dependency (pyproject's test extra): missing fails, never skips

    ca, other_ca = trustme.CA(), trustme.CA()
    # the certificate names only gateway.test: the proxy connects to 127.0.0.1 and
    # checks it against the route's server_hostname
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("gateway.test").configure_cert(server)
    server.verify_mode = ssl.CERT_REQUIRED  # a client certificate, as a kubeconfig may give
    ca.configure_trust(server)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    ca.issue_cert("sless-proxy").configure_cert(trusting)
    untrusting = ssl.create_default_context()
    other_ca.configure_trust(untrusting)
    ca.issue_cert("sless-proxy").configure_cert(untrusting)
    return Tls(gateways.start(server), trusting, untrusting)


def test_tls_gateway_with_a_client_certificate(proxy, route, tls):
    gateway = _through(tls.gateway, ssl=tls.trusting, server_hostname="gateway.test")
    name = route(gateway)
    before = len(tls.gateway.received)
    body = b'{"over": "tls"}'
    reply = _call(proxy, "PUT", f"/fn/prod/{name}/t?v=2", body)
    assert reply.status == 200, reply.body
    assert reply.body == ANSWER
    got = _last(tls.gateway, before)
    assert got.client_cert
    assert got.line == f"PUT {PREFIX}/t?v=2 HTTP/1.1"
    assert got.body == body
    assert got.header("authorization") == [f"Bearer {TOKEN}"]
    assert got.header("host") == [f"127.0.0.1:{tls.gateway.port}"]
    # kept alive and reused, over TLS too
    opened = proxy.app.upstream_connections_opened
    assert _call(proxy, "GET", f"/fn/prod/{name}/again").status == 200
    assert proxy.app.upstream_connections_opened == opened
    assert _last(tls.gateway, before + 1).line == f"GET {PREFIX}/again HTTP/1.1"


def test_tls_gateway_with_an_untrusted_certificate_is_502(proxy, route, tls):
    gateway = _through(tls.gateway, ssl=tls.untrusting, server_hostname="gateway.test")
    name = route(gateway)
    before = len(tls.gateway.received)
    reply = _call(proxy, "GET", f"/fn/prod/{name}/")
    assert reply.status == 502, reply.body
    assert "CERTIFICATE_VERIFY_FAILED" in reply.json()["error"]
    assert len(tls.gateway.received) == before


def test_tls_gateway_with_the_wrong_server_name_is_502(proxy, route, tls):
    gateway = _through(tls.gateway, ssl=tls.trusting)  # checked against 127.0.0.1: not in it
    name = route(gateway)
    before = len(tls.gateway.received)
    reply = _call(proxy, "GET", f"/fn/prod/{name}/")
    assert reply.status == 502, reply.body
    assert len(tls.gateway.received) == before


# --------------------------------------------------------------------------- Gateway itself


def test_gateway_repr_leaves_out_its_headers():
    gateway = Gateway("api.example", 6443, PREFIX, (("Authorization", f"Bearer {TOKEN}"),))
    assert TOKEN not in repr(gateway)
    assert TOKEN not in repr(Route("prod", "hello", 5, (("hello.prod.svc", 80),), gateway=gateway))


def test_gateway_host_names_the_port_unless_it_is_the_default():
    context = ssl.create_default_context()
    assert Gateway("api.example", 443, ssl=context).head == b"host: api.example\r\n"
    assert Gateway("api.example", 80).head == b"host: api.example\r\n"
    assert Gateway("api.example", 443).head == b"host: api.example:443\r\n"
    assert Gateway("::1", 6443, ssl=context).head == b"host: [::1]:6443\r\n"
    assert Gateway("h", 80).address == ("h", 80)
    assert Gateway("h", 443, ssl=context, server_hostname="n").address == ("h", 443, context, "n")


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({"path_prefix": "api/v1"}, id="relative-prefix"),
        pytest.param({"path_prefix": "/api/v1/"}, id="final-slash"),
        pytest.param({"path_prefix": "/a b"}, id="space-in-prefix"),
        pytest.param({"path_prefix": "/a?b"}, id="query-in-prefix"),
        pytest.param({"headers": (("Host", "x"),)}, id="host-header"),
        pytest.param({"headers": (("Content-Length", "1"),)}, id="framing-header"),
        pytest.param({"headers": (("Bad Name", "x"),)}, id="bad-name"),
        pytest.param({"headers": (("X-A", "a\r\nX-B: b"),)}, id="line-break"),
    ],
)
def test_gateway_refuses_what_would_break_the_request(settings):
    with pytest.raises(ValueError) as error:
        Gateway("api.example", 443, **settings)
    assert "X-B: b" not in str(error.value)  # a header value is never in the message
