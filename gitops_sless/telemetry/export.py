"""Spans at the rate of calls, exported without the SDK's cost per span.

Each call through ``/fn/`` is a span, and so is each function's own (relayed from
the local runtimes): as many as the proxy answers calls. The OpenTelemetry SDK
spends some 50 µs of the proxy's CPU on each (creating the span, then encoding it
as protobuf messages), which would take a third of the proxy's throughput.
Here a call's span is a tuple appended to a bounded queue (the oldest dropped,
and counted, when the collector cannot keep up); one thread takes them in
batches (every ``DELAY_SEC``, or ``BATCH`` at once), writes the OTLP protobuf
itself (a few fields, no schema at run time: the encoding is checked against
``opentelemetry-proto`` in the tests) and posts it to the collector, as the SDK's
exporter would (the same URL, the ``OTEL_EXPORTER_OTLP_*HEADERS``). Spans of
reconcile passes, a few per pass, stay with the SDK (``telemetry``).
"""

from __future__ import annotations

import collections
import http.client
import logging
import os
import struct
import threading
import time
from binascii import unhexlify
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = [
    "BATCH",
    "DELAY_SEC",
    "MAX_QUEUE",
    "CallSpan",
    "Span",
    "SpanBatch",
    "call_fields",
    "encode",
]

log = logging.getLogger(__name__)

BATCH = 512
DELAY_SEC = 1.0
MAX_QUEUE = 16384
TIMEOUT_SEC = 10.0
SERVER, INTERNAL = 2, 1  # SpanKind

# (name, trace id, span id, parent span id or None, start ns, end ns, attributes,
#  error message or None, kind, service or None for the reconciler's own)
Span = tuple[str, int, int, int | None, int, int, Mapping[str, Any], str | None, int, str | None]
# A call's span through the proxy, the most frequent, as cheaply as it can be made:
# (the traceparent it was sent with, for the trace and span ids; the caller's span id
#  in hex or None; start ns; end ns; its name, kind and attributes encoded, the same for
#  many calls (:func:`call_fields`); error message or None)
CallSpan = tuple[bytes, bytes | None, int, int, bytes, str | None]


class SpanBatch:
    """The queue of spans and the thread that posts them to ``url`` (…/v1/traces)."""

    def __init__(self, url: str, service: str, headers: Mapping[str, str] | None = None) -> None:
        self.url, self.service = url, service
        self.headers = {"content-type": "application/x-protobuf", **(headers or {})}
        self.dropped = 0  # spans the queue had no room for, or the collector refused
        self._queue: collections.deque[Span | CallSpan] = collections.deque(maxlen=MAX_QUEUE)
        self._wake = threading.Event()
        self._stop = False
        self._connection: http.client.HTTPConnection | None = None
        parts = urlsplit(url)
        self._path = parts.path + (f"?{parts.query}" if parts.query else "")
        self._thread = threading.Thread(target=self._run, name="sless-spans", daemon=True)
        self._thread.start()

    def add(self, span: Span | CallSpan) -> None:
        queue = self._queue
        if len(queue) == MAX_QUEUE:
            self.dropped += 1  # the append below pushes the oldest out
        queue.append(span)
        if len(queue) == BATCH:  # once a batch: waking a woken thread costs a lock
            self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Post what is queued (within ``timeout``), then stop."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        queue = self._queue
        while True:
            self._wake.wait(DELAY_SEC)
            self._wake.clear()
            stopping = self._stop
            waiting = len(queue)  # what comes during a post waits for the next look
            while waiting > 0 or (stopping and queue):
                batch = [queue.popleft() for _ in range(min(BATCH, len(queue)))]
                if not batch:
                    break
                waiting -= len(batch)
                try:
                    self._post(encode(batch, self.service))
                except Exception:  # one bad span must not end the thread, and all after it
                    self.dropped += len(batch)
                    log.exception("%d spans could not be exported", len(batch))
            if stopping:
                if self._connection is not None:
                    self._connection.close()
                return

    def _post(self, body: bytes) -> None:
        """One batch, tried twice on one kept-alive connection (a new one after an
        error); dropped, and said once a batch, when the collector will not take it."""
        why = ""
        for attempt in (1, 2):
            try:
                if self._connection is None:
                    self._connection = self._connect()
                self._connection.request("POST", self._path, body, self.headers)
                reply = self._connection.getresponse()
                reply.read()
            except (OSError, http.client.HTTPException) as exc:
                why = str(exc) or type(exc).__name__
                if self._connection is not None:
                    self._connection.close()
                self._connection = None
            else:
                if 200 <= reply.status < 300:
                    return
                why = f"HTTP {reply.status}"
                if reply.status not in (429, 502, 503, 504):
                    break
            if attempt == 1:
                time.sleep(1.0)
        self.dropped += 1
        log.warning("spans not exported to %s: %s", self.url, why)

    def _connect(self) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        if parts.scheme == "https":
            return http.client.HTTPSConnection(parts.netloc, timeout=TIMEOUT_SEC)
        return http.client.HTTPConnection(parts.netloc, timeout=TIMEOUT_SEC)


