"""Whether a call may go to its function now, and holding it until it may (the activator).

Three things can stop a call before it reaches a replica:

- ``rateLimit``: a token bucket per function and environment in this proxy.
  Empty: ``429`` with ``Retry-After`` (the seconds until the next token). With
  several reconciler replicas each proxy takes its share (``share``: 1/N of the
  rate and the burst), so together they admit what the manifest says.
- no replica, for a function that scales to zero (its route has a ``scale``
  policy and no upstream): the call is held while :attr:`wake` starts one, then
  goes on; still waiting when the function's timeout passes: ``504``. The same
  for a function whose last good version the reconciler starts again after a
  stop (its route says ``starting``), but nothing is woken: it starts anyway. A start
  that failed answers ``502`` naming why, at once while the crash-loop backoff
  holds (a call never makes the backend retry in a tight loop).
- ``concurrency``: every replica takes at most that many calls at once; more
  wait here, first come first served, and past a bounded queue get ``429``.

Held calls are counted in the function's :class:`~gitops_sless.state.load.Load`
(waiting calls are load too: they are what the autoscaler scales for). Everything
here runs on the proxy's event loop; the route table's writers (the backends,
on their threads) reach it through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable

from ..state.load import Load
from ..state.routes import Route, RouteTable

__all__ = ["Activator", "Refused"]

# Calls one function may have waiting here for a free slot, per slot it can have
# (concurrency x its most replicas); past it, 429
QUEUE_PER_SLOT = 10
# Calls that may wait for a function without a concurrency limit to start
START_QUEUE = 1000

Key = tuple[str, str]


class Refused(Exception):
    """The call is answered by the proxy: ``status``, the error, ``Retry-After`` if any."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


class _Bucket:
    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self, now: float) -> float:
        """0 if a token was taken, else the seconds until one will be there."""
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if tokens >= 1.0:
            self.tokens = tokens - 1.0
            return 0.0
        self.tokens = tokens
        return (1.0 - tokens) / self.rate


class Activator:
    """Rate limits, holding calls for a start, and per-replica concurrency (module doc).

    ``wake(env, name)`` asks the backend for a replica of a function at zero; it is
    called on a worker thread (it may block: the Kubernetes backend writes the scale).
    """

    def __init__(self, routes: RouteTable, wake: Callable[[str, str], None] | None = None) -> None:
        self.routes = routes
        self.wake = wake
        self.share = 1.0  # of each rate limit this proxy enforces (1/N with N replicas)
        self._buckets: dict[Key, tuple[object, _Bucket]] = {}
        # calls waiting, by function: empty when none waits (the proxy looks before it
        # calls released)
        self.waiters: dict[Key, deque[asyncio.Future[None]]] = {}
        self._woken: dict[Key, Route] = {}  # the route a wake was last asked for
        self._loop: asyncio.AbstractEventLoop | None = None
        routes.watch(self._route_changed)

    # -- checks that answer at once

    def rate_limited(self, route: Route, now: float) -> Refused | None:
        limit = route.rate_limit
        if limit is None:
            return None
        # one bucket per function: its revisions' own URLs and a rollout's candidate
        # (name@id) draw from it too, or each would add a limit of its own
        key = (route.env, route.name.partition("@")[0])
        kept = self._buckets.get(key)
        if kept is None or kept[0] != (limit, self.share):
            share = self.share
            kept = self._buckets[key] = (
                (limit, share),
                _Bucket(limit.rps * share, max(1.0, limit.burst * share)),
            )
        wait = kept[1].take(now)
        if not wait:
            return None
        return Refused(
            429,
            f"rate limit: {limit.rps:g} calls a second (burst {limit.burst}) for this function",
            max(1, math.ceil(wait)),
        )

    def must_wait(self, route: Route, load: Load | None) -> bool:
        """Whether a call just counted in ``load`` has to wait: no replica, every slot
        taken, or calls waiting before it (``load`` is None: the route counts none)."""
        if not route.upstreams:
            return True
        if not route.concurrency:
            return False
        running = load.inflight - 1 - load.waiting
        return (route.env, route.name) in self.waiters or _full(route, running)

    # -- holding

    async def hold(self, route: Route, deadline: float) -> Route:
        """Wait (counted in the function's load) until ``route``'s function can take the
        call; the route to send it on. Raises :class:`Refused` when it cannot."""
        key = (route.env, route.name)
        load = route.load
        loop = self._loop = asyncio.get_running_loop()
        waiters = self.waiters.get(key)
        if waiters is None:
            waiters = self.waiters[key] = deque()
        if len(waiters) >= _queue_bound(route):
            raise Refused(429, f"too many calls waiting for {route.name}", 1)
        load.wait_begin(time.monotonic())
        try:
            while True:
                current = self.routes.get(*key)
                if current is None:
                    raise Refused(503, "function not ready: removed while the call waited")
                if not current.upstreams:
                    if current.scale is None and not current.starting:
                        raise Refused(503, "function not ready: no healthy upstream")
                    if current.failed and time.monotonic() < current.retry_at:
                        raise Refused(502, f"function failed to start: {current.failed}")
                    self._wake(key, current, loop)
                elif not _full(current, load.inflight - load.waiting):
                    return current
                future: asyncio.Future[None] = loop.create_future()
                waiters.append(future)
                try:
                    async with asyncio.timeout_at(deadline):
                        await future
                except TimeoutError:
                    raise Refused(504, self._timed_out(current)) from None
                finally:
                    if not future.done():
                        future.cancel()
                    if future in waiters:
                        waiters.remove(future)
        finally:
            load.wait_end(time.monotonic())
            if not waiters:
                self.waiters.pop(key, None)

    def _timed_out(self, route: Route) -> str:
        timeout = f"{route.timeout_sec:g}s"
        if not route.upstreams:
            return f"function did not start within {timeout} (its timeout): no replica yet"
        return (
            f"no free slot within {timeout} (its timeout): {route.concurrency} calls per "
            f"replica, {route.serving} replica(s), all busy"
        )

    def released(self, env: str, name: str) -> None:
        """A call of the function ended: the first call waiting for a slot may go."""
        waiters = self.waiters.get((env, name))
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(None)
                return

    def _wake(self, key: Key, route: Route, loop: asyncio.AbstractEventLoop) -> None:
        """Ask for a replica, once per version of the route (a failed start publishes a new
        one, and so does the replica that starts)."""
        if self.wake is None or self._woken.get(key) is route:
            return
        self._woken[key] = route
        wake = self.wake
        loop.run_in_executor(None, wake, *key)

    def _route_changed(self, env: str, name: str) -> None:
        # any thread: a backend's; the waiters re-check on the loop
        loop = self._loop
        if loop is None or (env, name) not in self.waiters:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits any more
            loop.call_soon_threadsafe(self._wake_all, (env, name))

    def _wake_all(self, key: Key) -> None:
        for future in self.waiters.get(key, ()):
            if not future.done():
                future.set_result(None)


def _full(route: Route, running: int) -> bool:
    """Whether ``running`` calls take every slot of ``route``'s replicas."""
    return bool(route.concurrency) and running >= route.concurrency * route.serving


def _queue_bound(route: Route) -> int:
    """How many calls may wait for ``route``'s function at once."""
    if not route.concurrency:
        return START_QUEUE
    replicas = max(route.serving, route.scale.max if route.scale else 1)
    return QUEUE_PER_SLOT * route.concurrency * replicas
