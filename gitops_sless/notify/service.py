"""The notifications of a running server: the providers of ``--notify-config``, a look
at the store after every pass of the tracked branch (and every ``INTERVAL_SEC``, for
previews and dead letters), and an :class:`~.delivery.Outbox` per provider.

Nothing here runs on the reconcile path: :meth:`Notifications.wake` and
:meth:`Notifications.on_verdict` set a flag or queue and return. The ``forge``
provider is the forge reporting that predates notifications (a rollout's commit status
and PR comment, through :class:`~gitops_sless.previews.reporter.Reporter`); without a
file it is the only provider, as before.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from .. import logs
from ..state.store import Store
from ..steps.rollouts import Verdict
from .config import NotifyConfig, load
from .delivery import Outbox, Send, post
from .events import Event
from .watch import GRACE_SEC, Watcher

__all__ = ["INTERVAL_SEC", "Notifications", "notifications"]

log = logging.getLogger(__name__)

INTERVAL_SEC = 10.0


class _Reporter(Protocol):
    def report_rollout(self, verdict: Verdict) -> None: ...


class _Settings(Protocol):
    notify_config: Path | None
    secrets_dir: Path | None
    fn_url: str


class Notifications:
    def __init__(
        self,
        config: NotifyConfig,
        store: Store,
        *,
        public_url: str,
        reporter: _Reporter | None = None,
        author: Callable[[str], str | None] = lambda commit: None,
        send: Send = post,
        interval_sec: float = INTERVAL_SEC,
        backoff: float = 1.0,
        leading: Callable[[], bool] = lambda: True,
        grace_sec: float = GRACE_SEC,
    ) -> None:
        """``leading()``: whether this replica looks (the others' stores only follow);
        ``grace_sec``: how long a function is healthy before its incident resolves."""
        self.config = config
        self.leading = leading
        self.reporter = reporter if config.forge else None
        self.providers = tuple(p for p in config.providers if p.kind != "forge")
        self.watcher = Watcher(store, public_url, author, grace_sec=grace_sec)
        self.outboxes = {
            p.name: Outbox(p, send, backoff=backoff, on_delivered=self.watcher.delivered)
            for p in self.providers
        }
        self.interval_sec = interval_sec
        self._wanted = threading.Event()
        self._closed = threading.Event()
        self._looked = threading.Condition()
        self._looks = 0
        self._thread: threading.Thread | None = None
        if self.providers:
            self._thread = threading.Thread(target=self._run, name="sless-notify", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """A pass ended: look at the store soon (on the notifications' own thread)."""
        self._wanted.set()

    def watch_dead_letters(self, counts: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self.watcher.dead_letters = counts

    def on_verdict(self, verdict: Verdict) -> None:
        """A rollout started or ended: the forge's commit status; a rollback, an event."""
        if self.reporter is not None:
            self.reporter.report_rollout(verdict)
        if verdict.phase != "RolledBack":
            return
        event = Event(
            "rolledBack",
            verdict.env,
            verdict.function,
            revision=verdict.candidate,
            commit=verdict.commit,
            cause=f"{verdict.said}; {verdict.stable} takes every call",
        )
        for provider in self.providers:
            if provider.wants("rolledBack", event.env, event.function):
                self.outboxes[provider.name].put([event])

    def status(self) -> list[dict[str, Any]]:
        """Each provider's last delivery and error, its counts; never its address."""
        shown = [self.outboxes[p.name].status() for p in self.providers]
        if self.config.forge:
            shown.append({"name": "forge", "kind": "forge", "enabled": self.reporter is not None})
        return shown

    def look(self) -> None:
        """Tell each provider what is new (tests call it; the thread does after a pass)."""
        if not self.leading():
            self.watcher.follow()
            return
        try:
            found = self.watcher.look(self.providers)
        except Exception:  # a bug must never stop the notifications' thread
            log.exception("notify.failed: could not look at the store")
            return
        for name, events in found.items():
            self.outboxes[name].put(events)
        with self._looked:
            self._looks += 1
            self._looked.notify_all()

    def wait_for_look(self, after: int, timeout: float) -> bool:
        with self._looked:
            return self._looked.wait_for(lambda: self._looks > after, timeout)

    @property
    def looks(self) -> int:
        return self._looks

    def close(self) -> None:
        self._closed.set()
        self._wanted.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for outbox in self.outboxes.values():
            outbox.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wanted.wait(self.interval_sec)
            self._wanted.clear()
            if not self._closed.is_set():
                self.look()


def notifications(
    settings: _Settings, store: Store, reporter: _Reporter | None, mirror: Any, elector: Any
) -> Notifications:
    """A server's notifications, from ``settings.notify_config`` (NotifyConfigError when it
    cannot be used); the author of a deployed commit is read from ``mirror``; with an
    ``elector`` (Kubernetes), only the replica that leads looks and sends."""
    config = load(settings.notify_config, settings.secrets_dir)
    if config.providers and settings.notify_config is not None:
        names = ", ".join(f"{p.name} ({p.kind})" for p in config.providers)
        logs.event(log, "notify.configured", f"notifications to {names}")

    def author(commit: str) -> str | None:
        found = mirror.snapshot(commit).commit.author
        return str(found.name) if found is not None else None

    return Notifications(
        config,
        store,
        public_url=settings.fn_url,
        reporter=reporter,
        author=author,
        leading=elector.is_leader if elector is not None else lambda: True,
        grace_sec=_grace(),
    )


def _grace() -> float:
    """``SLESS_NOTIFY_GRACE_SEC``: how long healthy before an incident resolves."""
    said = os.environ.get("SLESS_NOTIFY_GRACE_SEC", "")
    try:
        value = float(said) if said else GRACE_SEC
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):  # never clamped: said, and the default kept
        why = f"SLESS_NOTIFY_GRACE_SEC={said!r}: not a number of seconds >= 0; {GRACE_SEC:g} s"
        logs.event(log, "notify.config", why, level=logging.ERROR)
        return GRACE_SEC
    return value
