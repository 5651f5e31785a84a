"""A streamed response's pieces, loaded by ``_sless_server`` the first time a handler
returns a stream (a start never pays for it).

A handler streams by returning (or being) a generator or an async generator, or a
``{"statusCode": .., "body": <one of those>}`` mapping. Each value it yields is one
chunk, sent as soon as it is produced: bytes as they are, str as UTF-8, anything else
as JSON (followed by a newline where the response is ``application/x-ndjson``, which a
bare stream of such values is). An empty value sends nothing: a zero-length chunk would
end the response.

``sse`` formats one server-sent event; handlers reach it as ``context.sse``.
"""

from __future__ import annotations

import json

NDJSON = "application/x-ndjson"
EVENT_STREAM = "text/event-stream"


def is_empty(value) -> bool:
    """Whether a stream's ``value`` sends nothing (an empty chunk would end the response)."""
    return isinstance(value, (str, bytes, bytearray, memoryview)) and len(value) == 0


def content_type_of(first) -> str:
    """The Content-Type of a stream that names none, from its first value."""
    if isinstance(first, (bytes, bytearray, memoryview)):
        return "application/octet-stream"
    if isinstance(first, str):
        return "text/plain; charset=utf-8"
    return NDJSON


def encoder(content_type: str, encode_json):
    """``encode(value) -> bytes`` for the chunks of a response of ``content_type``."""
    newline = content_type.split(";", 1)[0].strip().lower() == NDJSON

    def encode(value) -> bytes:
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        if isinstance(value, str):
            return value.encode()
        text = encode_json(value)
        return (text + "\n").encode() if newline else text.encode()

    return encode


class Values:
    """The values of a handler's stream, one at a time, from the thread that serves it:
    ``next_value()`` (raises StopIteration at the end) and ``close()``, which ends the
    handler's iteration if it has not ended (``GeneratorExit`` inside a generator,
    ``aclose()`` for an async one) and frees what an async stream ran on.

    ``runner``: the ``asyncio.Runner`` an async handler ran on, kept open for its stream
    (what it made there, a client's connection, belongs to that loop)."""

    __slots__ = ("_close", "_next", "_runner")

    def __init__(self, stream, runner=None) -> None:
        self._runner = None
        if hasattr(stream, "__anext__"):
            if runner is None:
                import asyncio  # only for async streams

                runner = asyncio.Runner()
            self._runner = runner
            anext_ = stream.__anext__
            aclose = getattr(stream, "aclose", None)

            def next_value():
                try:
                    return runner.run(anext_())
                except StopAsyncIteration:
                    raise StopIteration from None

            def close():
                if aclose is not None:
                    runner.run(aclose())

            self._next, self._close = next_value, close
        else:
            if runner is not None:  # the handler's loop, not needed by a plain iterator
                runner.close()
            self._next = stream.__next__
            self._close = getattr(stream, "close", None) or (lambda: None)

    def next_value(self):
        return self._next()

    def close(self) -> None:
        """End the handler's iteration (its ``finally`` blocks run), free its loop; what the
        handler raises then is its own."""
        try:
            self._close()
        finally:
            runner, self._runner = self._runner, None
            if runner is not None:
                runner.close()  # its tasks cancelled, its async generators shut down


def sse(data=None, event: str | None = None, id: str | None = None, retry: int | None = None):
    """One server-sent event (``text/event-stream``): ``event:``, ``id:``, ``retry:`` and
    one ``data:`` line per line of ``data`` (a str as it is, anything else as JSON)."""
    lines = []
    for name, value in (("event", event), ("id", id)):
        if value is not None:
            value = str(value)
            if "\n" in value or "\r" in value:
                raise ValueError(f"an event's {name} cannot hold a line break")
            lines.append(f"{name}: {value}")
    if retry is not None:
        lines.append(f"retry: {int(retry)}")
    if data is not None:
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        lines += [f"data: {line}" for line in text.split("\n")]
    return "\n".join(lines) + "\n\n"


class RequestBody:
    """A request's body read as the handler asks for it (``stream: {request: true}``):
    ``event["_stream"]``, a binary file-like object (``read``, ``read1``, ``readinto``,
    iteration by chunks). Nothing is held but what one read returns, so an upload larger
    than memory flows through; the proxy's ``maxBodyBytes`` bounds it on the way.

    ``conn.buf`` holds what was received past the request's head; what this reads is
    taken from there first, then from the socket. ``done`` once the whole body is read
    (else the connection cannot carry another request). A client that leaves mid-body
    raises ``ConnectionError``; a malformed chunked body ``ValueError``."""

    CHUNK = 65536

    def __init__(self, conn, sock, chunked: bool, length: int) -> None:
        self._conn = conn
        self._sock = sock
        self._chunked = chunked
        self._left = length  # Content-Length: bytes still to come
        self._in_chunk = 0  # chunked: bytes left in the current chunk
        self.done = not chunked and length == 0

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        data = self._sock.recv(self.CHUNK)
        if not data:
            raise ConnectionError("the client closed the connection before the body's end")
        self._conn.buf += data

    def _take(self, count: int) -> bytes:
        """Up to ``count`` bytes (at least one) of what has come."""
        conn = self._conn
        if not conn.buf:
            self._fill()
        data = conn.buf[:count]
        conn.buf = conn.buf[len(data) :]
        return data

    def _line(self) -> bytes:
        conn = self._conn
        while b"\r\n" not in conn.buf:
            if len(conn.buf) > 8192:
                raise ValueError("invalid chunked body: a line too long")
            self._fill()
        line, _, conn.buf = conn.buf.partition(b"\r\n")
        return line

    def read1(self, size: int = -1) -> bytes:
        """What has come, up to ``size`` bytes (b"": the end)."""
        if self.done:
            return b""
        if size < 0:
            size = self.CHUNK
        if not self._chunked:
            data = self._take(min(size, self._left))
            self._left -= len(data)
            self.done = self._left == 0
            return data
        if self._in_chunk == 0:
            text = self._line().split(b";", 1)[0].strip()
            try:
                self._in_chunk = int(text, 16)
            except ValueError:
                raise ValueError(f"invalid chunk size {text[:20]!r}") from None
            if self._in_chunk == 0:
                while self._line():  # trailer fields, up to the empty line
                    pass
                self.done = True
                return b""
        data = self._take(min(size, self._in_chunk))
        self._in_chunk -= len(data)
        if self._in_chunk == 0 and self._line() != b"":
            raise ValueError("invalid chunked body: no CRLF after a chunk")
        return data

    def read(self, size: int = -1) -> bytes:
        """``size`` bytes, fewer only at the end; all that is left with ``size`` < 0."""
        parts = []
        want = size
        while want != 0:
            data = self.read1(self.CHUNK if want < 0 else want)
            if not data:
                break
            parts.append(data)
            if want > 0:
                want -= len(data)
        return b"".join(parts)

    def readinto(self, buffer) -> int:
        data = self.read1(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def __iter__(self):
        while data := self.read1():
            yield data
