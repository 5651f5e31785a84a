"""WebSocket connections through ``/fn/``: the upgrade goes to a replica, then bytes flow.

A request to ``/fn/{env}/{name}/...`` with ``Upgrade: websocket`` is a :class:`Tunnel`.
Its head goes to one of the function's replicas exactly as a call's would (the same
route, limits, held for a start from zero or a free slot, forwarding headers, the
replica's proof), with ``Connection: upgrade`` and ``Upgrade: websocket`` kept. The
replica's answer decides:

- ``101 Switching Protocols``: its head goes to the client (hop-by-hop headers and
  cookies treated as a call's response's are), and from then on the tunnel passes
  bytes both ways untouched, nginx's way: the frames are the runtime's business (it
  implements RFC 6455), so the proxy neither parses nor copies them into objects. Each
  side's write buffer holds the other side's reads back (pause and resume).
- anything else (onConnect refused, no websocket trigger, an error): that response
  goes to the client and the connection closes.

A tunnel is one call for the function's load from its head until either side
closes: it counts for ``concurrency``, for the autoscaler and for scale to zero (an
open socket keeps its replica busy), and the invocation history records it once,
with status 101 and the socket's duration.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import httptools

from ..metrics import METRICS
from ..state.routes import Route
from .activator import Refused
from .http import Call, error_body, request_head, request_id_of, response_headers
from .streamwatch import Opened
from .upstream import CLOSED_EARLY

if TYPE_CHECKING:
    from .fast import ProxyHttpProtocol

__all__ = ["Tunnel", "is_websocket"]

_HEAD_LIMIT = 64 * 1024  # of the replica's answer to the upgrade
# what the client may send before the 101 that the tunnel holds; then it reads no more
_PENDING_LIMIT = 64 * 1024
# a side that reads nothing of what waits for it this long: the tunnel is cut (else a
# client that stops reading would hold the call, and its slot, however the replica ends)
STALL_SEC = 60.0
_UPGRADE = b"connection: upgrade\r\nupgrade: websocket\r\n\r\n"
_SWITCHED = b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n"


def is_websocket(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request head asks for a WebSocket (Upgrade: websocket, Connection: upgrade)."""
    upgrade = connection = False
    for name, value in headers:
        if name == b"upgrade":
            upgrade = value.strip().lower() == b"websocket"
        elif name == b"connection":
            connection = connection or b"upgrade" in (t.strip() for t in value.lower().split(b","))
    return upgrade and connection


