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
    """The body is not OTLP/HTTP JSON spans: answered 400."""


def relay(body: bytes, env: str, function: str) -> int:
    """Export the spans of ``body`` (OTLP/HTTP JSON) as ``env``/``function``'s; how many."""
    try:
        document = json.loads(body)
        spans = [
            span
            for resource in document["resourceSpans"]
            for scope in resource.get("scopeSpans", ())
            for span in scope.get("spans", ())
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadSpans(f"not OTLP/HTTP JSON spans: {exc}") from None
    service = f"{env}/{function}"
    for span in spans:
        try:
            ids = _ids(span)
            start, end = int(span["startTimeUnixNano"]), int(span["endTimeUnixNano"])
        except (ValueError, KeyError, TypeError) as exc:
            raise BadSpans(f"a span without valid ids or times: {exc}") from None
        status = span.get("status") or {}
        error = (status.get("message") or "failed") if status.get("code") == 2 else None
        attributes = {**_attributes(span.get("attributes")), "sless.environment": env}
        attributes["faas.name"] = function
        record(
            str(span.get("name") or function)[:200],
            ids,
            start,
            end,
            attributes,
            error=error,
            server=span.get("kind") == 2,
            service=service,
        )
    return len(spans)


def _ids(span: dict[str, Any]) -> tuple[int, int, int | None, bool]:
    trace, own, parent = span["traceId"], span["spanId"], span.get("parentSpanId") or ""
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
    """OTLP JSON attributes ([{key, value: {stringValue | intValue | ...}}]), plain."""
    found: dict[str, str | int | float | bool] = {}
    for item in raw if isinstance(raw, list) else ():
        if not isinstance(item, dict) or not isinstance(item.get("key"), str):
            continue
        value = item.get("value") or {}
        if "stringValue" in value:
            found[item["key"]] = str(value["stringValue"])[:1000]
        elif "intValue" in value:
            found[item["key"]] = int(value["intValue"])
        elif "boolValue" in value:
            found[item["key"]] = bool(value["boolValue"])
        elif "doubleValue" in value:
            found[item["key"]] = float(value["doubleValue"])
    return dict(list(found.items())[:64])
