"""The invoke proxy: ``/fn/{env}/{name}/{path}`` forwarded to the function's upstream.

:class:`ProxyApp` is a raw ASGI 3 application, kept off FastAPI on purpose. It
only ever connects to an upstream that the
:class:`~gitops_sless.state.routes.RouteTable` names: the URL chooses a route, never
a host. Per call it writes the request head (see :mod:`.http`) on a
pooled keep-alive connection (:mod:`.upstream`), streams the request
body, waits for the response head until the function's timeout, then streams
the response back.

A name with a route is served; a name the repository declares without a
serving route (``RouteTable.declared``) is 503 with its phase and message;
any other name is 404. Every call to a routed or declared name, answered or
not, is counted in :data:`~gitops_sless.metrics.METRICS` under its name and
handed to ``record``; calls to undeclared names are only counted, unlabelled
(``sless_proxy_unknown_total``): their names come from the URL.

Served by uvicorn through :func:`config`, ``/fn/`` requests skip ASGI
altogether (:mod:`.fast`): the same proxy, driven from uvicorn's
protocol callbacks, at about 30 % less CPU per call. :func:`config` also
puts the :class:`~gitops_sless.proxy.http.Limits` of the edge in front of
every request, ``/fn/`` or not: head size and timeouts, connection count,
and a strict reading of the request line and its framing headers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from ..metrics import METRICS
from ..state.routes import Address, Route, RouteTable, Upstream
from .activator import Activator, Refused
from .history import Invocation
from .http import (
    CHUNKED,
    LABEL_MAX,
    NO_BODY,
    SANDBOX_CSP,
    Call,
    Limits,
    Peer,
    Withheld,
    error_body,
    parse_networks,
    peer_of,
    request_head,
    request_id_of,
    response_headers,
    split_target,
)
from .spans import record_span
from .streamwatch import StreamWatch
from .upstream import CLOSED_EARLY, Pool, UpstreamConnection, UpstreamError

if TYPE_CHECKING:
    from .fast import Submissions

__all__ = ["Invocation", "Limits", "ProxyApp", "config"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_log = logging.getLogger(__name__)


class ProxyApp:
    """ASGI 3 application serving ``/fn/{env}/{name}/{path...}``.

    In front of another ASGI app, hand it the requests whose path starts with ``/fn/``,
    run the server with ``config(combined_app, host, port, proxy=this)`` (``/fn/`` then
    never reaches ASGI at all) and ``await aclose()`` at shutdown. Its connection pool
    belongs to the event loop that serves it: one loop per ProxyApp. ``record`` is
    called on that loop, once per call to a routed or declared function.
    ``trusted_proxies`` are CIDRs (or addresses) of proxies in front whose ``X-Forwarded-For``
    and ``Forwarded`` are kept (see :mod:`.http`). ``withheld_tokens`` are the server's own
    tokens: never passed on to a function."""

    def __init__(
        self,
        routes: RouteTable,
        record: Callable[[Invocation], None] | None = None,
        max_body_bytes: int = 1 << 20,
        trusted_proxies: Iterable[str] = (),
        withheld_tokens: Iterable[str | None] = (),
        wake: Callable[[str, str], None] | None = None,
    ) -> None:
        self.routes = routes
        # ``wake(env, name)``: start a replica of a function scaled to zero (see .activator)
        self.activator = Activator(routes, wake)
        self.withheld = Withheld(withheld_tokens)
        self.record = record
        self.max_body_bytes = max_body_bytes
        self.trusted = parse_networks(trusted_proxies)
        self._peers: dict[str | None, Peer] = {}
        self.pool = Pool()
        self.streams = StreamWatch()  # streamed responses held to their limits
        self.submissions: Submissions | None = None  # the fast path's (.handoff), set by serve

    @property
    def upstream_connections_opened(self) -> int:
        """Upstream connections opened so far; few for many calls means keep-alive works."""
        return self.pool.opened

    async def aclose(self) -> None:
        """Close the idle upstream connections (call on the loop that served requests)."""
        self.streams.close()
        await self.pool.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:  # websocket: refused, functions speak plain HTTP
            await receive()
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- the part both paths share

    def begin(self, raw_path: bytes, query: bytes, method: str) -> tuple[Call, Route | None, bytes]:
        """The call's record, its route (None: not routed) and the target to send upstream.

        A call whose route can take it (it has upstreams, or a replica can be started)
        counts in the function's load from here (``call.load``) until :meth:`finish`,
        when the autoscaler or a concurrency limit reads it (``route.counted``);
        then ``activator.must_wait(route, call.load)`` says whether it is held. A call
        whose route cannot take it, or that has no route, carries the function's
        declaration, if the repository declares it, in ``call.declared``.
        """
        env, name, valid, tail = split_target(raw_path)
        target = b"/" + tail + b"?" + query if query else b"/" + tail
        call = Call(env, name, method, target.decode("latin-1"))
        if not valid:
            return call, None, target
        routes = self.routes
        route = routes.get(env, name)
        if route is None:
            if "@" in name:  # a revision's own URL: name@rN or name@id
                route = routes.revision(env, name)
                if route is not None:
                    call.name = route.name  # counted as the route that serves it
        elif route.canary is not None and route.canary.takes():  # a rollout's share
            canary = routes.get(env, route.canary.name)
            if canary is not None and (canary.upstreams or canary.scale):
                call.canary = route.canary  # its outcome is the verdict's
                route = canary
                call.name = route.name
        if route is None or not (route.upstreams or route.scale or route.starting):
            call.declared = routes.declared(env, name)
            call.known = route is not None or call.declared is not None
            return call, route, target
        call.known = True
        if not route.counted:
            return call, route, target
        # counted in the function's load until finish(): Load.begin, inline (every call)
        load = call.load = route.load
        now = call.started  # perf_counter: CLOCK_MONOTONIC, as time.monotonic on Linux
        load.busy += load.inflight * (now - load.changed)
        load.changed = now
        load.inflight += 1
        load.total += 1
        return call, route, target

    def rate_limited(self, route: Route) -> Refused | None:
        """The refusal of a call over ``route``'s rateLimit (ask only when it has one)."""
        return self.activator.rate_limited(route, time.monotonic())

    def body_limit(self, route: Route) -> int:
        """The most request body bytes a call of ``route``'s function may send."""
        own = route.max_body_bytes  # a streamed body is never held: no ceiling for it
        streamed = own is not None and route.body_streamed
        return own if streamed else min(own or self.max_body_bytes, self.max_body_bytes)

    def sent(self, call: Call, route: Route, waited_for: Route) -> None:
        """A held call goes on: if it waited for a replica to start, it is a cold start."""
        if not waited_for.upstreams:
            call.cold = (time.perf_counter(), route.runtime)

    def cold_start(self, call: Call) -> bytes:
        """The ``X-Sless-Cold-Start`` header line of a call that waited for a start, with
        its phases recorded; b"" for any other call."""
        if call.cold is None:
            return b""
        sent, runtime = call.cold
        now = time.perf_counter()
        waited = sent - call.started
        labels = {"env": call.env, "function": call.name, "runtime": runtime}
        METRICS.cold_start.observe_labelled(now - sent, phase="answer", **labels)
        METRICS.cold_start.observe_labelled(now - call.started, phase="total", **labels)
        if call.load is not None:
            call.load.cold_start(waited * 1000)
        return b"x-sless-cold-start: %d\r\n" % round(waited * 1000)

    def not_serving(self, call: Call, route: Route | None, plain: bool = True) -> tuple[int, str]:
        """The status and error for a call with no route or no ready upstream."""
        declared = call.declared
        if route is None and declared is None:
            function, at, ref = call.name.partition("@")
            kept = self.routes.revision_refs(call.env, function) if at else None
            if kept is not None:
                return 404, f"revision {ref} of {function} not kept; kept: {', '.join(kept)}"
            return 404, "function not found"
        if route is None and declared is not None and not declared.http:
            return 404, "function has no http trigger"
        if plain and route is not None and not route.plain:  # only WebSocket connections
            return 404, "function has no http trigger (a websocket trigger only)"
        if declared is not None and declared.phase == "Disabled":
            return 503, "function disabled"
        if route is None:
            return 503, "function not ready"
        return 503, "function not ready: no healthy upstream"

    def closed_early(self, call: Call, upstream: Upstream, what: str) -> str:
        """The 502 error for an upstream that failed before its response head.

        Names why the replica ended when the route, looked up again now, no longer has
        ``upstream`` and says why its last replica left (e.g. it was OOM-killed mid-call).
        """
        route = self.routes.get(call.env, call.name)
        if route is not None and route.last_exit and upstream not in route.upstreams:
            return f"{what}: {route.last_exit}"
        return what

    def peer(self, host: str | None) -> Peer:
        """The :class:`Peer` of a client address (cached: the same few recur)."""
        peer = self._peers.get(host)
        if peer is None:
            peer = peer_of(host, self.trusted)
            if len(self._peers) < 4096:
                self._peers[host] = peer
        return peer

    def finish(self, call: Call) -> None:
        """Count the call and hand it to ``record``; once per call, whatever happened."""
        ended = time.perf_counter()  # CLOCK_MONOTONIC, as time.monotonic on Linux
        load = call.load
        if load is not None:  # its slot is free: a call waiting for one may go
            call.load = None
            # Load.end, inline: this runs for every call
            load.busy += load.inflight * (ended - load.changed)
            load.changed = ended
            load.inflight -= 1
            if self.activator.waiters:
                self.activator.released(call.env, call.name)
        opened = call.opened
        if opened is not None:  # a stream or a socket: no longer open
            opened.close()
        if not call.known:  # a name from the URL: as a label or in history, it is unbounded
            METRICS.proxy_unknown.inc()
            return
        status = call.status or 500
        if call.canary is not None:
            call.canary.answered(status)
        METRICS.invocations.inc(env=call.env, name=call.name, status=str(status))
        if call.trace is not None:  # only with spans exported (telemetry.ON)
            record_span(call, status, self.routes)
        if self.record is None:
            return
        invocation = Invocation(
            call.env[:LABEL_MAX],
            call.name[:LABEL_MAX],
            call.method,
            call.path,
            status,
            (ended - call.started) * 1000.0,
            call.wall,
            call.request_id.decode("ascii"),
            call.trace_id.decode("ascii"),
            None if call.cold is None else (call.cold[0] - call.started) * 1000.0,
        )
        if opened is not None:  # what went to the client; a socket has no chunks
            invocation.bytes, invocation.chunks = opened.bytes, opened.chunks or None
        try:
            self.record(invocation)
        except Exception:  # a broken history must not break the call it records
            _log.exception("recording invocation %s failed", invocation.request_id)

    # -- one request, over ASGI

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get("raw_path") or quote(scope["path"]).encode("ascii")
        call, route, target = self.begin(raw, scope.get("query_string", b""), scope["method"])
        try:
            if route is None or not (
                route.plain and (route.upstreams or route.scale or route.starting)
            ):
                call.request_id = request_id_of(scope["headers"])
                await self._error(call, send, *self.not_serving(call, route))
                return
            refused = self.rate_limited(route) if route.rate_limit is not None else None
            if refused is not None:
                call.request_id = request_id_of(scope["headers"])
                await self._refused(call, send, refused)
                return
            client = scope.get("client")
            host = client[0] if client else None
            head, body_mode, length, call.request_id = request_head(
                scope["method"].encode("ascii"),
                target,
                scope["headers"],
                self._peers.get(host) or self.peer(host),
                scope.get("scheme", "http"),
                route.env,
                route.name,
                route.gateway,
                self.withheld,
                route.proof,
                call,
            )
            limit = self.body_limit(route)
            if length > limit:
                await self._too_large(call, send, limit)
                return
            if self.activator.must_wait(route, call.load):
                deadline = asyncio.get_running_loop().time() + route.timeout_sec
                try:
                    held = await self.activator.hold(route, deadline)
                except Refused as exc:
                    await self._refused(call, send, exc)
                    return
                self.sent(call, held, route)
                route = held
            await self._forward(call, route, head, body_mode, limit, receive, send)
        finally:
            self.finish(call)

    async def _forward(
        self,
        call: Call,
        route: Route,
        head: bytes,
        body_mode: int,
        limit: int,
        receive: Receive,
        send: Send,
    ) -> None:
        upstream = route.pick()
        assert upstream is not None  # begin() or hold() saw upstreams; a route never changes
        address = upstream if route.gateway is None else route.gateway.address
        timeout = route.timeout_sec
        try:
            conn = await self._exchange(address, head, body_mode, timeout, limit, receive)
        except UpstreamError as exc:
            await self._error(call, send, 502, self.closed_early(call, upstream, str(exc)))
            return
        except TimeoutError:
            await self._error(call, send, 504, f"function did not answer within {timeout:g}s")
            return
        except _TooLarge:
            await self._too_large(call, send, limit)
            return
        except _ClientGone:
            call.status = 499
            return
        await self._respond(call, conn, address, receive, send, not route.same_origin)

    async def _exchange(
        self,
        address: Address,
        head: bytes,
        body_mode: int,
        timeout: float,
        limit: int,
        receive: Receive,
    ) -> UpstreamConnection:
        """Send the request, wait for the response head; the connection holding it."""
        pool = self.pool
        conn = pool.take(address)
        reused = conn is not None
        if conn is None:
            conn = await pool.connect(address, timeout)
        deadline = conn.loop.time() + timeout
        pool.watch(conn, deadline)
        try:
            if body_mode == NO_BODY:
                conn.write(head)
            else:
                async with asyncio.timeout_at(deadline):
                    await self._send_body(conn, head, body_mode, limit, receive)
            while not conn.head_done:
                if conn.timed_out:
                    raise TimeoutError
                if conn.closed:
                    if not (reused and not conn.received and body_mode == NO_BODY):
                        raise UpstreamError(CLOSED_EARLY)
                    # A kept-alive connection that the upstream closed as we wrote: retry
                    # once on a new one (the request never reached the function).
                    reused = False
                    pool.unwatch(conn)
                    conn = await pool.connect(address, deadline - conn.loop.time())
                    pool.watch(conn, deadline)
                    conn.write(head)
                    continue
                await conn.wait()
        except BaseException:
            conn.close()
            raise
        finally:
            pool.unwatch(conn)
        return conn

    async def _send_body(
        self, conn: UpstreamConnection, head: bytes, body_mode: int, limit: int, receive: Receive
    ) -> None:
        total = 0
        pending = head
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _ClientGone
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            total += len(chunk)
            if total > limit:
                raise _TooLarge
            if body_mode == CHUNKED:
                chunk = b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunk else b""
                if not more:
                    chunk += b"0\r\n\r\n"
            if pending:
                chunk, pending = pending + chunk, b""
            if conn.closed:
                return  # the caller reports it
            conn.write(chunk)
            if not more:
                return
            while conn.write_paused and not conn.closed and not conn.head_done:
                await conn.wait()

    async def _respond(
        self,
        call: Call,
        conn: UpstreamConnection,
        address: Address,
        receive: Receive,
        send: Send,
        sandbox: bool,
    ) -> None:
        call.status = conn.status
        METRICS.proxy_latency.observe(time.perf_counter() - call.started)
        headers = response_headers(conn.headers, conn.connection, call.request_id, sandbox)[0]
        pairs = _pairs(headers)
        cold = self.cold_start(call)
        if cold:
            pairs.append((b"x-sless-cold-start", cold.split(b": ", 1)[1].strip()))
        start = {"type": "http.response.start", "status": conn.status, "headers": pairs}
        if call.method == "HEAD":
            conn.close()  # its parser would read the next response as this one's body
            await send(start)
            await send({"type": "http.response.body", "body": b""})
            return
        if conn.complete:  # the common case: the whole response came with its head
            body = conn.take_body()
            self.pool.release(address, conn)
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        await send(start)
        await self._stream(conn, address, receive, send)

    async def _stream(
        self, conn: UpstreamConnection, address: Address, receive: Receive, send: Send
    ) -> None:
        # a client leaving mid-stream is told by receive() only: the upstream is then dropped
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass  # what is left of a request body nobody read
            conn.close()

        watcher = asyncio.ensure_future(watch())
        try:
            while True:
                if conn.chunks:
                    body = conn.take_body()
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                elif conn.complete:
                    break
                elif conn.closed:
                    return  # returning without the last body message makes the server abort
                else:
                    await conn.wait()
        finally:
            watcher.cancel()
        self.pool.release(address, conn)
        await send({"type": "http.response.body", "body": b""})

    # -- answers of the proxy itself

    async def _too_large(self, call: Call, send: Send, limit: int) -> None:
        # Close: the rest of an oversized body is not worth reading.
        await self._error(call, send, 413, f"request body larger than {limit} bytes", close=True)

    async def _refused(self, call: Call, send: Send, refused: Refused) -> None:
        await self._error(call, send, refused.status, refused.message, False, refused.retry_after)

    async def _error(
        self,
        call: Call,
        send: Send,
        status: int,
        message: str,
        close: bool = False,
        retry_after: int | None = None,
    ) -> None:
        call.status = status
        METRICS.proxy_latency.observe(time.perf_counter() - call.started)
        body = error_body(message, call)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"x-request-id", call.request_id),
            (b"content-security-policy", SANDBOX_CSP),
        ]
        if retry_after is not None:
            headers.append((b"retry-after", b"%d" % retry_after))
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _pairs(serialised: list[bytes]) -> list[tuple[bytes, bytes]]:
    """ASGI header pairs from ``response_headers``' (name, ": ", value, CRLF) runs."""
    return [(serialised[i], serialised[i + 2]) for i in range(0, len(serialised), 4)]


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


