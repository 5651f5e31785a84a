"""Keep-alive HTTP/1.1 connections from the invoke proxy to function upstreams.

One :class:`UpstreamConnection` is an asyncio protocol that writes a request
head and body, and parses the response with httptools as bytes arrive. The
:class:`Pool` keeps idle connections per address (an upstream, or a route's
:class:`~gitops_sless.state.routes.Gateway`: host, port and TLS) and hands out the
most recently used first (LIFO), so a steady load runs on a few warm sockets
and the rest time out on the server's side.

Everything here runs on the event loop thread; nothing takes a lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httptools

from ..errors import TransientError
from ..state.routes import Address

__all__ = ["CLOSED_EARLY", "Pool", "UpstreamConnection", "UpstreamError"]

# The runtime servers close idle connections after 75 s; stop reusing ours well before,
# so a request never races the server's close.
IDLE_SEC = 60.0
MAX_IDLE_PER_UPSTREAM = 256
# Upstream body bytes buffered for a slow client before reading from the upstream pauses.
READ_HIGH_WATER = 256 * 1024
# How often deadlines are checked while calls wait for a response head. One sweep for
# all calls is cheaper than a timer per call, and a timeout is late by at most this.
SWEEP_SEC = 0.05
# The 502 error when the upstream hung up (or answered garbage) before a response head.
CLOSED_EARLY = "upstream closed the connection before a response"


class UpstreamError(TransientError):
    """The upstream failed before a response head arrived: refused, reset, or not HTTP.

    Never leaves the proxy: it becomes a 502 for the caller, its message the error."""


class UpstreamConnection(asyncio.Protocol):
    """One connection to one upstream, carrying one request at a time.

    The parser callbacks fill ``status``, ``headers`` and ``chunks``. Whoever
    carries the request learns that something changed (data, close, timeout,
    writable again) either by awaiting :meth:`wait` or, without a task, through
    the ``notify`` callback; both then re-check the state.
    """

    __slots__ = (
        "_key",
        "_parser",
        "_pool",
        "_waiter",
        "buffered",
        "chunks",
        "closed",
        "complete",
        "connection",
        "deadline",
        "framed",
        "head_done",
        "headers",
        "idle_since",
        "keep",
        "loop",
        "notify",
        "received",
        "status",
        "timed_out",
        "transport",
        "write_paused",
    )

    def __init__(self, pool: Pool, key: Address, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._key = key
        self.loop = loop
        self.deadline = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.write_paused = False
        self.idle_since = 0.0
        self.notify: Callable[[], None] | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the previous response before the next request."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.connection: bytes | None = None  # the Connection header: it names more hop-by-hop
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.head_done = False
        self.complete = False
        self.framed = False
        self.keep = False
        self.received = False
        self.timed_out = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()
        self._wake()

    def eof_received(self) -> bool:
        # A response without Content-Length or chunked framing ends when the server closes.
        if self.head_done and not self.framed:
            self.complete = True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self._key, self)
        self._wake()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake()

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"connection":
            self.connection = value
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            # 1xx interim responses are not forwarded: the client is answered by its own server.
            self.headers = []
            self.connection = None
            return
        self.status = status
        self.head_done = True
        for name, _ in self.headers:
            if name == b"content-length" or name == b"transfer-encoding":
                self.framed = True
                break
        else:
            self.framed = status == 204 or status == 304

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > READ_HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True
            self.keep = self._parser.should_keep_alive()

    # -- used by the request task

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def wait(self) -> None:
        """Until data, a close, a timeout or writability; callers re-check the state."""
        # Not asyncio.get_running_loop(): on Python 3.11 each call costs a getpid() syscall.
        waiter = self._waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def take_body(self) -> bytes:
        """The body bytes received so far, resuming reads that a full buffer paused."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        if self.buffered > READ_HIGH_WATER and self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self.buffered = 0
        return data

    def expire(self) -> None:
        """The route's timeout passed before the response head arrived."""
        self.timed_out = True
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _wake(self) -> None:
        notify = self.notify
        if notify is not None:
            notify()
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Pool:
    """Idle keep-alive connections per address, most recently used first.

    An address is an upstream's ``(host, port)``, reached over plain HTTP, or a
    gateway's ``(host, port, context, server_hostname)``, reached over TLS with
    that :class:`ssl.SSLContext` (a connection made with one context, and its
    client certificate, serves only calls that name the same context).
    """

    def __init__(self) -> None:
        self._idle: dict[Address, list[UpstreamConnection]] = {}
        self._waiting: set[UpstreamConnection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self.opened = 0  # connections ever opened: tests check that keep-alive works

    def take(self, key: Address) -> UpstreamConnection | None:
        """An idle connection to ``key``, the most recently used, or None."""
        idle = self._idle.get(key)
        if idle:
            stale = time.monotonic() - IDLE_SEC
            while idle:
                conn = idle.pop()
                if not conn.closed and conn.idle_since > stale:
                    conn.reset()
                    return conn
                conn.close()
        return None

    async def connect(self, key: Address, timeout: float) -> UpstreamConnection:
        """A new connection to ``key``; UpstreamError if it cannot be made within ``timeout``.

        Over TLS the handshake is part of it, and so is a certificate that fails checks.
        """
        loop = asyncio.get_running_loop()
        tls = {} if len(key) == 2 else {"ssl": key[2], "server_hostname": key[3]}
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self, key, loop), key[0], key[1], **tls
                )
        except (OSError, TimeoutError) as exc:
            message = f"upstream unavailable: cannot connect to {key[0]}:{key[1]}: {exc}"
            raise UpstreamError(message) from exc
        self.opened += 1
        return conn

    def release(self, key: Address, conn: UpstreamConnection) -> None:
        """Back to the pool after a complete response, or closed if it cannot carry another."""
        conn.notify = None
        if conn.closed or not conn.keep or conn.chunks:
            conn.close()
            return
        idle = self._idle.get(key)
        if idle is None:
            idle = self._idle[key] = []
        if len(idle) >= MAX_IDLE_PER_UPSTREAM:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def watch(self, conn: UpstreamConnection, deadline: float) -> None:
        """Expire ``conn`` if its response head has not come by ``deadline`` (loop time)."""
        conn.deadline = deadline
        self._waiting.add(conn)
        if self._sweeper is None:
            self._sweeper = conn.loop.call_later(SWEEP_SEC, self._sweep, conn.loop)

    def unwatch(self, conn: UpstreamConnection) -> None:
        self._waiting.discard(conn)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for conn in [conn for conn in self._waiting if conn.deadline <= now]:
            self._waiting.discard(conn)
            conn.expire()
        self._sweeper = loop.call_later(SWEEP_SEC, self._sweep, loop) if self._waiting else None

    def forget(self, key: Address, conn: UpstreamConnection) -> None:
        idle = self._idle.get(key)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_count(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()
