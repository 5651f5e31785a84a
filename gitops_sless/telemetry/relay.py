"""Spans that the local backend's runtimes send, exported on their behalf.

The runtimes stay standard-library only: with ``SLESS_OTLP_ENDPOINT`` they send each
call's span as OTLP/HTTP JSON. On the local backend that endpoint is the reconciler's
own (``POST /internal/otlp/v1/traces``), with the replica's key as a bearer token; the
key says which function sent them, so each span goes out under that function's service
name (``<env>/<name>``) whatever the body claims, through the reconciler's exporter:
one collector, one batch, and the collector's address never given to user code. In a
cluster the runtime sends to the collector itself.
"""

from __future__ import annotations

import json
from typing import Any

from . import record

__all__ = ["MAX_BODY_BYTES", "BadSpans", "relay"]

MAX_BODY_BYTES = 4 << 20
_HEX16 = frozenset("0123456789abcdef")


class BadSpans(ValueError):
    """The body is not OTLP/HTTP JSON spans: answered 400, nothing of it exported."""


MAX_SPANS = 2048  # in one post: a function cannot push the others' spans out of the queue
MAX_KEY = 128  # an attribute's name
MAX_VALUE = 1000  # an attribute's text, a name, a status message
MAX_ATTRIBUTES = 64
_INT64 = range(-(1 << 63), 1 << 63)
_TIME = range(0, 1 << 64)
# what a function says of itself cannot say it is another
_OURS = ("faas.name", "sless.environment", "sless.function")


def relay(body: bytes, env: str, function: str) -> int:
    """Export the spans of ``body`` (OTLP/HTTP JSON) as ``env``/``function``'s; how many.
    Everything is checked before anything is exported: a bad span refuses the post."""
    try:
        document = json.loads(body)
        spans = [
            span
            for resource in document["resourceSpans"]
            for scope in resource.get("scopeSpans", ())
            for span in scope.get("spans", ())
        ]
        if len(spans) > MAX_SPANS:
            raise ValueError(f"more than {MAX_SPANS} spans in one post")
        checked = [_span(span, env, function) for span in spans]
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise BadSpans(f"not OTLP/HTTP JSON spans: {type(exc).__name__}: {exc}") from None
    service = f"{env}/{function}"
    for name, ids, start, end, attributes, error, server in checked:
        record(name, ids, start, end, attributes, error=error, server=server, service=service)
    return len(checked)


def _span(span: dict[str, Any], env: str, function: str) -> tuple[Any, ...]:
    ids = _ids(span)
    start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
    if start not in _TIME or end not in _TIME:
        raise ValueError("times are nanoseconds since the epoch, 0 to 2**64")
    status = span.get("status") or {}
    if not isinstance(status, dict):
        raise TypeError("status is an object")
    error = None
    if status.get("code") == 2:
        error = str(status.get("message") or "failed")[:MAX_VALUE]
    attributes = _attributes(span.get("attributes"))
    attributes.update({"faas.name": function, "sless.environment": env, "sless.function": function})
    name = str(span.get("name") or function)[:MAX_VALUE]
    return name, ids, start, end, attributes, error, span.get("kind") == 2


def _ids(span: dict[str, Any]) -> tuple[int, int, int | None, bool]:
    trace, own, parent = span["traceId"], span["spanId"], span.get("parentSpanId") or ""
    if not all(isinstance(x, str) for x in (trace, own, parent)):
        raise TypeError("ids are strings")
    if len(trace) != 32 or len(own) != 16 or (parent and len(parent) != 16):
        raise ValueError("traceId has 32 hex digits, spanId and parentSpanId 16")
    if not set(trace + own + parent) <= _HEX16:
        raise ValueError("ids are lower-case hex")
    ids = int(trace, 16), int(own, 16)
    if not all(ids):
        raise ValueError("ids are not all zeros")
    # a span the runtime sends was sampled: it sends none of a trace not sampled
    return ids[0], ids[1], int(parent, 16) if parent else None, True


def _attributes(raw: Any) -> dict[str, str | int | float | bool]:
    """OTLP JSON attributes ([{key, value: {stringValue | intValue | ...}}]), plain and
    bounded (names, texts, how many); ints out of int64 and bad values refuse the post."""
    found: dict[str, str | int | float | bool] = {}
    for item in raw if isinstance(raw, list) else ():
        if len(found) >= MAX_ATTRIBUTES:
            break
        if not isinstance(item, dict) or not isinstance(item.get("key"), str):
            continue
        key, value = item["key"][:MAX_KEY], item.get("value") or {}
        if not isinstance(value, dict) or key in _OURS:
            continue
        if "stringValue" in value:
            found[key] = str(value["stringValue"])[:MAX_VALUE]
        elif "intValue" in value:
            number = int(value["intValue"])
            if number not in _INT64:
                raise ValueError(f"attribute {key!r}: intValue out of int64")
            found[key] = number
        elif "boolValue" in value:
            found[key] = bool(value["boolValue"])
        elif "doubleValue" in value:
            found[key] = float(value["doubleValue"])
    return found
