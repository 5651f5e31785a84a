"""Crash recovery of the supervisor's replicas: a replica that ends is taken out of the
route, reported, and started again after a backoff that grows with failures in a row and
resets once the replicas have run ``backoff.RESET_AFTER_SEC``.

A part of :class:`~.processes.Supervisor` (its base class), apart only to keep each file
readable: it reads and changes the supervisor's units under the supervisor's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .. import backoff, logs
from ..plan.backend import ApplyFailed
from .readiness import StartFailed
from .units import Unit

if TYPE_CHECKING:
    from .replica_logs import LogPump

__all__ = ["Recovery"]

log = logging.getLogger("gitops_sless.local.processes")

WATCH_SEC = 0.1


class Recovery:
    """Watches every unit's replicas (``_watch``, the supervisor's monitor thread); uses
    the supervisor's ``reap``, ``_publish``, ``_notify``, ``_start_healthy`` and ``_stop``."""

    _units: dict[tuple[str, str], Unit]
    _lock: threading.RLock
    _closed: threading.Event
    _closing: bool
    output: LogPump
    version: int

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_SEC):
            with self._lock:
                # a unit with no replica wanted and none running has nothing to watch
                items = [(k, u) for k, u in self._units.items() if u.wanted or u.replicas]
            for key, unit in items:
                self._check(key, unit)

    def _check(self, key: tuple[str, str], unit: Unit) -> None:
        dead = [r for r in unit.replicas if r.process.poll() is not None]
        now = time.monotonic()
        if dead:
            reasons = [self.reap(r.child) for r in dead]
            with self._lock:
                if self._units.get(key) is not unit or self._closing:
                    return
                unit.replicas = [r for r in unit.replicas if r not in dead]
                unit.last_exit = reasons[-1]
                unit.degraded = True
                wait = self._back_off(unit, now)
                self._publish(key)
            for replica, reason in zip(dead, reasons, strict=True):
                message = f"replica on port {replica.port}: {reason}; restarting in {wait:.1f}s"
                self.output.note_after(
                    replica.output,
                    f"replica pid {replica.child.pid} on port {replica.port} ended: {reason}; "
                    f"restarting in {wait:.1f}s",
                )
                self._exited(key, "replica.exited", message, reason, wait)
        with self._lock:
            if self._units.get(key) is not unit or self._closing:
                return
            if (
                unit.failures
                and len(unit.replicas) >= unit.wanted
                and all(now - r.started > backoff.RESET_AFTER_SEC for r in unit.replicas)
            ):
                unit.failures = 0
        self._grow(key, unit)

    def _grow(self, key: tuple[str, str], unit: Unit) -> None:
        """Start the replicas ``unit`` lacks, each in its own thread (a slow start never
        delays another, nor noticing another function's crash), unless a backoff holds."""
        with self._lock:
            missing = unit.wanted - len(unit.replicas) - unit.starting
            if (
                missing <= 0
                or unit.adopted  # its environment is not known yet: see adopt_spec
                or time.monotonic() < unit.restart_at
                or self._closing
                or self._units.get(key) is not unit
            ):
                return
            unit.starting += missing
        for _ in range(missing):
            threading.Thread(
                target=self._restart_one, args=(key, unit), name="sless-restart", daemon=True
            ).start()

    def _back_off(self, unit: Unit, now: float) -> float:
        """One more failure: the next restart waits longer. Call with the lock held."""
        unit.failures += 1
        unit.restarts += 1
        self.version += 1
        wait = backoff.delay(unit.failures)
        unit.restart_at = now + wait
        return wait

    def _exited(
        self, key: tuple[str, str], event: str, message: str, reason: str | None, wait: float
    ) -> None:
        """Log a replica that ended (or never became healthy) and tell the status store."""
        logs.event(
            log,
            event,
            message,
            level=logging.WARNING,
            env=key[0],
            function=key[1],
            reason=reason,
            backoffSec=wait,
        )
        if reason:
            self._notify(key, "exited", reason)

    def _restart_one(self, key: tuple[str, str], unit: Unit) -> None:
        try:
            self._restart(key, unit)
        finally:
            with self._lock:
                unit.starting -= 1

    def _restart(self, key: tuple[str, str], unit: Unit) -> None:
        try:
            replica = self._start_healthy(unit.spec)
        except ApplyFailed as exc:
            reason = exc.reason if isinstance(exc, StartFailed) else None
            with self._lock:
                if self._units.get(key) is not unit or self._closing:
                    return
                wait = self._back_off(unit, time.monotonic())
                unit.start_failed = str(exc)
                if reason:
                    unit.last_exit = reason
                self._publish(key)
            event = "replica.exited" if reason else "replica.unhealthy"
            message = f"restart failed (next try in {wait:.1f}s): {exc}"
            self._exited(key, event, message, reason, wait)
            return
        with self._lock:
            current = (
                self._units.get(key) is unit
                and not self._closing
                and len(unit.replicas) < unit.wanted  # not scaled down meanwhile
            )
            recovered = False
            if current:
                unit.start_failed = None
                unit.replicas.append(replica)
                recovered = unit.degraded and len(unit.replicas) >= unit.wanted
                if recovered:
                    unit.degraded = False
                self._publish(key)
        if not current:
            self._stop([replica.child])
            return
        if unit.restarts:  # a scale-up's start says so in _start_healthy's own event
            logs.event(
                log,
                "replica.restarted",
                f"replica on port {replica.port} is healthy again",
                env=key[0],
                function=key[1],
            )
        if recovered:
            self._notify(key, "recovered", None)
