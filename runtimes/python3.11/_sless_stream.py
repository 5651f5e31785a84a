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


def is_stream(value) -> bool:
    """Whether ``value`` is something a handler streams: an iterator (a generator) or an
    async iterator, never a str, bytes, mapping or list (those are one body)."""
    return hasattr(value, "__next__") or hasattr(value, "__anext__")


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
    handler's iteration (``GeneratorExit`` inside a generator, ``aclose()`` for an async
    one) when nobody reads any more."""

    __slots__ = ("_close", "_loop", "_next")

    def __init__(self, stream) -> None:
        self._loop = None
        if hasattr(stream, "__anext__"):
            import asyncio  # only for async streams

            loop = self._loop = asyncio.new_event_loop()
            anext_ = stream.__anext__
            aclose = getattr(stream, "aclose", None)

            def next_value():
                try:
                    return loop.run_until_complete(anext_())
                except StopAsyncIteration:
                    raise StopIteration from None

            def close():
                if aclose is not None:
                    loop.run_until_complete(aclose())

            self._next, self._close = next_value, close
        else:
            self._next = stream.__next__
            self._close = getattr(stream, "close", None) or (lambda: None)

    def next_value(self):
        return self._next()

    def close(self) -> None:
        """End the handler's iteration (its ``finally`` blocks run); errors are its own."""
        try:
            self._close()
        finally:
            if self._loop is not None:
                self._loop.close()
                self._loop = None


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
