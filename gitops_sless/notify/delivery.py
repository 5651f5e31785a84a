"""Delivering one provider's messages, off the reconcile path: an :class:`Outbox` per
provider, with a worker thread of its own.

:meth:`Outbox.put` only queues and returns, so a slow or dead receiver never holds a
pass (nor another provider). The worker sends what waits as one message (up to
``MAX_BATCH`` events: a pass that deploys forty functions makes one message, not forty),
no more often than the provider's ``maxPerMinute`` allows (events that arrive meanwhile
join the next message). A delivery that fails for a reason that may pass (no answer,
a timeout, 408, 429, 5xx) is tried again with exponential backoff, up to
``MAX_BACKOFF_SEC`` apart; one the receiver refuses (another 4xx) is dropped and said in
the log. Only a delivered message is reported back (``on_delivered``: the watcher then
writes down what it told); what is dropped (refused, past ``MAX_PENDING``, or waiting
when the server stops) is not, so the next server sends it. Each outcome counts in
``sless_notifications_total`` and the provider's last delivery, success and error are in
:meth:`Outbox.status`. Neither shows its address.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from .. import logs
from ..metrics import METRICS
from ..timestamps import rfc3339
from .config import Provider
from .events import Event
from .payloads import body, fitting

__all__ = ["MAX_BATCH", "Outbox", "TooLarge", "Undeliverable"]

log = logging.getLogger(__name__)

MAX_BATCH = 40  # events in one message
MAX_PENDING = 1000  # events waiting; beyond it the oldest are dropped
MAX_BACKOFF_SEC = 300.0
_RETRIED_STATUSES = (408, 425, 429)


class Undeliverable(Exception):
    """The receiver refused the message (a 4xx): sending it again cannot help."""


class TooLarge(Undeliverable):
    """The receiver refused the message as too large (413): fewer events may pass."""


Send = Callable[[Provider, Sequence[Event]], None]
Delivered = Callable[[Sequence[Event]], None]


def post(provider: Provider, events: Sequence[Event]) -> None:
    """One HTTP POST of ``events`` to ``provider``; raises on anything but a 2xx."""
    assert provider.url is not None
    raw, headers = body(provider.kind, events, provider.hmac_key)
    headers["User-Agent"] = "gitops-sless-notifications"
    try:
        answer = httpx.post(
            provider.url, content=raw, headers=headers, timeout=provider.timeout_sec
        )
    except httpx.HTTPError as exc:
        raise ConnectionError(_scrubbed(provider, f"{type(exc).__name__}: {exc}")) from None
    status = answer.status_code
    if 200 <= status < 300:
        return
    if status == 413:
        raise TooLarge(f"HTTP {status}")
    if status < 500 and status not in _RETRIED_STATUSES:
        raise Undeliverable(f"HTTP {status}")
    raise ConnectionError(f"HTTP {status}")


def _scrubbed(provider: Provider, text: str) -> str:
    """An error without the provider's address (httpx names the URL it failed on)."""
    if provider.url:
        text = text.replace(provider.url, "<url>")
        text = text.replace(httpx.URL(provider.url).host or provider.url, "<host>")
    return text


