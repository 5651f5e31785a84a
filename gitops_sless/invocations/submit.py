"""Taking an asynchronous invocation: ``Prefer: respond-async`` on ``/fn/``, or ``/async/``.

:class:`Submitter` is the ASGI application for both. It refuses what a synchronous
call would be refused at once (an unknown function or one without an http trigger:
404, never a 202 for a function that does not exist; a disabled one: 503; a body
over the function's ``maxBodyBytes`` or the proxy's limit: 413), checks the
``X-Callback-Url`` (400 with the reason), reads the whole body, and answers ``202
Accepted`` with ``Location: /api/invocations/{id}`` and ``{"id", "status"}`` only
once the engine has stored the invocation durably. An ``Idempotency-Key`` seen
before for the same function gives the same invocation again (202, same id).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import telemetry
from ..metrics import METRICS
from ..proxy.fast import Answer
from ..proxy.http import HOP_BY_HOP, PREFIX, split_target
from ..state.routes import RouteTable
from ..telemetry.tracecontext import child_traceparent
from .engine import Engine, EngineUnavailable
from .model import Callback, Invocation, new_id

__all__ = ["ASYNC_PREFIX", "Submitter", "Taking", "wants_async"]

_log = logging.getLogger(__name__)

ASYNC_PREFIX = b"/async/"
# why a callback URL is refused (None: it is not), see .callbacks.refusal
Refusal = Callable[[str], Awaitable[str | None]]
Scope = MutableMapping[str, Any]
# kept off a stored request: what only made sense on the connection it came on (Host
# stays: a synchronous call would send it, and HTTP/1.1 servers such as Node's refuse a
# request without one)
_DROPPED = HOP_BY_HOP | {b"content-length"}


def wants_async(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether a request asks to be answered at once (RFC 7240 ``respond-async``)."""
    return any(name == b"prefer" and b"respond-async" in value.lower() for name, value in headers)


def _without_respond_async(value: bytes) -> bytes:
    """A Prefer header's other preferences (the function has no use for this one)."""
    kept = [p.strip() for p in value.split(b",") if p.strip().lower() != b"respond-async"]
    return b", ".join(p for p in kept if p)


class Submitter:
    """Takes asynchronous invocations into ``engine``: the ASGI application for both
    ways in, and the proxy's :class:`~gitops_sless.proxy.fast.Submissions` (the
    ``/fn/`` listener hands a submission over whole, without an ASGI cycle)."""

    def __init__(
        self,
        routes: RouteTable,
        engine: Engine | None,
        *,
        max_body_bytes: int,
        callback_refusal: Refusal,
        unavailable: str | None = None,
    ) -> None:
        self.routes = routes
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.callback_refusal = callback_refusal
        # why this server takes no asynchronous invocations at all (None: it does)
        self.unavailable = unavailable

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        raw = scope.get("raw_path") or scope["path"].encode("latin-1")
        client = scope.get("client")
        taking = self.head(
            scope["method"],
            raw,
            scope.get("query_string", b""),
            scope["headers"],
            client[0] if client else None,
        )
        if isinstance(taking, Taking):
            try:
                body = await _read_body(receive, taking.limit)
            except _ClientGone:  # nothing was accepted: there is nobody to tell
                answer = _answer(499, {"error": "the client left before its body was read"})
            else:
                answer = await taking.take(body) if body is not None else taking.too_large()
        else:
            answer = taking
        status, data, headers = answer
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(data)),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    def head(
        self,
        method: str,
        raw: bytes,
        query: bytes,
        request_headers: Sequence[tuple[bytes, bytes]],
        client: str | None,
    ) -> Answer | Taking:
        """The answer to a submission from its head alone (refused), or the
        :class:`Taking` that waits for its body."""
        if raw.startswith(ASYNC_PREFIX):
            raw = PREFIX + raw[len(ASYNC_PREFIX) :]
        env, name, valid, tail = split_target(raw)
        if not valid:
            return _answer(404, {"error": "function not found"})
        refused = self._refused(env, name)
        if refused is not None:
            return _answer(*refused)
        engine = self.engine
        if self.unavailable is not None or engine is None:
            reason = self.unavailable or "asynchronous invocations are off"
            return _answer(503, {"error": reason})
        route = self.routes.get(env, name)
        own = route.max_body_bytes if route is not None else None
        limit = self.max_body_bytes if own is None else min(own, self.max_body_bytes)
        kept = engine.max_body_bytes
        if kept is not None:
            limit = min(limit, kept)
        started = time.time_ns()
        headers: list[tuple[str, str]] = []
        length = None
        callback_url = key = traceparent = tracestate = None
        for raw_name, value in request_headers:
            if raw_name in _DROPPED:
                if raw_name == b"content-length":
                    length = int(value) if value.isdigit() else None
                continue
            if raw_name == b"prefer":
                value = _without_respond_async(value)
                if not value:
                    continue
            elif raw_name == b"x-callback-url":
                callback_url = value.decode("latin-1").strip()
            elif raw_name == b"idempotency-key":
                key = value.decode("latin-1").strip()[:256] or None
            elif raw_name == b"traceparent":  # two are none: a new trace
                traceparent = value.decode("latin-1") if traceparent is None else ""
                continue
            elif raw_name == b"tracestate":
                tracestate = value.decode("latin-1")
                continue
            headers.append((raw_name.decode("latin-1"), value.decode("latin-1")))
        # the submission is a span of the caller's trace (a new trace without a valid
        # one): each attempt is its child (ProxyCaller), whatever runs it and when
        trace = child_traceparent(traceparent)
        headers.append(("traceparent", trace))
        if tracestate and traceparent and trace[3:35] == traceparent[3:35]:
            headers.append(("tracestate", tracestate))
        if length is not None and length > limit:
            return _too_large(limit)
        path = "/" + tail.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        return Taking(
            self,
            engine,
            env,
            name,
            method,
            path,
            tuple(headers),
            client,
            key,
            callback_url,
            trace,
            traceparent,
            started,
            limit,
        )

    def _refused(self, env: str, name: str) -> tuple[int, dict[str, Any]] | None:
        """The answer a synchronous call would get at once, for what can never run."""
        declared = self.routes.declared(env, name)
        route = self.routes.get(env, name)
        if route is None and declared is None:
            return 404, {"error": "function not found", "env": env, "function": name}
        if route is None and declared is not None and not declared.http:
            return 404, {"error": "function has no http trigger", "env": env, "function": name}
        if route is not None and not route.plain:  # its sockets are its only calls
            error = "function has no http trigger (a websocket trigger only)"
            return 404, {"error": error, "env": env, "function": name}
        if declared is not None and declared.phase == "Disabled":
            return 503, {"error": "function disabled", "env": env, "function": name}
        return None