def headers_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``OTEL_EXPORTER_OTLP_HEADERS`` and ``..._TRACES_HEADERS`` (``k=v,k2=v2``, values
    URL-encoded), as the SDK's exporter reads them; the traces' own win."""
    found: dict[str, str] = {}
    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        for pair in environ.get(name, "").split(","):
            key, sep, value = pair.partition("=")
            if sep and key.strip():
                found[key.strip().lower()] = unquote(value.strip())
    return found


# --- OTLP protobuf (opentelemetry/proto/trace/v1/trace.proto), written by hand ----------


def _varint(value: int) -> bytes:
    """An int64 (or uint64) as a base-128 varint; ValueError outside them: no collector
    decodes more than ten bytes."""
    if 0 <= value < 128:
        return _SMALL[value]
    if not -(1 << 63) <= value < 1 << 64:
        raise ValueError(f"{value} is out of int64")
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL = [bytes((n,)) for n in range(128)]


def _field(key: int, payload: bytes) -> bytes:
    """A length-delimited field (``key`` is its tag, shifted, with wire type 2)."""
    size = len(payload)
    if size < 128:
        return bytes((key, size)) + payload
    return bytes((key,)) + _varint(size) + payload


def _attribute(key: str, value: Any) -> bytes:
    """A span's attribute field (a KeyValue)."""
    return _field(0x4A, _key_value(key, value))


def _key_value(key: str, value: Any) -> bytes:
    """A KeyValue message. Not remembered: a call's span is encoded once for many calls
    (:func:`call_fields`), and what the runtimes send differs from span to span."""
    if isinstance(value, bool):
        any_value = b"\x10" + _varint(int(value))
    elif isinstance(value, int):
        any_value = b"\x18" + _varint(value)
    elif isinstance(value, float):
        any_value = b"\x21" + struct.pack("<d", value)
    else:
        any_value = _field(0x0A, str(value).encode("utf-8", "replace"))
    return _field(0x0A, key.encode("utf-8", "replace")) + _field(0x12, any_value)


def call_fields(name: str, values: Mapping[str, Any]) -> bytes:
    """The fields a call's span shares with many: its name, its kind (SERVER) and its
    attributes, encoded (a message's fields may come in any order)."""
    encoded = b"".join(_attribute(key, value) for key, value in values.items())
    return _field(0x2A, name.encode("utf-8", "replace")) + b"\x30\x02" + encoded


_pack_times = struct.Struct("<BQBQ").pack


def _span(span: Span) -> bytes:
    name, trace_id, span_id, parent_id, start, end, values, error, kind, _ = span
    parts = [
        b"\x0a\x10" + trace_id.to_bytes(16, "big"),
        b"\x12\x08" + span_id.to_bytes(8, "big"),
    ]
    if parent_id:
        parts.append(b"\x22\x08" + parent_id.to_bytes(8, "big"))
    parts.append(_field(0x2A, name.encode("utf-8", "replace")))
    parts.append(b"\x30" + _varint(kind))
    parts.append(_pack_times(0x39, start, 0x41, end))
    parts += [_attribute(key, value) for key, value in values.items()]
    if error is not None:  # Status{message = 2, code = 3: STATUS_CODE_ERROR}
        parts.append(_field(0x7A, _field(0x12, error.encode("utf-8", "replace")) + b"\x18\x02"))
    return _field(0x12, b"".join(parts))  # ScopeSpans.spans


def _call_span(span: CallSpan) -> bytes:
    traceparent, caller, start, end, shared, error = span
    encoded = (
        b"\x0a\x10"
        + unhexlify(traceparent[3:35])
        + b"\x12\x08"
        + unhexlify(traceparent[36:52])
        + (b"\x22\x08" + unhexlify(caller) if caller else b"")
        + _pack_times(0x39, start, 0x41, end)
        + shared
    )
    if error is not None:
        encoded += _field(0x7A, _field(0x12, error.encode("utf-8", "replace")) + b"\x18\x02")
    return _field(0x12, encoded)


def encode(spans: list[Span | CallSpan], service: str) -> bytes:
    """An ExportTraceServiceRequest of ``spans``: one ResourceSpans per service (calls'
    spans are the reconciler's)."""
    by_service: dict[str, list[bytes]] = {service: []}
    bad = 0
    for span in spans:
        try:
            if len(span) == 6:
                by_service[service].append(_call_span(span))  # type: ignore[arg-type]
            else:
                encoded = _span(span)  # type: ignore[arg-type]
                by_service.setdefault(span[9] or service, []).append(encoded)  # type: ignore[misc]
        except (ValueError, TypeError, AttributeError, struct.error):
            bad += 1  # left out: the batch goes without it
    if bad:
        log.warning("%d spans could not be encoded and were left out", bad)
    scope = _field(0x0A, _field(0x0A, b"gitops_sless"))  # ScopeSpans.scope
    out = []
    for name, encoded in by_service.items():
        if not encoded:
            continue
        resource = _field(0x0A, _field(0x0A, _key_value("service.name", name)))
        scope_spans = _field(0x12, scope + b"".join(encoded))
        out.append(_field(0x0A, resource + scope_spans))
    return b"".join(out)
