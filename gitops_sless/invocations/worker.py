"""One attempt of an asynchronous invocation, and what its outcome means.

An attempt is the synchronous call the client would have made: the stored request
goes through the ``/fn/`` proxy in this process (:class:`ProxyCaller` drives its
ASGI application directly, with no socket), so it meets every rule a call meets
(the activator wakes a function scaled to zero and holds the call, the function's
``concurrency`` and ``rateLimit`` apply, its load counts toward the autoscaler's
demand, its timeout answers 504) and the function sees the same request, with
``X-Invocation-Id`` and ``X-Invocation-Attempt`` added.

:class:`Runner` decides what the answer means, the same for every engine:

- below 400: ``succeeded``;
- 408, 429 and 5xx (the proxy's 502 for a crash or a refused connection, its
  504 for a timeout), or no answer at all: tried again after the function's
  ``backoff`` doubled for each failure so far, capped at ``maxBackoff``, plus up to
  20 % jitter, or after the function's ``Retry-After`` if that is longer; ``dead``
  when ``retries`` are spent or when the next attempt would start after ``maxAge``;
- any other 4xx: ``failed``, at once (the request itself is wrong: trying it again
  cannot help);
- an invocation older than ``maxAge`` is ``dead`` before any attempt starts.

The response of the last attempt is kept (body up to
:data:`~.model.MAX_RESPONSE_BYTES`). An ended invocation with a callback has it
``pending``: the service delivers it (:mod:`.callbacks`).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

from .. import telemetry
from ..manifests import durations
from ..manifests.model import DEFAULT_ASYNC, AsyncPolicy
from ..metrics import METRICS
from ..state.routes import RouteTable
from ..telemetry.tracecontext import child_traceparent
from .engine import Save
from .model import (
    DEAD,
    FAILED,
    MAX_RESPONSE_BYTES,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Attempt,
    Invocation,
    Response,
)

__all__ = ["Answer", "Caller", "ProxyCaller", "Runner", "retry_after"]

_log = logging.getLogger(__name__)

# a cold start on top of the function's timeout, before an engine redelivers an attempt
START_MARGIN_SEC = 30.0
JITTER = 0.2
_RETRIED = frozenset({408, 429})
_FRAMING = frozenset({"content-length", "transfer-encoding"})
# a function in these phases without a route will serve soon: its invocations wait
_COMING = frozenset({"Pending", "Building", "Ready"})
NOT_YET_SEC = 1.0


@dataclass(frozen=True)
class Answer:
    """What one attempt got: a response (status, headers, body), or an error without one."""

    status_code: int | None
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    truncated: bool = False
    error: str | None = None  # set when there is no response


Caller = Callable[[Invocation], Awaitable[Answer]]

Asgi = Callable[[MutableMapping[str, Any], Any, Any], Awaitable[None]]


class ProxyCaller:
    """Calls a function through the ``/fn/`` proxy's ASGI application, in process."""

    def __init__(self, proxy: Asgi) -> None:
        self.proxy = proxy

    async def __call__(self, invocation: Invocation) -> Answer:
        path, _, query = invocation.path.partition("?")
        target = f"/fn/{invocation.env}/{invocation.function}{path}"
        # the body is whole: its length is known, whatever framing it came with
        headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in invocation.headers
            if name.lower() not in _FRAMING and name.lower() != "traceparent"
        ]
        # the attempt: a child of its submission's span (one stored before traces were
        # carried, or an event's: a trace of its own)
        submitted = next((v for n, v in invocation.headers if n.lower() == "traceparent"), None)
        attempt = child_traceparent(submitted)
        headers.append((b"traceparent", attempt.encode("ascii")))
        if invocation.body:
            headers.append((b"content-length", b"%d" % len(invocation.body)))
        if not any(name == b"host" for name, _ in headers):  # an event has none
            headers.append((b"host", b"localhost"))
        headers.append((b"x-invocation-id", invocation.id.encode("ascii")))
        headers.append((b"x-invocation-attempt", b"%d" % invocation.attempt))
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": invocation.method,
            "scheme": "http",
            "path": target,
            "raw_path": target.encode("latin-1"),
            "query_string": query.encode("latin-1"),
            "headers": headers,
            "client": (invocation.client, 0) if invocation.client else None,
            "server": None,
        }
        sent = False
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": invocation.body, "more_body": False}
            await never.wait()  # the client never leaves: the proxy streams to the end
            return {"type": "http.disconnect"}

        status: int | None = None
        response_headers: list[tuple[str, str]] = []
        body = bytearray()
        truncated = False

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal status, truncated
            if message["type"] == "http.response.start":
                status = message["status"]
                response_headers.extend(
                    (k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]
                )
            elif message["type"] == "http.response.body":
                room = MAX_RESPONSE_BYTES - len(body)
                chunk = message.get("body", b"")
                if len(chunk) > room:
                    truncated = True
                body.extend(chunk[: max(room, 0)])

        started = time.time_ns()
        try:
            await self.proxy(scope, receive, send)
        except Exception as exc:  # the proxy answers its own errors; this is a bug
            _log.exception("invocation %s: the proxy failed", invocation.id)
            status, error = None, f"the proxy failed: {exc}"
        else:
            error = "the proxy gave no answer" if status is None else None
        if status is not None and status >= 500:
            error = f"HTTP {status}"
        telemetry.record_under(
            f"attempt {invocation.attempt} {invocation.env}/{invocation.function}",
            attempt,
            submitted,
            started,
            time.time_ns(),
            {
                "sless.invocation": invocation.id,
                "sless.attempt": invocation.attempt,
                "http.response.status_code": status or 0,
            },
            error,
        )
        if status is None:
            return Answer(None, error=error)
        return Answer(status, tuple(response_headers), bytes(body), truncated)