def _answer(
    status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> Answer:
    return status, json.dumps(body).encode(), headers or []


def _too_large(limit: int) -> Answer:
    return _answer(413, {"error": f"request body larger than {limit} bytes"})


@dataclass(slots=True)
class Taking:
    """A submission whose head is accepted: :meth:`take` stores it with its body (at
    most ``limit`` bytes, which whoever reads the body holds it to)."""

    submitter: Submitter
    engine: Engine
    env: str
    function: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    client: str | None
    key: str | None
    callback_url: str | None
    trace: str
    traceparent: str | None
    started: int  # ns
    limit: int

    def too_large(self) -> Answer:
        return _too_large(self.limit)

    async def take(self, body: bytes) -> Answer:
        """Store the invocation; 202 once it is stored durably."""
        callback_url = self.callback_url
        if callback_url is not None:
            reason = await self.submitter.callback_refusal(callback_url)
            if reason is not None:
                return _answer(400, {"error": reason})
        env, name = self.env, self.function
        invocation = Invocation(
            id=new_id(),
            env=env,
            function=name,
            method=self.method,
            path=self.path,
            headers=self.headers,
            body=body,
            created=time.time(),
            client=self.client,
            idempotency_key=self.key,
            callback=None if callback_url is None else Callback(callback_url),
        )
        try:
            stored, created = await self.engine.submit(invocation)
        except EngineUnavailable as exc:
            _log.warning("invocation of %s/%s not taken: %s", env, name, exc)
            reply = {"error": f"the queue cannot take it now: {exc}"}
            return _answer(503, reply, [(b"retry-after", b"5")])
        if created:
            METRICS.async_submitted.inc(env=env, function=name)
            telemetry.record_under(
                f"{self.method} /async/{env}/{name}",
                self.trace,
                self.traceparent,
                self.started,
                time.time_ns(),
                {"sless.environment": env, "sless.function": name, "sless.invocation": stored.id},
            )
        ident = stored.id.encode("ascii")
        data = b'{"id": "%b", "status": "%b"}' % (ident, stored.status.encode("ascii"))
        headers = [
            (b"location", b"/api/invocations/" + ident),
            (b"x-invocation-id", ident),
            (b"x-call-id", ident),  # OpenFaaS's name for it
        ]
        return 202, data, headers


class _ClientGone(Exception):
    pass


async def _read_body(receive: Any, limit: int) -> bytes | None:
    """The whole request body; None past ``limit`` bytes (the rest is not read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