class Outbox:
    """One provider's waiting events and the thread that delivers them."""

    def __init__(
        self,
        provider: Provider,
        send: Send = post,
        *,
        backoff: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_delivered: Delivered = lambda events: None,
    ) -> None:
        self.provider = provider
        self._send, self._backoff, self._clock = send, backoff, clock
        self._on_delivered = on_delivered
        self._cond = threading.Condition()
        self._pending: list[Event] = []
        self._failures = 0
        self._most = MAX_BATCH  # events in the next message: fewer after a 413
        self._resume_at = 0.0  # backoff after a failure, or the rate limit after a success
        self._busy = False
        self._closed = False
        self._last: dict[str, Any] = {"attempt": None, "delivered": None, "ok": None, "error": None}
        self._counts = {"delivered": 0, "retried": 0, "dropped": 0, "events": 0}
        self._thread = threading.Thread(
            target=self._run, name=f"sless-notify-{provider.name}", daemon=True
        )
        self._thread.start()

    def put(self, events: Sequence[Event]) -> None:
        """Queue ``events``; returns at once, never raises."""
        if not events:
            return
        with self._cond:
            if self._closed:
                return
            self._pending += events
            self._counts["events"] += len(events)
            for event in events:
                METRICS.notification_events.inc(provider=self.provider.name, event=event.kind)
            over = len(self._pending) - MAX_PENDING
            if over > 0:
                del self._pending[:over]
                self._count("dropped", over)
                said = f"{self.provider.name}: {MAX_PENDING} events waiting; dropped {over}"
                logs.event(log, "notify.dropped", said, level=logging.WARNING)
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        """What the status API shows: the last delivery, its outcome, the counts; no URL."""
        with self._cond:
            last = dict(self._last)
            return {
                "name": self.provider.name,
                "kind": self.provider.kind,
                "pending": len(self._pending),
                "lastAttempt": rfc3339(last["attempt"]),
                "lastDelivered": rfc3339(last["delivered"]),
                "lastOk": last["ok"],
                "lastError": last["error"],
                **self._counts,
            }

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing waits and nothing is being sent; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or (not self._pending and not self._busy), timeout
            )

    def close(self, timeout: float = 2.0) -> None:
        with self._cond:
            self._closed = True
            left = len(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        if left:
            said = f"{self.provider.name}: closing: {left} event(s) not sent"
            logs.event(log, "notify.dropped", said, level=logging.WARNING)
        self._thread.join(timeout)

    def _count(self, what: str, amount: int = 1) -> None:
        what = "retried" if what == "split" else what
        self._counts[what] += amount
        if what != "events":
            METRICS.notifications.inc(amount, provider=self.provider.name, result=what)

    def _next(self) -> list[Event] | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                wait = self._resume_at - self._clock()
                if self._pending and wait <= 0:
                    self._busy = True
                    batch = self._pending[: self._most]
                    return batch[: fitting(self.provider.kind, batch)]
                self._cond.wait(wait if self._pending else None)

    def _run(self) -> None:
        while (batch := self._next()) is not None:
            try:
                self._once(batch)
            except Exception:  # a bug must never stop the provider's thread
                log.exception("notify.failed: %s: delivering", self.provider.name)
                with self._cond:
                    self._busy = False
                    self._resume_at = self._clock() + MAX_BACKOFF_SEC
                    self._cond.notify_all()

    def _once(self, batch: list[Event]) -> None:
        outcome, error = self._deliver(batch)
        if outcome == "delivered":
            self._told(batch)  # before flush() may return
        now = time.time()
        with self._cond:
            self._busy = False
            self._last.update(attempt=now, ok=outcome == "delivered", error=error)
            if outcome == "split":  # the same events again at once, fewer in a message
                self._most = max(1, len(batch) // 2)
            elif outcome == "retried":
                self._failures += 1
                exponent = min(self._failures - 1, 30)  # 2**30 s is past any cap
                delay = min(MAX_BACKOFF_SEC, self._backoff * 2**exponent)
                self._resume_at = self._clock() + delay
            else:
                self._failures = 0
                sent = {id(event) for event in batch}  # some may have been dropped
                self._pending = [e for e in self._pending if id(e) not in sent]
                self._most = self._most if self._pending else MAX_BATCH
                self._resume_at = self._clock() + 60.0 / self.provider.max_per_minute
                if outcome == "delivered":
                    self._last["delivered"] = now
            self._count(outcome)
            self._cond.notify_all()

    def _told(self, batch: list[Event]) -> None:
        try:
            self._on_delivered(batch)
        except Exception:  # the store is gone: the next server says it again
            log.exception("notify.failed: %s: recording a delivery", self.provider.name)

    def _deliver(self, batch: list[Event]) -> tuple[str, str | None]:
        name = self.provider.name
        try:
            self._send(self.provider, batch)
        except TooLarge as exc:
            if len(batch) > 1:
                said = f"{name}: {len(batch)} event(s) too large for one message; splitting"
                logs.event(log, "notify.split", said, level=logging.WARNING)
                return "split", str(exc)
            said = f"{name}: the receiver refused an event as too large ({exc}); dropped"
            logs.event(log, "notify.refused", said, level=logging.ERROR)
            return "dropped", str(exc)
        except Undeliverable as exc:
            said = f"{name}: the receiver refused {len(batch)} event(s) ({exc}); dropped"
            logs.event(log, "notify.refused", said, level=logging.ERROR)
            return "dropped", str(exc)
        except Exception as exc:  # a receiver down, a timeout, a 5xx: try again later
            error = _scrubbed(self.provider, str(exc) or type(exc).__name__)
            said = f"{name}: {len(batch)} event(s) not delivered ({error}); trying again"
            logs.event(log, "notify.retry", said, level=logging.WARNING)
            return "retried", error
        logs.event(log, "notify.sent", f"{name}: {len(batch)} event(s) delivered")
        return "delivered", None
