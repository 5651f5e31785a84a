"""The proxy's span of each call, when spans are exported (``serve --otlp-endpoint``).

The traceparent a call went on with names the proxy's span as its parent
(``http.request_head``); once the call ends, the span is recorded with those ids,
under the caller's span when it sent one: the function's own span, and whatever it
calls, are its children. Nothing of this runs without ``telemetry.ON``.

A call's span costs it about a microsecond: its name and attributes are encoded once
for each function, method, status and revision (remembered), its ids are handed over
as the hex they were sent in, and everything else happens in the exporter's thread
(:mod:`gitops_sless.telemetry.export`).
"""

from __future__ import annotations

import time
from typing import Any

from .. import telemetry
from ..state.routes import RouteTable
from ..telemetry import export as spanexport
from .http import Call

__all__ = ["record_span"]

_SAMPLED = frozenset(b"13579bdf")  # the last hex digit of the flags: sampled when odd
# (env, route name, method, status, cold start) -> (the revision aliases it was encoded
# under, the span's name, kind and attributes encoded): a promotion changes the aliases
_ENCODED: dict[tuple[str, str, str, int, bool], tuple[Any, bytes]] = {}


def record_span(call: Call, status: int, routes: RouteTable) -> None:
    """The proxy's span of ``call`` (``call.trace`` set), answered ``status``."""
    forwarded, caller = call.trace  # type: ignore[misc]
    if forwarded[54] not in _SAMPLED:
        return
    aliases = routes.revision_aliases(call.env, call.name.partition("@")[0])
    key = (call.env, call.name, call.method, status, call.cold is not None)
    found = _ENCODED.get(key)
    if found is None or found[0] is not aliases:
        found = _encoded(key, routes, aliases)
    error = f"HTTP {status}" if status >= 500 else None
    telemetry.record_call(
        (forwarded, caller, int(call.wall * 1e9), time.time_ns(), found[1], error)
    )


def _encoded(
    key: tuple[str, str, str, int, bool], routes: RouteTable, aliases: Any
) -> tuple[Any, bytes]:
    env, route, method, status, cold = key
    name = route.partition("@")[0]
    attributes = {
        "sless.environment": env,
        "sless.function": name,
        "sless.revision": routes.revision_number(env, route) or "",
        "http.request.method": method,
        "http.response.status_code": status,
        "sless.cold_start": cold,
    }
    if len(_ENCODED) >= 4096:
        _ENCODED.clear()
    found = (aliases, spanexport.call_fields(f"{method} /fn/{env}/{name}", attributes))
    _ENCODED[key] = found
    return found
