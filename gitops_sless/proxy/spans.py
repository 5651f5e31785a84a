"""The proxy's span of each call, when spans are exported (``serve --otlp-endpoint``).

The traceparent a call went on with names the proxy's span as its parent
(``http.request_head``); once the call ends, the span is recorded with those ids,
under the caller's span when it sent one: the function's own span, and whatever it
calls, are its children. Nothing of this runs without ``telemetry.ON``.
"""

from __future__ import annotations

import logging
import time

from .. import telemetry
from ..state.routes import RouteTable
from .http import Call

__all__ = ["record_span"]

_log = logging.getLogger(__name__)


def record_span(call: Call, status: int, routes: RouteTable) -> None:
    """The proxy's span of ``call`` (``call.trace`` set), answered ``status``."""
    forwarded, caller = call.trace  # type: ignore[misc]
    name = call.name.partition("@")[0]
    attributes = {
        "sless.environment": call.env,
        "sless.function": name,
        "sless.revision": routes.revision_number(call.env, call.name) or "",
        "http.request.method": call.method,
        "http.response.status_code": status,
        "sless.cold_start": call.cold is not None,
    }
    text = forwarded.decode("ascii")
    sampled = bool(int(text[53:55], 16) & 1)
    ids = (int(text[3:35], 16), int(text[36:52], 16), int(caller, 16) if caller else None, sampled)
    try:
        telemetry.record(
            f"{call.method} /fn/{call.env}/{name}",
            ids,
            int(call.wall * 1e9),
            time.time_ns(),
            attributes,
            error=f"HTTP {status}" if status >= 500 else None,
            server=True,
        )
    except Exception:  # a span lost must not break the call it describes
        _log.exception("recording the span of %s failed", call.request_id.decode())