def retry_after(headers: tuple[tuple[str, str], ...], now: float) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta seconds or an HTTP date)."""
    for name, value in headers:
        if name.lower() != "retry-after":
            continue
        value = value.strip()
        if value.isdigit():
            return float(value)
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - now)
    return None


def _error_of(answer: Answer) -> str:
    """One line on why an answer is a failure."""
    if answer.status_code is None:
        return answer.error or "no answer"
    detail = ""
    try:  # the proxy's own errors are {"error": "..."}: say that rather than the JSON
        detail = str(json.loads(answer.body)["error"])
    except (ValueError, TypeError, KeyError):
        detail = answer.body[:200].decode("utf-8", "replace").strip()
    line = f"HTTP {answer.status_code}" + (f": {detail}" if detail else "")
    return line.replace("\n", " ")[:300]


class Runner:
    """The :class:`~.engine.Worker` of every engine: policy from the routes' declarations,
    attempts through ``call``."""

    def __init__(
        self,
        routes: RouteTable,
        call: Caller,
        *,
        clock: Callable[[], float] = time.time,
        jitter: Callable[[], float] = random.random,
        ended: Callable[[Invocation], None] | None = None,
    ) -> None:
        self.routes = routes
        self.call = call
        self.clock = clock
        self.jitter = jitter
        # told of every invocation that ends (metrics, a callback to deliver now)
        self.ended = ended

    def policy(self, env: str, function: str) -> AsyncPolicy:
        declared = self.routes.declared(env, function)
        return DEFAULT_ASYNC if declared is None else declared.async_policy

    def concurrency(self, env: str, function: str) -> int:
        return self.policy(env, function).concurrency

    def timeout(self, env: str, function: str) -> float:
        route = self.routes.get(env, function)
        return (route.timeout_sec if route is not None else 300.0) + START_MARGIN_SEC

    async def run(self, invocation: Invocation, save: Save) -> Invocation:
        after = await self._run(invocation, save)
        labels = {"env": invocation.env, "function": invocation.function}
        if after.attempt > invocation.attempt:  # an attempt ran
            outcome = "retried" if after.status == QUEUED else after.status
            METRICS.async_attempts.inc(outcome=outcome, **labels)
        if after.status == DEAD:
            METRICS.async_dead.inc(**labels)
        return after

    async def _run(self, invocation: Invocation, save: Save) -> Invocation:
        policy = self.policy(invocation.env, invocation.function)
        now = self.clock()
        if now - invocation.age_from > policy.max_age_sec:
            age = durations.shown(policy.max_age_sec)
            return self._end(invocation, DEAD, f"older than maxAge {age}: no attempt started")
        if self._coming(invocation):  # not the function's failure: no attempt spent on it
            return invocation.evolve(status=QUEUED, next_at=now + NOT_YET_SEC)
        attempt = Attempt(invocation.attempt + 1, now)
        running = invocation.evolve(status=RUNNING, attempts=(*invocation.attempts, attempt))
        await save(running)
        answer = await self.call(running)
        ended = self.clock()
        code = answer.status_code
        error = None if code is not None and code < 400 else _error_of(answer)
        closed = Attempt(attempt.number, attempt.started, ended, code, error)
        done = running.evolve(attempts=(*invocation.attempts, closed))
        if code is not None:
            response = Response(code, answer.headers, answer.body, answer.truncated)
            done = done.evolve(response=response)
        if error is None:
            return self._end(done, SUCCEEDED, None)
        if code is not None and code < 500 and code not in _RETRIED:
            return self._end(done, FAILED, error)
        failures = done.failures
        if failures > policy.retries:
            tries = "1 attempt" if failures == 1 else f"{failures} attempts"
            return self._end(done, DEAD, f"{error} (after {tries}: retries spent)")
        delay = min(policy.max_backoff_sec, policy.backoff_sec * 2 ** (failures - 1))
        delay *= 1 + JITTER * self.jitter()
        asked = retry_after(answer.headers, ended) if code is not None else None
        if asked is not None:
            delay = max(delay, asked)
        next_at = ended + delay
        if next_at - invocation.age_from > policy.max_age_sec:
            age = durations.shown(policy.max_age_sec)
            return self._end(done, DEAD, f"{error} (the next attempt would pass maxAge {age})")
        return done.evolve(status=QUEUED, next_at=next_at, error=error)

    def _coming(self, invocation: Invocation) -> bool:
        """Whether the function is on its way (a restart before its first pass has put its
        routes back, a deploy or a build under way) rather than failed: nothing is
        declared yet, or it is declared Pending or Building without a route."""
        if not self.routes.all_declared():
            return True
        if self.routes.get(invocation.env, invocation.function) is not None:
            return False
        declared = self.routes.declared(invocation.env, invocation.function)
        return declared is not None and declared.phase in _COMING

    def _end(self, invocation: Invocation, status: str, error: str | None) -> Invocation:
        callback = invocation.callback
        if callback is not None:
            callback = replace(callback, state="pending", next_at=self.clock())
        ended = invocation.evolve(status=status, error=error, ended=self.clock(), callback=callback)
        if self.ended is not None:
            try:
                self.ended(ended)
            except Exception:  # counting must never lose the outcome
                _log.exception("after invocation %s", invocation.id)
        return ended