class Tunnel:
    """One WebSocket connection from a client, through the proxy, to a replica."""

    def __init__(self, proto: ProxyHttpProtocol) -> None:
        self.proto = proto
        self.proxy = proto.proxy
        self.loop = proto.loop
        self.client: asyncio.Transport = proto.transport
        self.upstream: asyncio.Transport | None = None
        self.pending: list[bytes] = []  # what the client sent before the replica answered
        self.pending_size = 0
        self.switched = False  # the 101 went out: bytes flow
        self.ended = False
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.stall: asyncio.TimerHandle | None = None  # while a side does not read
        self.call: Call | None = None
        self.route: Route | None = None
        self.address: Any = None  # the upstream picked
        self.head = b""

    # -- the upgrade request

    def start(self) -> None:
        proto, proxy = self.proto, self.proxy
        url = proto.url.partition(b"#")[0]
        raw_path, _, query = url.partition(b"?")
        method = proto.parser.get_method()
        call, route, target = proxy.begin(raw_path, query, method.decode("ascii"))
        self.call = call
        if route is None or not (route.upstreams or route.scale or route.starting):
            call.request_id = request_id_of(proto.headers)
            self.fail(*proxy.not_serving(call, route, plain=False))
            return
        if not route.websocket:
            call.request_id = request_id_of(proto.headers)
            self.fail(404, "function has no websocket trigger")
            return
        if route.rate_limit is not None:
            refused = proxy.rate_limited(route)
            if refused is not None:
                call.request_id = request_id_of(proto.headers)
                self.fail(refused.status, refused.message, refused.retry_after)
                return
        peer = proto.peer
        if peer is None:
            client = proto.client
            peer = proto.peer = proxy.peer(client[0] if client else None)
        head, _, _, call.request_id = request_head(
            method,
            target,
            proto.headers,
            peer,
            proto.scheme or "http",
            route.env,
            route.name,
            route.gateway,
            proxy.withheld,
            route.proof,
            call,
        )
        self.head = head[:-2] + _UPGRADE  # hop-by-hop, so request_head left them out
        self.route = route
        self.task = self.loop.create_task(self._open(route))

    async def _open(self, route: Route) -> None:
        deadline = self.loop.time() + route.timeout_sec
        call = self.call
        assert call is not None
        if (not route.upstreams or route.concurrency) and self.proxy.activator.must_wait(
            route, call.load
        ):
            try:
                held = await self.proxy.activator.hold(route, deadline)
            except Refused as exc:
                self.fail(exc.status, exc.message, exc.retry_after)
                return
            self.proxy.sent(call, held, route)
            route = self.route = held
            deadline = self.loop.time() + held.timeout_sec
        upstream = self.address = route.pick()
        if upstream is None:  # a route never changes; held() gave one with upstreams
            self.fail(503, "function not ready: no healthy upstream")
            return
        address: tuple[Any, ...] = upstream if route.gateway is None else route.gateway.address
        tls = {} if len(address) == 2 else {"ssl": address[2], "server_hostname": address[3]}
        try:
            async with asyncio.timeout(max(0.0, deadline - self.loop.time())):
                await self.loop.create_connection(
                    lambda: _Replica(self), address[0], address[1], **tls
                )
        except (OSError, TimeoutError) as exc:
            reason = f"upstream unavailable: cannot connect to {address[0]}:{address[1]}: {exc}"
            self.fail(502, self.proxy.closed_early(call, upstream, reason))
            return
        finally:
            self.task = None
        if self.ended:  # the client left meanwhile
            if self.upstream is not None:
                self.upstream.abort()
            return
        timeout = route.timeout_sec
        self.timer = self.loop.call_at(
            deadline, self.fail, 504, f"function did not answer within {timeout:g}s"
        )

    def client_data(self, data: bytes) -> None:
        """Bytes from the client (after the upgrade's head)."""
        if self.switched:
            assert self.upstream is not None
            self.upstream.write(data)
        elif data and not self.ended:  # a client may send frames before the 101 arrives
            self.pending.append(data)
            self.pending_size += len(data)
            if self.pending_size > _PENDING_LIMIT:
                self.client.pause_reading()  # until the 101: memory is not the client's

    # -- the replica's answer

    def answered(self, status: int, headers: list[tuple[bytes, bytes]], rest: bytes) -> None:
        """The replica answered the upgrade with ``status``; ``rest`` followed its head."""
        self._cancel_timer()
        call = self.call
        route = self.route
        assert call is not None and route is not None
        call.status = status
        METRICS.proxy_latency.observe(time.perf_counter() - call.started)
        out = [_SWITCHED if status == 101 else b"HTTP/1.1 %d \r\n" % status]
        for name, value in self.proto.server_state.default_headers:
            out += (name, b": ", value, b"\r\n")
        connection = next((v for n, v in headers if n == b"connection"), None)
        kept, _ = response_headers(headers, connection, call.request_id, not route.same_origin)
        out += kept
        if call.cold is not None:
            out.append(self.proxy.cold_start(call))
        if status != 101:  # the body ends with the connection
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        out.append(rest)
        self.client.write(b"".join(out))
        if status == 101:
            self.switched = True
            call.opened = Opened(route.load, socket=True)  # open until the call ends
            pending, self.pending = self.pending, []
            assert self.upstream is not None
            if pending:
                self.upstream.write(b"".join(pending))
            self.pending_size = 0
            self.client.resume_reading()

    def refused_body(self, data: bytes) -> None:
        """Part of the body of a refusal (a status other than 101)."""
        self.client.write(data)

    # -- endings

    def fail(self, status: int, message: str, retry_after: int | None = None) -> None:
        """Answer the proxy's own JSON error and close (the replica has not answered)."""
        if self.ended or self.switched:
            return
        call = self.call
        assert call is not None
        call.status = status
        METRICS.proxy_latency.observe(time.perf_counter() - call.started)
        body = error_body(message, call)
        lines = [
            b"HTTP/1.1 %d \r\n" % status,
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
            b"x-request-id: " + call.request_id + b"\r\nconnection: close\r\n",
            b"" if retry_after is None else b"retry-after: %d\r\n" % retry_after,
            b"\r\n",
            body,
        ]
        self.client.write(b"".join(lines))
        self.end()

    def end(self, abort: bool = False) -> None:
        """Close both sides (each flushes what it holds; ``abort``: at once, what they
        hold dropped) and record the call, once."""
        if self.ended:
            return
        self.ended = True
        self._cancel_timer()
        self.flowing()
        if self.task is not None:
            self.task.cancel()
            self.task = None
        if self.upstream is not None:
            self.upstream.abort() if abort else self.upstream.close()
        self.client.abort() if abort else self.client.close()
        proto = self.proto
        proto.connections.discard(proto)  # its connection_lost never comes: the tunnel's does
        if self.call is not None:
            if not self.call.status:
                self.call.status = 499  # the client left before the replica answered
            self.proxy.finish(self.call)

    def upstream_lost(self) -> None:
        """The replica's connection ended: before an answer, a 502; else the end."""
        call = self.call
        if call is not None and not call.status and self.address is not None:
            self.fail(502, self.proxy.closed_early(call, self.address, CLOSED_EARLY))
        self.end()

    def stalled(self) -> None:
        """A side stopped reading what waits for it: it has STALL_SEC to start again."""
        if self.stall is None and not self.ended:
            self.stall = self.loop.call_later(STALL_SEC, self.end, True)

    def flowing(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class ClientSide(asyncio.Protocol):
    """The client's connection once its head is read: its bytes go to the replica."""

    def __init__(self, tunnel: Tunnel) -> None:
        self.tunnel = tunnel

    def data_received(self, data: bytes) -> None:
        self.tunnel.client_data(data)

    def eof_received(self) -> bool:
        return False  # a half-close ends the socket: WebSockets close with a frame

    def connection_lost(self, exc: Exception | None) -> None:
        self.tunnel.end()

    def pause_writing(self) -> None:  # the client reads slower than the replica writes
        upstream = self.tunnel.upstream
        if upstream is not None:
            upstream.pause_reading()
        self.tunnel.stalled()

    def resume_writing(self) -> None:
        self.tunnel.flowing()
        upstream = self.tunnel.upstream
        if upstream is not None and not self.tunnel.ended:
            upstream.resume_reading()


class _Replica(asyncio.Protocol):
    """The connection to the replica: its answer to the upgrade, then its bytes."""

    def __init__(self, tunnel: Tunnel) -> None:
        self.tunnel = tunnel
        self.parser: Any = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.size = 0
        self.refused = False  # answered with another status: its body follows

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tunnel = self.tunnel
        tunnel.upstream = transport  # type: ignore[assignment]
        transport.write(tunnel.head)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        tunnel = self.tunnel
        if tunnel.switched:
            tunnel.client.write(data)
            opened = tunnel.call.opened if tunnel.call is not None else None
            if opened is not None:
                opened.bytes += len(data)
            return
        if tunnel.ended:
            return
        self.size += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            tunnel.answered(101, self.headers, data[upgrade.args[0] :])
            return
        except httptools.HttpParserError:
            self._garbage()
            return
        if not self.refused and self.size > _HEAD_LIMIT:
            self._garbage()

    def _garbage(self) -> None:
        """Not an HTTP answer (or a head past the limit): 502 if nothing went out yet."""
        self.tunnel.upstream_lost()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status == 101:
            return  # the parser stops after this head: HttpParserUpgrade
        if status < 200:  # another interim answer: not the client's
            self.headers = []
            return
        self.refused = True
        self.tunnel.answered(status, self.headers, b"")

    def on_body(self, body: bytes) -> None:
        self.tunnel.refused_body(body)

    def on_message_complete(self) -> None:
        if self.refused:
            self.tunnel.end()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.tunnel.upstream_lost()

    def pause_writing(self) -> None:  # the replica reads slower than the client writes
        self.tunnel.client.pause_reading()
        self.tunnel.stalled()

    def resume_writing(self) -> None:
        self.tunnel.flowing()
        if not self.tunnel.ended:
            self.tunnel.client.resume_reading()
