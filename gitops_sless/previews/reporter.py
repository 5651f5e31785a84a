"""Telling the forge how each preview went, off the reconcile path.

:meth:`Reporter.report` only notes what to say and returns: it never waits on the
forge and never raises. One worker thread says it: the commit status first, then
our comment on the pull request. Only the latest report of a pull request
matters: a newer one replaces an older one still waiting (keeping its place in
line), so a PR's statuses go out in the order they were reported and a stale one
never follows a newer one. A report identical to the last one sent is not sent
again, and one that changes only the comment leaves the status alone. When the
forge is down or rate limited (``ForgeUnavailable``) the report waits and the
worker backs off (the forge's limits are per token, so every PR waits); a report
the forge refuses (``ForgeRefused``, a bad sha) is logged and dropped.

What a report says is :class:`PreviewReport`'s to write: the preview's state, the
names and phases of its functions, what failed by name (``build failed: greet``,
``job notes-create-table failed``) and links. Statuses and comments on a public
pull request are read by anyone, so they never carry a message, a log line or a
result: whatever a function prints could hold a secret.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .. import logs
from ..errors import ForgeUnavailable
from .forge import Forge

__all__ = ["PreviewReport", "Reporter"]

log = logging.getLogger(__name__)


_FORGE_STATES = {"Ready": "success", "Failed": "failure"}  # others are pending


@dataclass(frozen=True)
class PreviewReport:
    """One preview as its pull request shows it: states, names and links, never output.

    ``functions`` are (name, phase, url or None); ``failures`` say what failed, by name;
    ``note`` is the previews' own word on why the head waits (trust, approval, filter).
    """

    env: str
    sha: str
    state: str  # Building | Ready | Failed | Waiting
    url: str
    functions: tuple[tuple[str, str, str | None], ...] = ()
    failures: tuple[str, ...] = ()
    note: str | None = None

    @property
    def forge_state(self) -> str:
        return _FORGE_STATES.get(self.state, "pending")

    @property
    def description(self) -> str:
        if self.state == "Ready":
            return "preview ready"
        if self.state == "Failed":
            return "preview failed: " + ("; ".join(self.failures) or "see the preview")
        if self.state == "Waiting":
            return "preview waiting: " + (self.note or "not started yet")
        return "preview building"

    @property
    def comment(self) -> str:
        lines = [f"**Preview `{self.env}`** at `{self.sha[:12]}`: {self.state}"]
        if self.note:
            lines.append(f"\n{self.note}")
        lines += [f"- {failure}" for failure in self.failures]
        lines.append("")
        lines += [
            f"- `{name}`: {phase}" + (f" — {url}" if url else "")
            for name, phase, url in self.functions
        ]
        return "\n".join(lines)


@dataclass
class _Report:
    number: int
    sha: str
    state: str
    description: str
    url: str | None
    comment: str | None
    status_sent: bool = False  # a retry sends only what is left

    def key(self) -> tuple[object, ...]:
        """What the forge shows once it is sent: the status first, then the comment."""
        return (self.sha, self.state, self.description, self.url, self.comment)


class Reporter:
    """Commit statuses (``context``) and one comment per PR (``marker``), sent in the background."""

    def __init__(
        self,
        forge: Forge,
        context: str,
        marker: str,
        *,
        max_pending: int = 1000,
        backoff: float = 1.0,
        max_backoff: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._forge, self._context, self._marker = forge, context, marker
        self._max_pending, self._backoff, self._max_backoff = max_pending, backoff, max_backoff
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: OrderedDict[int, _Report] = OrderedDict()
        self._sent: OrderedDict[int, tuple[object, ...]] = OrderedDict()
        self._busy: int | None = None  # the PR whose report is being sent
        self._failures = 0
        self._resume_at = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sless-reporter", daemon=True)
        self._thread.start()

    def report(
        self,
        number: int,
        sha: str,
        state: str,
        description: str,
        url: str | None = None,
        comment_body: str | None = None,
    ) -> None:
        """Queue ``sha``'s status and PR ``number``'s comment; returns at once, never raises."""
        try:
            item = _Report(number, sha, state, description, url, comment_body)
            with self._cond:
                if self._closed:
                    return
                idle = number not in self._pending and self._busy != number
                if idle and self._sent.get(number) == item.key():
                    return  # the forge already shows exactly this
                if number not in self._pending and len(self._pending) >= self._max_pending:
                    dropped = next(iter(self._pending))
                    del self._pending[dropped]
                    logs.event(
                        log,
                        "report.dropped",
                        f"PR #{dropped}: {self._max_pending} reports waiting; dropped the oldest",
                        level=logging.WARNING,
                    )
                self._pending[number] = item
                self._cond.notify_all()
        except Exception:  # never let reporting break a reconcile
            log.exception("report.failed: PR #%s: could not queue the report", number)

    def report_preview(self, number: int, preview: PreviewReport) -> None:
        """Queue what ``preview`` says: its status on its commit and the PR's comment."""
        self.report(
            number,
            preview.sha,
            preview.forge_state,
            preview.description,
            preview.url,
            preview.comment,
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued report was sent or dropped; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or (not self._pending and self._busy is None), timeout
            )

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (after the call in progress); reports still waiting are dropped."""
        with self._cond:
            self._closed = True
            left = len(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        if left:
            logs.event(log, "report.dropped", f"closing: {left} report(s) not sent")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _next(self) -> _Report | None:
        """The oldest waiting report once the backoff is over; None when closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                wait = self._resume_at - self._clock()
                if self._pending and wait <= 0:
                    number, item = self._pending.popitem(last=False)
                    self._busy = number
                    return item
                self._cond.wait(wait if self._pending else None)

    def _run(self) -> None:
        while (item := self._next()) is not None:
            retry = self._send(item)
            with self._cond:
                self._busy = None
                if retry and not self._closed and item.number not in self._pending:
                    self._pending[item.number] = item  # first in line again
                    self._pending.move_to_end(item.number, last=False)
                self._cond.notify_all()

    def _send(self, item: _Report) -> bool:
        """Send one report; True when it must be tried again later."""
        with self._cond:
            said = self._sent.get(item.number)
        if said is not None and said[:4] == item.key()[:4]:
            item.status_sent = True  # only the comment changed: the status stays as it is
        try:
            if not item.status_sent:
                self._forge.set_status(
                    item.sha, item.state, self._context, item.description, item.url
                )
                item.status_sent = True
            if item.comment is not None:
                self._forge.upsert_comment(item.number, self._marker, item.comment)
        except ForgeUnavailable as exc:
            self._failures += 1
            delay = min(self._max_backoff, self._backoff * 2 ** (self._failures - 1))
            self._resume_at = self._clock() + delay
            message = f"PR #{item.number}: {exc}; trying again in {delay:.0f}s"
            logs.event(log, "report.retry", message, level=logging.WARNING)
            return True
        except Exception as exc:  # ForgeRefused, a bad argument: sending again cannot help
            message = f"PR #{item.number}: {type(exc).__name__}: {exc}; report dropped"
            logs.event(log, "report.failed", message, level=logging.ERROR)
            return False
        self._failures = 0
        with self._cond:
            self._sent[item.number] = item.key()
            self._sent.move_to_end(item.number)
            while len(self._sent) > self._max_pending:
                self._sent.popitem(last=False)
        return False
