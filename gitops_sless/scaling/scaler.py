"""The autoscaler's tick: every autoscaled route's replicas decided and written.

A thread wakes every ``tick_sec``; for each route with a ``scale`` policy it
reads the function's load, asks its :class:`~.autoscaler.Autoscaler`, and
writes a changed decision through ``Backend.scale``. :meth:`Scaler.wake` is
the activator's way in: a call waits for a function at zero, so one replica
is wanted now (any reconciler replica may wake a function; only the leader
writes the tick's decisions). What it decided is kept for the status API,
the dashboard and ``/metrics``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from .. import logs
from ..metrics import METRICS
from ..plan.backend import Backend
from ..state.routes import Route, RouteTable
from . import warm
from .autoscaler import Autoscaler, Decision, Windows

__all__ = ["ScaleStatus", "Scaler", "describe"]

log = logging.getLogger(__name__)

Key = tuple[str, str]


@dataclass(frozen=True)
class ScaleStatus:
    """What the status API shows of an autoscaled function."""

    desired: int
    ready: int
    concurrency: float  # averaged over the stable window
    panicking: bool
    floor: int  # min, raised by a warm schedule that holds now


@dataclass
class _Tracked:
    """One autoscaled function as the tick follows it."""

    route: Route
    autoscaler: Autoscaler
    active: float  # when a call last ran (or it was first seen)
    source: str  # where its busy seconds are read: "proxy" or "replicas"
    busy: float  # as read at the last tick


class Scaler:
    """Decides and writes the replicas of every autoscaled function (module doc)."""

    def __init__(
        self,
        routes: RouteTable,
        backends: Callable[[str], Backend | None],
        windows: Windows | None = None,
        leading: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """``backends(env)``: the backend that runs ``env`` (None: not ours to scale)."""
        self.routes = routes
        self.backends = backends
        self.windows = windows or Windows()
        self.leading = leading
        self.clock = clock
        self.wall = wall
        self._scalers: dict[Key, _Tracked] = {}
        self._status: dict[Key, ScaleStatus] = {}
        self._lock = threading.Lock()
        # wakes and writes one at a time: a tick's "0" never lands after a wake's "1"
        self._writing = threading.Lock()
        self._written: dict[Key, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sless-autoscaler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def status(self, env: str, name: str) -> ScaleStatus | None:
        return self._status.get((env, name))

    def report(self, env: str, name: str) -> dict | None:
        """:func:`describe` of an autoscaled function; None for any other."""
        route = self.routes.get(env, name)
        if route is None or route.scale is None:
            return None
        return describe(route, self._status.get((env, name)))

    def wake(self, env: str, name: str) -> None:
        """A call waits for ``name`` at zero replicas: one now (called on a worker thread)."""
        route = self.routes.get(env, name)
        backend = self.backends(env)
        if route is None or route.scale is None or backend is None:
            return
        with self._lock:
            tracked = self._scalers.get((env, name))
            if tracked is not None and tracked.autoscaler.desired:
                desired = tracked.autoscaler.desired
            else:
                desired = 1
                if tracked is not None:
                    tracked.autoscaler.desired = 1
        try:
            with self._writing:
                backend.scale(env, name, desired)
                self._written[(env, name)] = desired
        except Exception as exc:
            logs.event(
                log,
                "scale.wake_failed",
                f"could not start a replica for a waiting call: {exc}",
                level=logging.WARNING,
                env=env,
                function=name,
            )

    def _run(self) -> None:
        while not self._stop.wait(self.windows.tick_sec):
            try:
                self.tick()
            except Exception:  # the next tick tries again; a bug must not stop scaling
                log.exception("autoscaler tick failed")

    def tick(self) -> None:
        """Decide every autoscaled function once, and write what changed (when leading)."""
        now = self.clock()
        wall = self.wall()
        seen: set[Key] = set()
        writes: list[tuple[Backend, Route, int]] = []
        leading = self.leading is None or self.leading()
        for route in self.routes.all():
            policy = route.scale
            if policy is None:
                continue
            key = (route.env, route.name)
            seen.add(key)
            backend = self.backends(route.env)
            source, busy = self._busy(backend if leading else None, route, now)
            with self._lock:
                tracked = self._scalers.get(key)
                if tracked is None:
                    tracked = self._scalers[key] = _Tracked(
                        route, Autoscaler(self.windows, now, busy), now, source, busy
                    )
                elif tracked.route.scale != policy or tracked.source != source:
                    # a new policy, or load read elsewhere (replicas came or went): new
                    # windows, the same decision to start from
                    tracked.autoscaler.restart(now, busy)
                    tracked.source, tracked.busy = source, busy
                tracked.route = route
                if busy > tracked.busy + 1e-9 or route.load.inflight:
                    tracked.active = now  # calls ran since the last tick, or run now
                tracked.busy = busy
            ready = route.serving
            floor = warm.floor(policy, wall)
            idle_for = now - tracked.active
            decision = tracked.autoscaler.decide(policy, floor, now, busy, ready, idle_for)
            self._report(key, decision, ready, floor)
            if backend is not None and leading:
                writes.append((backend, route, decision.desired))
        with self._lock:
            for key in set(self._scalers) - seen:
                del self._scalers[key]
                self._status.pop(key, None)
                self._written.pop(key, None)
        for backend, route, desired in writes:
            self._write(backend, route, desired)

    @staticmethod
    def _busy(backend: Backend | None, route: Route, now: float) -> tuple[str, float]:
        """Where the function's call-seconds are read, and how many so far: what its
        replicas report (Kubernetes: calls may not come through this proxy), plus the calls
        this proxy holds for them; else this proxy's own count."""
        load = route.load
        reported = backend.busy(route.env, route.name) if backend is not None else None
        if reported is None:
            return "proxy", load.busy_until(now)
        return "replicas", reported + load.waited_until(now)

    def _report(self, key: Key, decision: Decision, ready: int, floor: int) -> None:
        previous = self._status.get(key)
        self._status[key] = ScaleStatus(
            decision.desired, ready, decision.stable, decision.panicking, floor
        )
        env, name = key
        METRICS.replicas.set(decision.desired, env=env, name=name, kind="desired")
        METRICS.replicas.set(ready, env=env, name=name, kind="ready")
        METRICS.concurrency.set(round(decision.stable, 3), env=env, name=name)
        if previous is not None and previous.desired != decision.desired:
            if decision.desired == 0:
                METRICS.idle_functions.inc(env=env, name=name)
            logs.event(
                log,
                "scale.changed",
                f"replicas {previous.desired} -> {decision.desired} (concurrency "
                f"{decision.stable:.2f} stable, {decision.panic:.2f} panic"
                f"{', panicking' if decision.panicking else ''})",
                level=logging.INFO,
                env=env,
                function=name,
            )

    def _write(self, backend: Backend, route: Route, desired: int) -> None:
        key = (route.env, route.name)
        try:
            with self._writing:
                if self._written.get(key) == desired:
                    return
                if desired == 0 and route.load.inflight:
                    return  # a call came since the decision: it has woken the function
                backend.scale(route.env, route.name, desired)
                self._written[key] = desired
        except Exception as exc:  # the next tick writes it again
            logs.event(
                log,
                "scale.write_failed",
                f"could not set replicas to {desired}: {exc}",
                level=logging.WARNING,
                env=route.env,
                function=route.name,
            )


COLD_START_WINDOW_SEC = 3600.0  # the status API's p50/p95 are over the last hour


def describe(route: Route, status: ScaleStatus | None, now: float | None = None) -> dict:
    """What the status API says of an autoscaled function's replicas and cold starts."""
    policy = route.scale
    assert policy is not None
    wall = time.time() if now is None else now
    kept = route.load.cold_starts
    recent = sorted(c.waited_ms for c in kept if wall - c.wall <= COLD_START_WINDOW_SEC)
    last = route.load.cold_starts[-1] if route.load.cold_starts else None
    return {
        "min": policy.min,
        "max": policy.max,
        "target": policy.target,
        "idle_sec": policy.idle_sec,
        "desired": status.desired if status else None,
        "ready": route.serving,
        "floor": status.floor if status else policy.min,
        "concurrency": round(status.concurrency, 3) if status else 0.0,
        "panicking": status.panicking if status else False,
        "in_flight": route.load.inflight,
        "waiting": route.load.waiting,
        "last_cold_start_ms": round(last.waited_ms, 1) if last else None,
        "cold_start_p50_ms": _percentile(recent, 0.50),
        "cold_start_p95_ms": _percentile(recent, 0.95),
        "cold_starts": len(recent),
    }


def _percentile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)
