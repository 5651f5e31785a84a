"""The proxy's fast path: ``/fn/`` requests served from uvicorn's protocol callbacks.

Through ASGI a proxied call costs a task, a scope and two message dicts, and
two writes per response, on top of the proxying itself: about 70 µs of CPU
per call against 50 here (``bench/README.md``). :class:`ProxyHttpProtocol` is
uvicorn's httptools protocol with one change: a request whose target starts
with ``/fn/`` is carried by a :class:`FastCall` driven by callbacks (the
client's parser on one side, the upstream's on the other) and its response
goes out in one write. Everything else -- other paths, websockets, requests
pipelined behind one in flight, a server with ``limit_concurrency`` -- takes
uvicorn's usual ASGI route, so the application behind it sees no difference.

Behaviour is the ASGI path's (:class:`~gitops_sless.proxy.ProxyApp`), checked
by running the same tests against both. This leans on uvicorn internals (the
protocol's ``url``, ``headers``, ``parser``, ``cycle``, ``pipeline``, ``flow``
and ``on_response_complete``; ``STATUS_LINE``): tests/test_proxy.py runs the
fast path, so an upgrade of uvicorn that changes them fails there first.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .metrics import METRICS
from .proxy_http import CHUNKED, NO_BODY, error_body, request_head, request_id_of, response_headers
from .proxy_upstream import UpstreamConnection, UpstreamError

if TYPE_CHECKING:
    from .proxy import ProxyApp

__all__ = ["FastCall", "ProxyHttpProtocol", "protocol_for"]

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Request body bytes held for the upstream before the client is read no further.
_PENDING_HIGH_WATER = 64 * 1024


def protocol_for(proxy: ProxyApp) -> type[ProxyHttpProtocol]:
    """The protocol class to give uvicorn as ``http=``, bound to ``proxy``."""
    return type("ProxyHttpProtocol", (ProxyHttpProtocol,), {"proxy": proxy})


class _NoEvent:
    """uvicorn sets the current cycle's message event on disconnect; a FastCall has none."""

    def set(self) -> None:
        pass


class ProxyHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with ``/fn/`` requests carried by :class:`FastCall`."""

    proxy: ClassVar[ProxyApp]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast: FastCall | None = None

    def on_message_begin(self) -> None:
        # uvicorn builds its ASGI scope here; that waits until the target is known.
        self.url = b""
        self.headers = []
        self.expect_100_continue = False

    def on_headers_complete(self) -> None:
        if self.url.startswith(b"/fn/") and self._idle():
            self.fast = self.cycle = FastCall(self)  # type: ignore[assignment]
            self.fast.start()
            return
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers
        super().on_headers_complete()

    def _idle(self) -> bool:
        """Whether nothing else is in flight on this connection, so a FastCall may answer."""
        cycle = self.cycle
        return (
            (cycle is None or cycle.response_complete)
            and not self.pipeline
            and self.limit_concurrency is None
            and not (self.parser.should_upgrade() and self._should_upgrade())
        )

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is FastCall:
            cycle.client_body(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if type(cycle) is FastCall:
            cycle.client_complete()
        else:
            super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        fast = self.fast
        if fast is not None and fast.upstream_out and fast.conn is not None:
            fast.flush_upstream()  # the head and the body that came with it, in one write

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.fast is not None:
            self.fast.client_writable()

    def connection_lost(self, exc: Exception | None) -> None:
        fast, self.fast = self.fast, None
        if fast is not None:
            fast.client_lost()
        super().connection_lost(exc)


class FastCall:
    """One ``/fn/`` request on a :class:`ProxyHttpProtocol`, from head to last byte.

    Doubles as uvicorn's "current cycle" for the attributes its protocol reads
    (``response_complete``, ``keep_alive``, ``disconnected``, ``message_event``),
    so pipelining, graceful shutdown and keep-alive work unchanged.
    """

    message_event: ClassVar[_NoEvent] = _NoEvent()

    __slots__ = (
        "body_mode",
        "call",
        "chunked_out",
        "conn",
        "deadline",
        "disconnected",
        "head",
        "head_sent",
        "http11",
        "is_head",
        "keep_alive",
        "proto",
        "proxy",
        "request_complete",
        "response_complete",
        "reused",
        "route",
        "task",
        "total",
        "upstream",
        "upstream_out",
        "upstream_paused",
    )

    def __init__(self, proto: ProxyHttpProtocol) -> None:
        self.proto = proto
        self.proxy = proto.proxy
        parser = proto.parser
        self.http11 = parser.get_http_version() == "1.1"
        self.keep_alive = self.http11 and parser.should_keep_alive()
        self.disconnected = False
        self.request_complete = self.response_complete = False
        self.head_sent = self.chunked_out = self.reused = self.upstream_paused = False
        self.conn: UpstreamConnection | None = None
        self.task: asyncio.Task[None] | None = None
        self.upstream_out: list[bytes] = []
        self.total = 0

    # -- the client's side

    def start(self) -> None:
        proto = self.proto
        url = proto.url
        if b"#" in url:  # not part of a request target, but parse_url drops it on the ASGI path
            url = url.partition(b"#")[0]
        raw_path, _, query = url.partition(b"?")
        method = proto.parser.get_method()
        self.is_head = method == b"HEAD"
        self.call, route, target = self.proxy.begin(raw_path, query, method.decode("ascii"))
        call = self.call
        if route is None:
            call.request_id = request_id_of(proto.headers)
            self.fail(404, "function not found")
            return
        client = proto.client
        self.head, self.body_mode, length, call.request_id = request_head(
            method,
            target,
            proto.headers,
            client[0] if client else None,
            proto.scheme or "http",
            route.env,
            route.name,
        )
        if length > self.proxy.max_body_bytes:
            self.too_large()
            return
        upstream = route.pick()
        if upstream is None:
            self.fail(503, "function not ready: no healthy upstream")
            return
        self.route, self.upstream = route, upstream
        self.deadline = proto.loop.time() + route.timeout_sec
        self.upstream_out.append(self.head)
        conn = self.proxy.pool.take(upstream)
        if conn is None:
            self.connect()
        else:
            self.reused = True
            self.attach(conn)

    def client_body(self, body: bytes) -> None:
        if self.response_complete:
            return  # answered already (an error): the rest of the body is read and dropped
        self.total += len(body)
        if self.total > self.proxy.max_body_bytes:
            self.too_large()
            return
        if self.body_mode == CHUNKED:
            body = b"%x\r\n%b\r\n" % (len(body), body)
        self.upstream_out.append(body)
        if self.conn is None and self.total > _PENDING_HIGH_WATER:
            self.proto.flow.pause_reading()  # still connecting: hold the client back

    def client_complete(self) -> None:
        self.request_complete = True
        if not self.response_complete and self.body_mode == CHUNKED:
            self.upstream_out.append(b"0\r\n\r\n")

    def client_writable(self) -> None:
        if self.upstream_paused and self.conn is not None and self.conn.transport is not None:
            self.upstream_paused = False
            self.conn.transport.resume_reading()

    def client_lost(self) -> None:
        if self.response_complete:
            return
        self.response_complete = True
        self._drop_upstream()
        call = self.call
        if not call.status:
            call.status = 499  # nginx's code for a client that left before the answer
        self.proxy.finish(call)

    # -- the upstream's side

    def connect(self) -> None:
        self.task = self.proto.loop.create_task(self._connect())

    async def _connect(self) -> None:
        pool = self.proxy.pool
        try:
            conn = await pool.connect(self.upstream, self.deadline - self.proto.loop.time())
        except UpstreamError as exc:
            if not self.response_complete:
                self.fail(502, f"upstream unavailable: {exc}")
            return
        finally:
            self.task = None
        if self.response_complete:
            conn.close()
            return
        self.attach(conn)
        self.flush_upstream()
        self.proto.flow.resume_reading()

    def attach(self, conn: UpstreamConnection) -> None:
        self.conn = conn
        conn.notify = self.pump
        self.proxy.pool.watch(conn, self.deadline)
        proto = self.proto
        if proto.expect_100_continue and self.body_mode != NO_BODY and not self.request_complete:
            proto.transport.write(_CONTINUE)

    def flush_upstream(self) -> None:
        conn = self.conn
        assert conn is not None
        out = self.upstream_out
        conn.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()
        if conn.write_paused and not self.request_complete:
            self.proto.flow.pause_reading()

    def pump(self) -> None:
        """Act on whatever the upstream connection reports."""
        conn = self.conn
        if self.response_complete or conn is None:
            return
        if not self.head_sent:
            if conn.head_done:
                self.proxy.pool.unwatch(conn)
                out = self._response_head(conn)
            elif conn.timed_out:
                self.fail(504, f"function did not answer within {self.route.timeout_sec:g}s")
                return
            elif conn.closed:
                self._upstream_closed(conn)
                return
            else:
                if not conn.write_paused and not self.request_complete:
                    self.proto.flow.resume_reading()
                return
        else:
            out = []
        if conn.chunks:
            body = conn.take_body()
            out.append(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked_out else body)
        done = conn.complete or self.is_head
        if done and self.chunked_out:
            out.append(b"0\r\n\r\n")
        transport = self.proto.transport
        if out:
            transport.write(out[0] if len(out) == 1 else b"".join(out))
        if done:
            if conn.complete and self.request_complete and not self.is_head:
                self.proxy.pool.release(self.upstream, conn)
            else:
                conn.close()
            self._complete()
        elif conn.closed:
            # Cut short after the head went out: the client must see a broken response.
            self.response_complete = True
            transport.close()
            self.proxy.finish(self.call)
        elif self.proto.flow.write_paused and not self.upstream_paused and conn.transport:
            self.upstream_paused = True
            conn.transport.pause_reading()

    def _upstream_closed(self, conn: UpstreamConnection) -> None:
        if self.reused and not conn.received and self.body_mode == NO_BODY:
            # A kept-alive connection that the upstream closed as we wrote: retry once on
            # a new one (the request never reached the function).
            self.proxy.pool.unwatch(conn)
            self.reused = False
            self.conn = None
            self.upstream_out = [self.head]
            self.connect()
            return
        self.fail(502, "upstream unavailable: connection closed before a response")

    def _response_head(self, conn: UpstreamConnection) -> list[bytes]:
        self.head_sent = True
        call = self.call
        call.status = status = conn.status
        METRICS.proxy_latency.observe(time.perf_counter() - call.started)
        line = STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status
        out = [line]
        for name, value in self.proto.server_state.default_headers:
            out += (name, b": ", value, b"\r\n")
        headers, has_length = response_headers(conn.headers, conn.connection, call.request_id)
        out += headers
        if not (has_length or self.is_head or status == 204 or status == 304):
            if self.http11:
                self.chunked_out = True
                out.append(b"transfer-encoding: chunked\r\n")
            else:
                self.keep_alive = False  # HTTP/1.0: the body ends when the connection does
        if not self.keep_alive:
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        return out

    # -- endings

    def fail(self, status: int, message: str, close: bool = False) -> None:
        """Answer with the proxy's own JSON error (the response must not have started)."""
        self._drop_upstream()
        call = self.call
        call.status = status
        METRICS.proxy_latency.observe(time.perf_counter() - call.started)
        if close:
            self.keep_alive = False
        body = error_body(message, call)
        out = [STATUS_LINE[status]]
        for name, value in self.proto.server_state.default_headers:
            out += (name, b": ", value, b"\r\n")
        out += (
            b"content-type: application/json\r\ncontent-length: %d\r\nx-request-id: " % len(body),
            call.request_id,
            b"\r\n" if self.keep_alive else b"\r\nconnection: close\r\n",
            b"\r\n",
            b"" if self.is_head else body,
        )
        self.proto.transport.write(b"".join(out))
        self._complete()

    def too_large(self) -> None:
        if self.head_sent:  # the upstream answered early and its response is going out
            self._drop_upstream()
            self.response_complete = True
            self.proto.transport.close()
            self.proxy.finish(self.call)
            return
        # Close: the rest of an oversized body is not worth reading.
        self.fail(413, f"request body larger than {self.proxy.max_body_bytes} bytes", close=True)

    def _drop_upstream(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
        conn = self.conn
        if conn is not None:
            self.proxy.pool.unwatch(conn)
            conn.notify = None
            conn.close()

    def _complete(self) -> None:
        """The response is out: record the call, then let uvicorn go on with the connection."""
        self.response_complete = True
        proto = self.proto
        proto.fast = None
        self.proxy.finish(self.call)
        if not self.keep_alive:
            proto.transport.close()
        proto.on_response_complete()
