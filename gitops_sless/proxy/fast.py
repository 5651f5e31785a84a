"""The proxy's edge: uvicorn's httptools protocol with limits, and ``/fn/`` served from it.

The one module over 600 lines, on purpose: it is the hot path, kept whole so that
a request's way through it reads in one place and costs no call it need not
(docs/layout.md).

:class:`EdgeProtocol` is uvicorn's httptools protocol with the checks and
limits an edge server needs, for every request whatever serves it (the
API over ASGI, or the proxy), configured by
:class:`~gitops_sless.proxy.http.Limits`:

- the request line and headers together at most ``max_head_bytes``: 431;
- a request line without an HTTP version (which httptools reads as
  HTTP/0.9, ending the line at a bare LF): 400; a version other than 1.0
  and 1.1: 505;
- exactly one Host header (none is allowed on HTTP/1.0): else 400
  (RFC 9112 §3.2); a Transfer-Encoding that ends in ``chunked`` but has
  another coding before it: 501 (RFC 9112 §6.1); one that does not end in
  ``chunked``, or more than one Transfer-Encoding header: 400 (§6.3; as
  httptools refuses Content-Length with Transfer-Encoding, duplicate
  lengths and bad chunk sizes);
- a head that takes longer than ``head_timeout`` from its first byte: 408;
  a request body that stalls for ``body_timeout``: 408 (or a plain close
  once the response has started); a connection that sends nothing for
  ``idle_timeout`` after it opens, or for ``keep_alive_timeout`` between
  requests: closed;
- a connection opened while ``max_connections`` are open: its request is
  503 and it is closed (decided once, when it opens: the connections being
  served are not cut off when more arrive).

Each refusal is a JSON ``{"error": ...}`` with ``Connection: close``, sent
after any response still in flight on the connection; the connection then
stops writing, reads and drops what else comes for up to ``LINGER_SEC`` (so
the client reads the answer rather than a reset), and closes.

The checks cost the data path a comparison or two per header and a few per
request: a head is measured by the reads that carry it, its lines counted
only when those pass the limit, and timers are armed only when a read ends
inside a request, which a request that arrives whole never does. Measured
with ``bench/proxy.py --instructions``: about 3 % more instructions per
proxied request than uvicorn's protocol without them (``bench/README.md``).

:class:`ProxyHttpProtocol` adds the fast path: through ASGI a proxied call
costs a task, a scope and two message dicts, and two writes per response,
on top of the proxying itself: about 70 µs of CPU per call against 50 here
(``bench/README.md``). A request whose target starts with ``/fn/`` is
carried by a :class:`FastCall` driven by callbacks (the client's parser on
one side, the upstream's on the other) and its response goes out in one
write; a WebSocket upgrade there is a :class:`~.tunnel.Tunnel`. Everything
else -- other paths, other upgrades, requests pipelined
behind one in flight, a server with uvicorn's ``limit_concurrency`` --
takes uvicorn's usual ASGI route, so the application behind it sees no
difference.

An asynchronous submission (``Prefer: respond-async`` on ``/fn/``, or any request
to ``/async/``) is not proxied: it is handed over whole to the proxy's
``submissions`` (the invocations' ``Submitter``, set by serve) in a
:class:`HandOff`: its head is judged at once (404, 413, 503...), its body gathered
within the limit the head got (past it: 413 and close), and the answer the taker
gives written in one write. On 2 shared cores the ASGI cycle was about a fifth of
a submission's CPU (bench/async.py). It lives here, not in a module of its own:
imported from one, it cost the ``/fn/`` path 1 % more instructions per call.

Behaviour is the ASGI path's (:class:`~gitops_sless.proxy.app.ProxyApp`), checked
by running the same tests against both. This leans on uvicorn internals (the
protocol's ``url``, ``headers``, ``parser``, ``cycle``, ``pipeline``, ``flow``,
``connections``, ``timeout_keep_alive_task`` and ``on_response_complete``;
``STATUS_LINE``): tests/proxy/test_proxy.py and tests/web/test_edge.py run them, so an
upgrade of uvicorn that changes them fails there first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ..metrics import METRICS
from ..state.routes import Route, Upstream
from .activator import Activator, Refused
from .http import (
    CHUNKED,
    NO_BODY,
    SANDBOX_CSP,
    Call,
    Limits,
    Peer,
    Withheld,
    error_body,
    request_head,
    request_id_of,
    response_headers,
)
from .streamwatch import Opened, StreamWatch
from .tunnel import ClientSide, Tunnel, is_websocket
from .upstream import CLOSED_EARLY, Pool, UpstreamConnection, UpstreamError

__all__ = [
    "Accepting",
    "Answer",
    "EdgeProtocol",
    "FastCall",
    "HandOff",
    "NoEvent",
    "Proxy",
    "ProxyHttpProtocol",
    "Submissions",
    "edge_protocol",
    "protocol_for",
]

_log = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_ERROR_HEAD = (
    b"content-type: application/json\r\ncontent-security-policy: "
    + SANDBOX_CSP
    + b"\r\ncontent-length: %d\r\nx-request-id: "
)
# Request body bytes held for the upstream before the client is read no further.
_PENDING_HIGH_WATER = 64 * 1024
# After a refusal: how long what the client still sends is read and dropped before
# the connection closes (nginx's lingering close), so that it reads the answer first.
LINGER_SEC = 2.0

# Where a connection is: between requests, inside a request head, inside a request body.
_IDLE, _HEAD, _BODY = 0, 1, 2


# -- asynchronous submissions, handed over whole (module docstring)

# status, a JSON body, headers beside content-type and content-length
Answer = tuple[int, bytes, list[tuple[bytes, bytes]]]
_ANSWER_HEAD = b"content-type: application/json\r\ncontent-length: %d\r\n"


class Accepting(Protocol):
    """A submission whose head was accepted, waiting for its body."""

    limit: int  # bytes of body it takes

    def too_large(self) -> Answer: ...

    async def take(self, body: bytes) -> Answer: ...


class Submissions(Protocol):
    """What takes asynchronous submissions (``Submitter``)."""

    def head(
        self,
        method: str,
        raw: bytes,
        query: bytes,
        request_headers: Sequence[tuple[bytes, bytes]],
        client: str | None,
    ) -> Answer | Accepting: ...


class NoEvent:
    """uvicorn sets the current cycle's message event on disconnect; a FastCall or a
    HandOff has none."""

    def set(self) -> None:
        pass


class HandOff:
    """One submission on a ``ProxyHttpProtocol``, from head to answer.

    Doubles as uvicorn's "current cycle" (``response_complete``, ``response_started``,
    ``keep_alive``, ``disconnected``, ``message_event``, ``on_response``), so
    pipelining, refusals, graceful shutdown and keep-alive work unchanged.
    """

    message_event: ClassVar[NoEvent] = NoEvent()

    __slots__ = (
        "accepting",
        "chunks",
        "disconnected",
        "keep_alive",
        "on_response",
        "proto",
        "response_complete",
        "response_started",
        "size",
        "task",
    )

    def __init__(self, proto: ProxyHttpProtocol) -> None:
        self.proto = proto
        self.keep_alive = proto.parser.should_keep_alive()
        self.disconnected = self.response_complete = self.response_started = False
        self.on_response: Callable[[], None] = proto.on_response_complete
        self.accepting: Accepting | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.task: asyncio.Task[None] | None = None

    def start(self, submissions: Submissions) -> None:
        proto = self.proto
        raw, _, query = proto.url.partition(b"#")[0].partition(b"?")
        client = proto.client
        got = submissions.head(
            proto.parser.get_method().decode("ascii"),
            raw,
            query,
            proto.headers,
            client[0] if client else None,
        )
        if isinstance(got, tuple):  # refused (what body follows is read and dropped)
            self.answer(got, close=got[0] == 413)  # one too large is not worth reading
            return
        self.accepting = got
        if proto.expect_100_continue:
            proto.transport.write(_CONTINUE)

    def client_body(self, body: bytes) -> None:
        accepting = self.accepting
        if accepting is None or self.response_started:
            return  # answered already: the rest is read and dropped
        self.size += len(body)
        if self.size > accepting.limit:
            self.chunks.clear()
            self.answer(accepting.too_large(), close=True)
            return
        self.chunks.append(body)

    def client_complete(self) -> None:
        accepting = self.accepting
        if accepting is None or self.response_started:
            return
        body = b"".join(self.chunks)
        self.chunks.clear()
        self.task = self.proto.loop.create_task(self._take(accepting, body))

    async def _take(self, accepting: Accepting, body: bytes) -> None:
        try:
            answer = await accepting.take(body)
        except Exception:
            _log.exception("an asynchronous submission failed")
            answer = (500, b'{"error": "internal error"}', [])
        finally:
            self.task = None
        self.answer(answer)

    def answer(self, answer: Answer, close: bool = False) -> None:
        """Write ``answer`` (once), then let the protocol go on with the connection."""
        if self.response_started:
            return
        self.response_started = True
        proto = self.proto
        if close:
            self.keep_alive = False
        status, data, headers = answer
        transport = proto.transport
        if not transport.is_closing():
            out = [STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status]
            for name, value in proto.server_state.default_headers:
                out += (name, b": ", value, b"\r\n")
            out.append(_ANSWER_HEAD % len(data))
            for name, value in headers:
                out += (name, b": ", value, b"\r\n")
            out += (b"\r\n" if self.keep_alive else b"connection: close\r\n\r\n", data)
            transport.write(b"".join(out))
        self.response_complete = True
        if not self.keep_alive:
            transport.close()
        self.on_response()


class Proxy(Protocol):
    """What the fast path needs of the proxy it carries calls for.

    :class:`~gitops_sless.proxy.app.ProxyApp` is one (its methods of the same
    names say what they do); named here so that this module does not import
    :mod:`.app`, which imports this one.
    """

    max_body_bytes: int
    pool: Pool
    withheld: Withheld
    activator: Activator
    streams: StreamWatch
    submissions: Submissions | None  # who takes asynchronous submissions (see .handoff)

    def begin(
        self, raw_path: bytes, query: bytes, method: str
    ) -> tuple[Call, Route | None, bytes]: ...

    def rate_limited(self, route: Route) -> Refused | None: ...

    def body_limit(self, route: Route) -> int: ...

    def sent(self, call: Call, route: Route, waited_for: Route) -> None: ...

    def cold_start(self, call: Call) -> bytes: ...

    def not_serving(
        self, call: Call, route: Route | None, plain: bool = True
    ) -> tuple[int, str]: ...

    def closed_early(self, call: Call, upstream: Upstream, what: str) -> str: ...

    def peer(self, host: str | None) -> Peer: ...

    def finish(self, call: Call) -> None: ...


def protocol_for(proxy: Proxy, limits: Limits | None = None) -> type[ProxyHttpProtocol]:
    """The protocol class to give uvicorn as ``http=``, bound to ``proxy`` and ``limits``."""
    attrs = {"proxy": proxy, **_limit_attrs(limits or Limits())}
    return type("ProxyHttpProtocol", (ProxyHttpProtocol,), attrs)


def edge_protocol(limits: Limits | None = None) -> type[EdgeProtocol]:
    """The edge protocol without the fast path (every request over ASGI), with ``limits``."""
    return type("EdgeProtocol", (EdgeProtocol,), _limit_attrs(limits or Limits()))


def _limit_attrs(limits: Limits) -> dict[str, Any]:
    return {
        "limits": limits,
        "max_head": limits.max_head_bytes,
        "max_connections": limits.max_connections,
    }


class _Refusal(Exception):
    """Raised from a parser callback: answer ``status`` and close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the edge's limits and checks (module docstring)."""

    limits: ClassVar[Limits] = Limits()
    max_head: ClassVar[int] = Limits.max_head_bytes
    max_connections: ClassVar[int] = Limits.max_connections

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _IDLE
        self._timer: asyncio.TimerHandle | None = None  # the head or body timer
        # The head's size is bounded from the reads that carried it: the whole read it
        # began in, then every read that began inside it. Only when that bound passes
        # _head_limit are its lines counted (_check_head).
        self._read_size = 0  # of the read being parsed
        self._first_read = 0  # of the read the current head began in
        self._head_bytes = 0  # of the later reads that began inside the current head
        self._head_limit = self.max_head  # -1: every request is checked (over the cap)
        self._over_cap = False  # opened past max_connections: its requests are 503
        # 0 when the head so far has one Host and no Transfer-Encoding but plain chunked
        self._check = 1
        self._te: bytes | None = None  # the Transfer-Encoding values; b"": plain chunked
        self._respond_async = False  # Prefer: respond-async (see ProxyHttpProtocol)
        self._version = "1.1"
        self._last_read = 0.0  # loop time of the last read inside a body
        self._refusal: tuple[int, str] | None = None
        self._refused = False  # the refusal is written: the connection is closing

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._over_cap = True
            self._head_limit = -1
        # uvicorn arms its keep-alive timer only after a response; a connection that
        # never sends a request would stay open forever.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.limits.idle_timeout, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)
        self._unset_keepalive_if_required()

    def data_received(self, data: bytes) -> None:
        task = self.timeout_keep_alive_task
        if task is not None:
            task.cancel()
            self.timeout_keep_alive_task = None
        if self._refusal is not None:
            return  # answered and closing: whatever else comes is dropped
        n = self._read_size = len(data)
        phase = self._phase
        if phase == _HEAD:
            self._head_bytes += n
        elif phase == _BODY:
            self._last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            self._cancel_timer()
            self._phase = _IDLE
            if self._tunnelled(data[upgrade.args[0] :]):
                return
            if self._should_upgrade():
                cycle = self.cycle
                if (cycle is not None and not cycle.response_complete) or self.pipeline:
                    # uvicorn would switch protocols at once: its 101 (or 403) would
                    # overtake the answers still due on this connection
                    self.refuse(400, "an upgrade must not follow a request still unanswered")
                    return
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            self._parser_error(exc)
            return
        phase = self._phase
        if phase:
            self._inside_request(phase)
        elif self.timeout_keep_alive_task is None:
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # e.g. stray CRLFs between requests
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.limits.idle_timeout if cycle is None else self.timeout_keep_alive,
                    self.timeout_keep_alive_handler,
                )

    def _tunnelled(self, rest: bytes) -> bool:
        """Whether the upgrade just read is carried by a tunnel (ProxyHttpProtocol's)."""
        return False

    def _parser_error(self, exc: httptools.HttpParserError) -> None:
        refusal = exc.__context__
        if isinstance(refusal, _Refusal):
            self.refuse(refusal.status, refusal.message)
            return
        if refusal is not None:  # a bug in a callback, not the client's fault
            _log.error("request callback failed", exc_info=refusal)
        else:
            _log.debug("invalid HTTP request from %s: %s", self.client, exc)
        message = f"invalid HTTP request: {exc if refusal is None else 'internal error'}"
        if self._phase == _BODY:  # e.g. a bad chunk size: the call under way cannot go on
            self._abort(400, message)
        else:
            self.refuse(400, message)

    def _inside_request(self, phase: int) -> None:
        """A read ended inside a request: bound its head, time its head or its body."""
        limits = self.limits
        if phase == _HEAD:
            max_head = self.max_head
            # (the line in progress is held by httptools: bounded by the reads after its first)
            if self._head_bytes > max_head or self._head_size() > max_head:
                self.refuse(431, f"request head larger than {max_head} bytes")
            elif self._timer is None:
                self._timer = self.loop.call_later(limits.head_timeout, self._head_timed_out)
        elif self._timer is None:
            self._last_read = self.loop.time()
            self._timer = self.loop.call_later(limits.body_timeout, self._body_timed_out)

    def _cancel_timer(self) -> None:
        timer = self._timer
        if timer is not None:
            timer.cancel()
            self._timer = None

    # -- parser callbacks

    def on_message_begin(self) -> None:
        HttpToolsProtocol.on_message_begin(self)
        self._phase = _HEAD
        self._first_read = self._read_size
        self._head_bytes = 0
        self._check = 1
        self._te = None
        self._respond_async = False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"host":
            self._check -= 1  # 1 -> 0 for the first; any other is -1 or less
        elif name == b"transfer-encoding":
            te = self._te
            if te is None and value.strip().lower() == b"chunked":
                self._te = b""  # plain chunked, once: all is well so far
            else:  # one list, as several headers make one (RFC 9110 §5.3)
                self._te = value if te is None else (te or b"chunked") + b", " + value
                self._check = 1_000_000
        elif name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        elif name == b"prefer" and b"respond-async" in value.lower():
            self._respond_async = True  # an asynchronous invocation: not the fast path's
        self.headers.append((name, value))

    def _head_size(self) -> int:
        """The request line (about) and header lines parsed so far, in bytes."""
        return len(self.url) + 16 + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def on_headers_complete(self) -> None:
        # The head is in: stop its timer, refuse it (raise _Refusal) if it breaks a rule.
        self._phase = _BODY
        timer = self._timer
        if timer is not None:
            timer.cancel()
            self._timer = None
        version = self._version = self.parser.get_http_version()
        if (
            self._check
            or version != "1.1"
            or self._first_read + self._head_bytes > self._head_limit
        ):
            self._check_head(version)
        HttpToolsProtocol.on_headers_complete(self)

    def _check_head(self, version: str) -> None:
        """Raise _Refusal for a head that breaks a rule (the fast checks found something)."""
        if version == "0.9":  # httptools' reading of a line with no version (or a bare LF)
            raise _Refusal(400, "request line without an HTTP version")
        if self._over_cap:
            raise _Refusal(503, f"too many connections (the limit is {self.max_connections})")
        if version not in ("1.0", "1.1"):
            raise _Refusal(505, f"HTTP/{version} is not supported")
        if self._head_size() > self.max_head:
            raise _Refusal(431, f"request head larger than {self.max_head} bytes")
        hosts = sum(1 for name, _ in self.headers if name == b"host")
        if hosts > 1:
            raise _Refusal(400, "more than one Host header")
        if not hosts and version == "1.1":
            raise _Refusal(400, "missing Host header")
        if self._te:
            codings = [coding.strip().lower() for coding in self._te.split(b",")]
            named = self._te.decode("latin-1")
            if codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
                raise _Refusal(400, f"Transfer-Encoding {named!r} does not end in one chunked")
            raise _Refusal(501, f"transfer coding not supported: {named!r} (only chunked)")

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        timer = self._timer
        if timer is not None:
            timer.cancel()
            self._timer = None
        HttpToolsProtocol.on_message_complete(self)

    # -- timeouts and refusals

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._phase == _HEAD:
            timeout = self.limits.head_timeout
            self.refuse(408, f"request head not received within {timeout:g}s")

    def _body_timed_out(self) -> None:
        self._timer = None
        if self._phase != _BODY:
            return
        timeout = self.limits.body_timeout
        now = self.loop.time()
        if self.flow.read_paused:  # the proxy is not reading: not the client's pause
            self._last_read = now
        wait = self._last_read + timeout - now
        if wait > 0:
            self._timer = self.loop.call_later(wait, self._body_timed_out)
            return
        self._abort(408, f"request body stalled for {timeout:g}s")

    def _abort(self, status: int, message: str) -> None:
        """The request whose body is being read cannot go on: answer ``status`` and close
        (a response already under way can only be cut short)."""
        self._cancel_timer()
        self._phase = _IDLE
        cycle = self.cycle  # the request whose body this is
        if cycle is not None and cycle.response_complete:
            self.transport.close()  # answered already (say 404): the rest is not worth waiting for
            return
        if cycle is not None:
            if type(cycle) is FastCall:
                if cycle.head_sent:
                    self.transport.close()
                else:
                    cycle.fail(status, message, close=True)  # recorded with this status
                self._refusal = (status, message)
                self._refused = True  # answered: what else comes is dropped
                return
            if cycle.response_started:  # type: ignore[attr-defined]
                self.transport.close()
                return
            # The application waits for the rest of the body: it sees the client leave.
            cycle.disconnected = True
            cycle.message_event.set()
            queued = next((item for item in self.pipeline if item[0] is cycle), None)
            if queued is None:  # it was running: nothing is in flight before this answer
                self._refusal = (status, message)
                self._send_refusal()
                return
            self.pipeline.remove(queued)  # not started: it never will be
        self.refuse(status, message)  # after the response in flight, if any

    def refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with a JSON error and close, after any response in flight."""
        self._cancel_timer()
        self._phase = _IDLE
        self._refusal = (status, message)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # Sent once the responses in flight are out: whatever calls the protocol's
            # on_response_complete (a FastCall, an ASGI cycle running or queued) calls
            # _after_response instead, for this connection only.
            self.flow.pause_reading()
            self.on_response_complete = self._after_response  # type: ignore[method-assign]
            for waiting in (cycle, *(queued for queued, _ in self.pipeline)):
                if type(waiting) is not FastCall:
                    waiting.on_response = self._after_response  # type: ignore[union-attr]
            return
        self._send_refusal()

    def _after_response(self) -> None:
        if self.pipeline:  # requests before the refused one come first
            HttpToolsProtocol.on_response_complete(self)
            return
        self.server_state.total_requests += 1
        self._send_refusal()

    def _send_refusal(self) -> None:
        transport = self.transport
        if self._refused or self._refusal is None or transport.is_closing():
            return
        self._refused = True
        status, message = self._refusal
        body = json.dumps({"error": message}).encode()
        out = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            out += (name, b": ", value, b"\r\n")
        out += (
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        )
        transport.write(b"".join(out))
        if not transport.can_write_eof():
            transport.close()
            return
        # A lingering close: what the client is still sending is read and dropped, so
        # that closing does not reset the connection before the client reads the answer.
        transport.write_eof()
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_SEC, transport.close)


class ProxyHttpProtocol(EdgeProtocol):
    """The edge protocol, with ``/fn/`` requests carried by :class:`FastCall`."""

    proxy: ClassVar[Proxy]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast: FastCall | None = None
        self.tunnel: Tunnel | None = None  # a WebSocket's, from its head on
        self.peer: Peer | None = None  # the client, as forwarding headers name it

    def on_message_begin(self) -> None:
        # uvicorn builds its ASGI scope here; that waits until the target is known.
        self.url = b""
        self.headers = []
        self.expect_100_continue = False
        self._phase = _HEAD  # as EdgeProtocol.on_message_begin
        self._first_read = self._read_size
        self._head_bytes = 0
        self._check = 1
        self._te = None
        self._respond_async = False

    def on_headers_complete(self) -> None:
        # as EdgeProtocol.on_headers_complete, up to the fast path
        self._phase = _BODY
        timer = self._timer
        if timer is not None:
            timer.cancel()
            self._timer = None
        version = self._version = self.parser.get_http_version()
        if (
            self._check
            or version != "1.1"
            or self._first_read + self._head_bytes > self._head_limit
        ):
            self._check_head(version)
        if self.url.startswith(b"/fn/") and not self._respond_async and self._idle():
            if not self.parser.should_upgrade():
                self.fast = self.cycle = FastCall(self)  # type: ignore[assignment]
                self.fast.start()
                return
            # a WebSocket, whatever uvicorn's own WebSocket support (none without the
            # websockets package); other upgrades (h2c) take uvicorn's way, as before
            if is_websocket(self.headers):
                self.tunnel = Tunnel(self)
                self.tunnel.start()
                return
        url = self.url
        submissions = self.proxy.submissions
        if (
            submissions is not None
            and (url.startswith(b"/async/") or (self._respond_async and url.startswith(b"/fn/")))
            and self._idle()
            and not self.parser.should_upgrade()
        ):
            self.cycle = HandOff(self)  # type: ignore[assignment]
            self.cycle.start(submissions)
            return
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        HttpToolsProtocol.on_message_begin(self)
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers
        HttpToolsProtocol.on_headers_complete(self)

    def _idle(self) -> bool:
        """Whether nothing else is in flight on this connection, so a FastCall (or a
        tunnel: its 101 must not overtake an answer still due) may answer."""
        cycle = self.cycle
        return (
            (cycle is None or cycle.response_complete)
            and not self.pipeline
            and self.limit_concurrency is None
        )

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is FastCall or type(cycle) is HandOff:
            cycle.client_body(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._phase = _IDLE  # as EdgeProtocol.on_message_complete
        timer = self._timer
        if timer is not None:
            timer.cancel()
            self._timer = None
        cycle = self.cycle
        if type(cycle) is FastCall or type(cycle) is HandOff:
            cycle.client_complete()
        elif self.tunnel is None:
            HttpToolsProtocol.on_message_complete(self)

    def data_received(self, data: bytes) -> None:
        EdgeProtocol.data_received(self, data)  # not super(): this runs once per read
        fast = self.fast
        if fast is not None and fast.upstream_out and fast.conn is not None:
            fast.flush_upstream()  # the head and the body that came with it, in one write

    def _tunnelled(self, rest: bytes) -> bool:
        tunnel = self.tunnel
        if tunnel is None:
            return False
        if not tunnel.ended:  # from now on the client's bytes are the tunnel's
            self.transport.set_protocol(ClientSide(tunnel))
            self.transport.resume_reading()
            tunnel.client_data(rest)
        return True

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

    message_event: ClassVar[NoEvent] = NoEvent()

    __slots__ = (
        "address",
        "body_mode",
        "call",
        "chunked_out",
        "conn",
        "deadline",
        "disconnected",
        "head",
        "head_at",
        "head_sent",
        "http11",
        "is_head",
        "keep_alive",
        "last_chunk",
        "limit",
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
        "watched",
    )

    def __init__(self, proto: ProxyHttpProtocol) -> None:
        self.proto = proto
        self.proxy = proto.proxy
        self.http11 = proto._version == "1.1"
        self.keep_alive = self.http11 and proto.parser.should_keep_alive()
        self.disconnected = False
        self.request_complete = self.response_complete = False
        self.head_sent = self.chunked_out = self.reused = self.upstream_paused = False
        # ``watched`` (a stream the proxy holds to its limits) is set with call.opened
        self.conn: UpstreamConnection | None = None
        self.task: asyncio.Task[None] | None = None
        self.upstream_out: list[bytes] = []
        self.total = 0
        self.limit = self.proxy.max_body_bytes  # the route's, once it is known

    # -- the client's side

    def start(self) -> None:
        proto = self.proto
        url = proto.url
        if b"#" in url:  # not part of a request target, but parse_url drops it on the ASGI path
            url = url.partition(b"#")[0]
        raw_path, _, query = url.partition(b"?")
        method = proto.parser.get_method()
        self.is_head = method == b"HEAD"
        proxy = self.proxy
        self.call, route, target = proxy.begin(raw_path, query, method.decode("ascii"))
        call = self.call
        if route is None or not (
            route.plain and (route.upstreams or route.scale or route.starting)
        ):
            call.request_id = request_id_of(proto.headers)
            self.fail(*proxy.not_serving(call, route))
            return
        refused = proxy.rate_limited(route) if route.rate_limit is not None else None
        if refused is not None:
            call.request_id = request_id_of(proto.headers)
            self.fail(refused.status, refused.message, retry_after=refused.retry_after)
            return
        peer = proto.peer
        if peer is None:
            client = proto.client
            peer = proto.peer = proxy.peer(client[0] if client else None)
        self.head, self.body_mode, length, call.request_id = request_head(
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
        if route.max_body_bytes is not None:
            self.limit = proxy.body_limit(route)
        if length > self.limit:
            self.too_large()
            return
        self.route = route
        self.upstream_out.append(self.head)
        self.deadline = proto.loop.time() + route.timeout_sec
        if (not route.upstreams or route.concurrency) and proxy.activator.must_wait(
            route, call.load
        ):
            self.task = proto.loop.create_task(self._hold(route))
            return
        # as go(route), inline: a call that need not wait (nearly all) costs no call more
        upstream = route.pick()
        assert upstream is not None  # begin() saw upstreams, and a route never changes
        self.upstream = upstream
        gateway = route.gateway
        self.address = upstream if gateway is None else gateway.address
        conn = proxy.pool.take(self.address)
        if conn is None:
            self.connect()
        else:
            self.reused = True
            self.attach(conn)

    async def _hold(self, route: Route) -> None:
        """Wait for a replica or a free slot (see .activator), then go on."""
        try:
            held = await self.proxy.activator.hold(route, self.deadline)
        except Refused as exc:
            self.task = None
            if not self.response_complete:
                self.fail(exc.status, exc.message, retry_after=exc.retry_after)
            return
        self.task = None
        if self.response_complete:
            return
        self.proxy.sent(self.call, held, route)
        self.deadline = self.proto.loop.time() + held.timeout_sec
        self.go(held)
        if self.conn is not None:
            self.flush_upstream()  # what the client sent while the call waited
            if not self.proto.flow.write_paused:
                self.proto.flow.resume_reading()

    def go(self, route: Route) -> None:
        """Send the call to one of ``route``'s upstreams."""
        upstream = route.pick()
        assert upstream is not None  # begin() or hold() saw upstreams; a route never changes
        self.route, self.upstream = route, upstream
        # where to connect: the upstream, or the gateway it is reached through
        gateway = route.gateway
        self.address = upstream if gateway is None else gateway.address
        conn = self.proxy.pool.take(self.address)
        if conn is None:
            self.connect()
        else:
            self.reused = True
            self.attach(conn)

    def client_body(self, body: bytes) -> None:
        if self.response_complete:
            return  # answered already (an error): the rest of the body is read and dropped
        self.total += len(body)
        if self.total > self.limit:
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
            conn = await pool.connect(self.address, self.deadline - self.proto.loop.time())
        except UpstreamError as exc:
            if not self.response_complete:
                self.fail(502, self.proxy.closed_early(self.call, self.upstream, str(exc)))
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
            opened = self.call.opened
            if opened is not None:  # a stream (what the proxy watches is one)
                opened.bytes += len(body)
                opened.chunks += 1
                if self.watched:
                    self.last_chunk = self.proto.loop.time()
            out.append(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked_out else body)
        done = conn.complete or self.is_head
        if done and self.chunked_out:
            out.append(b"0\r\n\r\n")
        transport = self.proto.transport
        if out:
            transport.write(out[0] if len(out) == 1 else b"".join(out))
        if done:
            if conn.complete and self.request_complete and not self.is_head:
                self.proxy.pool.release(self.address, conn)
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
        self.fail(502, self.proxy.closed_early(self.call, self.upstream, CLOSED_EARLY))

    def _response_head(self, conn: UpstreamConnection) -> list[bytes]:
        self.head_sent = True
        call = self.call
        call.status = status = conn.status
        METRICS.proxy_latency.observe(time.perf_counter() - call.started)
        line = STATUS_LINE.get(status) or b"HTTP/1.1 %d \r\n" % status
        out = [line]
        for name, value in self.proto.server_state.default_headers:
            out += (name, b": ", value, b"\r\n")
        headers, has_length = response_headers(
            conn.headers, conn.connection, call.request_id, not self.route.same_origin
        )
        out += headers
        if call.cold is not None:
            out.append(self.proxy.cold_start(call))
        if not (has_length or self.is_head or status == 204 or status == 304):
            self._streaming(call)
            if self.http11:
                self.chunked_out = True
                out.append(b"transfer-encoding: chunked\r\n")
            else:
                self.keep_alive = False  # HTTP/1.0: the body ends when the connection does
        if not self.keep_alive:
            out.append(b"connection: close\r\n")
        out.append(b"\r\n")
        return out

    def _streaming(self, call: Call) -> None:
        """A response of unknown length: a stream, open until it ends, and held to the
        function's stream limits by the proxy where it names them."""
        route = self.route
        call.opened = Opened(route.load, socket=False)
        self.watched = watched = route.stream_idle_sec > 0
        if watched:
            loop = self.proto.loop
            self.head_at = self.last_chunk = loop.time()
            what = f"{route.env}/{route.name}"
            self.proxy.streams.watch(self, route.stream_idle_sec, route.stream_max_sec, what, loop)

    # -- endings

    def fail(
        self, status: int, message: str, close: bool = False, retry_after: int | None = None
    ) -> None:
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
            _ERROR_HEAD % len(body),
            call.request_id,
            b"\r\n" if self.keep_alive else b"\r\nconnection: close\r\n",
            b"" if retry_after is None else b"retry-after: %d\r\n" % retry_after,
            b"\r\n",
            b"" if self.is_head else body,
        )
        self.proto.transport.write(b"".join(out))
        self._complete()

    def cut(self, why: str) -> None:
        """End a stream past its limits unfinished (the caller sees it did not finish)."""
        if self.response_complete:
            return
        self._drop_upstream()
        self.response_complete = True
        self.proto.transport.close()
        self.proxy.finish(self.call)

    def too_large(self) -> None:
        if self.head_sent:  # the upstream answered early and its response is going out
            self._drop_upstream()
            self.response_complete = True
            self.proto.transport.close()
            self.proxy.finish(self.call)
            return
        # Close: the rest of an oversized body is not worth reading.
        self.fail(413, f"request body larger than {self.limit} bytes", close=True)

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
