"""What a function's calls cost right now: in-flight calls, waiting calls, cold starts.

One :class:`Load` per function and environment, kept by the
:class:`~gitops_sless.state.routes.RouteTable` across every change of the
function's route. The proxy updates it on its event loop for each call (a few
attribute updates: it is on the hot path); the autoscaler reads it from its
own thread, a tick at a time, and the status API reads the cold starts.

Concurrency is integrated over time (``busy``: call-seconds), so the average
between two reads is exact however short the calls (as Knative's queue-proxy
reports it), rather than sampled at the instant of the read.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

__all__ = ["ColdStart", "Load"]

COLD_STARTS_KEPT = 200  # for the status API's p50/p95 over the recent ones


@dataclass(frozen=True, slots=True)
class ColdStart:
    """One call that waited for a replica to start: how long, and when (wall clock)."""

    wall: float
    waited_ms: float


class Load:
    """In-flight and waiting calls of one function (all of its replicas), integrated."""

    __slots__ = (
        "busy",
        "changed",
        "cold_starts",
        "inflight",
        "sockets",
        "streams",
        "total",
        "waited",
        "waiting",
        "waiting_changed",
    )

    def __init__(self) -> None:
        self.inflight = 0  # calls through the proxy not yet answered, waiting ones included
        self.waiting = 0  # of those, calls held for a replica or a free slot
        self.total = 0  # calls begun
        self.busy = 0.0  # integral of inflight over time (call-seconds) up to ``changed``
        self.changed = time.monotonic()  # when inflight last changed
        self.cold_starts: deque[ColdStart] = deque(maxlen=COLD_STARTS_KEPT)
        self.waited = 0.0  # integral of waiting over time, up to ``waiting_changed``
        self.waiting_changed = self.changed
        # streamed responses and WebSockets open through this proxy now (every function's,
        # counted or not: the status and /metrics show them)
        self.streams = 0
        self.sockets = 0

    def begin(self, now: float) -> None:
        self.busy += self.inflight * (now - self.changed)
        self.changed = now
        self.inflight += 1
        self.total += 1

    def end(self, now: float) -> None:
        self.busy += self.inflight * (now - self.changed)
        self.changed = now
        self.inflight -= 1

    def wait_begin(self, now: float) -> None:
        self.waited += self.waiting * (now - self.waiting_changed)
        self.waiting_changed = now
        self.waiting += 1

    def wait_end(self, now: float) -> None:
        self.waited += self.waiting * (now - self.waiting_changed)
        self.waiting_changed = now
        self.waiting -= 1

    def waited_until(self, now: float) -> float:
        """Call-seconds spent waiting in the proxy (for a replica or a free slot) so far."""
        return self.waited + self.waiting * max(0.0, now - self.waiting_changed)

    def busy_until(self, now: float) -> float:
        """Call-seconds from the start up to ``now``: read twice, the difference over the
        time between is the average concurrency."""
        return self.busy + self.inflight * max(0.0, now - self.changed)

    def cold_start(self, waited_ms: float) -> None:
        self.cold_starts.append(ColdStart(time.time(), waited_ms))