def config(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    proxy: ProxyApp | None = None,
    limits: Limits | None = None,
    **overrides: Any,
) -> Any:
    """A ``uvicorn.Config`` tuned for the proxy: uvloop, no access log, the ``/fn/`` fast path.

    ``proxy`` is the :class:`ProxyApp` that ``/fn/`` requests go to (``app`` itself when
    it is one); with neither, or with ``http`` in ``overrides``, every request goes
    through ASGI. ``overrides`` replace any setting, e.g. ``loop="asyncio", http="h11"``.

    ``limits`` (default: :meth:`Limits.from_env`, the defaults unless ``SLESS_PROXY_*``
    variables say otherwise) apply to every request, ``/fn/`` or not, on the httptools
    protocols (the default, and ``http="httptools"``). With ``http="h11"`` only
    ``max_head_bytes`` (as 400), ``keep_alive_timeout`` and ``max_connections`` apply.
    """
    import uvicorn  # the proxy itself does not need a server to be imported

    from . import fast  # nor the fast path, built on uvicorn's protocol

    if proxy is None and isinstance(app, ProxyApp):
        proxy = app
    if limits is None:
        limits = Limits.from_env()
    settings: dict[str, Any] = {
        "loop": "uvloop",
        "access_log": False,
        "log_level": "warning",
        "backlog": 2048,
        "timeout_keep_alive": limits.keep_alive_timeout,
        "h11_max_incomplete_event_size": limits.max_head_bytes,
        "server_header": False,
        # The proxy sets X-Forwarded-For itself, from the peer and trusted_proxies;
        # uvicorn's middleware would replace the peer with a client-supplied address first.
        "proxy_headers": False,
        "lifespan": "auto",
    }
    http = overrides.pop("http", None)
    if http is None and proxy is not None:
        settings["http"] = fast.protocol_for(proxy, limits)
    elif http is None or http == "httptools":
        settings["http"] = fast.edge_protocol(limits)
    else:  # uvicorn's own protocol: its connection cap (503 past it) is the one that applies
        settings["http"] = http
        settings["limit_concurrency"] = limits.max_connections + 1
    settings.update(overrides)
    return uvicorn.Config(app, host=host, port=port, **settings)
