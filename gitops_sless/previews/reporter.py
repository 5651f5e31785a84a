"""Telling the forge how each preview and each rollout went, off the reconcile path.

:meth:`Reporter.report` and :meth:`Reporter.report_rollout` only note what to say and
return: they never wait on the forge and never raise. One worker thread says it: the
commit status first, then our comment on the pull request (a rollout's: on the pull
requests the candidate's commit belongs to, asked of the forge then; none for a commit
pushed directly). Only the latest report of a pull request (of a rollout's commit)
matters: a newer one replaces an older one still waiting (keeping its place in
line), so a PR's statuses go out in the order they were reported and a stale one
never follows a newer one. A report identical to the last one sent is not sent
again, and one that changes only the comment leaves the status alone. When the
forge is down or rate limited (``ForgeUnavailable``) the report waits and the
worker backs off (the forge's limits are per token, so every PR waits); a report
the forge refuses (``ForgeRefused``, a bad sha) is logged and dropped.

What a report says is :class:`PreviewReport`'s to write: the preview's state, the
names and phases of its functions, what failed by name (``build failed: greet``,
``job notes-create-table failed``) and links; a rollout's is its
:class:`~gitops_sless.steps.rollouts.Verdict`'s: revisions, step and the numbers, under
a status context and a comment of its own per function and environment
(``<context>/rollout/<env>/<function>``). Statuses and comments on a public
pull request are read by anyone, so they never carry a message, a log line or a
result: whatever a function prints could hold a secret.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from .. import logs
from ..errors import ForgeUnavailable
from ..steps.rollouts import Verdict
from .forge import Forge, forge_for

__all__ = ["PreviewReport", "Reporter", "reporting", "rollout_comment"]

log = logging.getLogger(__name__)


_FORGE_STATES = {"Ready": "success", "Failed": "failure"}  # others are pending
# under way: pending; withdrawn (replaced, reverted) before a verdict: error, neither a
# pass nor a failure of the candidate, and never left pending
_ROLLOUT_STATES = {"Promoted": "success", "RolledBack": "failure", "Withdrawn": "error"}


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


def rollout_comment(verdict: Verdict) -> str:
    """Our comment on the pull request that brought a rolled back candidate."""
    return (
        f"**Rollout of `{verdict.function}` in `{verdict.env}`** at `{verdict.commit[:12]}`: "
        f"{verdict.candidate} rolled back\n\n{verdict.said}; "
        f"{verdict.stable} takes every call.\n\nThe same version is not tried again: "
        "a commit that changes the function starts a new rollout."
    )


@dataclass
class _Report:
    key: Hashable  # a newer report under the same key replaces this one while it waits
    sha: str
    state: str
    description: str
    url: str | None
    comment: str | None
    context: str
    marker: str
    number: int | None  # the PR to comment on; None: those the forge says ``sha`` belongs to
    status_sent: bool = False  # a retry sends only what is left

    @property
    def what(self) -> str:
        return (
            f"PR #{self.number}" if self.number is not None else f"{self.context}@{self.sha[:12]}"
        )

    def shown(self) -> tuple[object, ...]:
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
        self._pending: OrderedDict[Hashable, _Report] = OrderedDict()
        self._sent: OrderedDict[Hashable, tuple[object, ...]] = OrderedDict()
        self._busy: Hashable | None = None  # the key whose report is being sent
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
        self._queue(
            lambda: _Report(
                number,
                sha,
                state,
                description,
                url,
                comment_body,
                self._context,
                self._marker,
                number,
            )
        )

    def report_rollout(self, verdict: Verdict) -> None:
        """Queue what ``verdict`` says: its status on the candidate's commit (context
        ``<context>/rollout/<env>/<function>``) and, rolled back, our comment on the pull
        requests that commit belongs to. Returns at once, never raises."""
        where = f"rollout/{verdict.env}/{verdict.function}"
        self._queue(
            lambda: _Report(
                # one commit's status per function: a newer commit's never replaces it
                ("rollout", verdict.env, verdict.function, verdict.commit),
                verdict.commit,
                _ROLLOUT_STATES.get(verdict.phase, "pending"),
                verdict.said,
                None,
                rollout_comment(verdict) if verdict.phase == "RolledBack" else None,
                f"{self._context}/{where}",
                f"{self._marker}:{where}",
                None,
            )
        )

    def _queue(self, make: Callable[[], _Report]) -> None:
        try:
            item = make()
            key = item.key
            with self._cond:
                if self._closed:
                    return
                idle = key not in self._pending and self._busy != key
                if idle and self._sent.get(key) == item.shown():
                    return  # the forge already shows exactly this
                if key not in self._pending and len(self._pending) >= self._max_pending:
                    dropped = self._pending.pop(next(iter(self._pending)))
                    logs.event(
                        log,
                        "report.dropped",
                        f"{dropped.what}: {self._max_pending} reports waiting; dropped the oldest",
                        level=logging.WARNING,
                    )
                self._pending[key] = item
                self._cond.notify_all()
        except Exception:  # never let reporting break a reconcile
            log.exception("report.failed: could not queue a report")

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
                    key, item = self._pending.popitem(last=False)
                    self._busy = key
                    return item
                self._cond.wait(wait if self._pending else None)

    def _run(self) -> None:
        while (item := self._next()) is not None:
            retry = self._send(item)
            with self._cond:
                self._busy = None
                if retry and not self._closed and item.key not in self._pending:
                    self._pending[item.key] = item  # first in line again
                    self._pending.move_to_end(item.key, last=False)
                self._cond.notify_all()

    def _send(self, item: _Report) -> bool:
        """Send one report; True when it must be tried again later."""
        with self._cond:
            said = self._sent.get(item.key)
        if said is not None and said[:4] == item.shown()[:4]:
            item.status_sent = True  # only the comment changed: the status stays as it is
        try:
            if not item.status_sent:
                self._forge.set_status(
                    item.sha, item.state, item.context, item.description, item.url
                )
                item.status_sent = True
            if item.comment is not None:
                numbers = (
                    [item.number] if item.number is not None else self._forge.pulls_of(item.sha)
                )
                for number in numbers:  # editing our comment again changes nothing
                    self._forge.upsert_comment(number, item.marker, item.comment)
        except ForgeUnavailable as exc:
            self._failures += 1
            delay = min(self._max_backoff, self._backoff * 2 ** (self._failures - 1))
            self._resume_at = self._clock() + delay
            message = f"{item.what}: {exc}; trying again in {delay:.0f}s"
            logs.event(log, "report.retry", message, level=logging.WARNING)
            return True
        except Exception as exc:  # ForgeRefused, a bad argument: sending again cannot help
            message = f"{item.what}: {type(exc).__name__}: {exc}; report dropped"
            logs.event(log, "report.failed", message, level=logging.ERROR)
            return False
        self._failures = 0
        with self._cond:
            self._sent[item.key] = item.shown()
            self._sent.move_to_end(item.key)
            while len(self._sent) > self._max_pending:
                self._sent.popitem(last=False)
        return False


def reporting(
    repo_url: str,
    token: str | None,
    api_url: str | None,
    kind: str | None,
    instance_name: str,
    *,
    required: bool,
) -> tuple[Forge | None, Reporter | None]:
    """The forge of ``repo_url`` and a :class:`Reporter` to it (statuses under
    ``instance_name``), or (None, None) without a token. A forge it cannot make is
    ValueError when ``required`` (previews need it), else a warning: nothing is reported."""
    if not token:
        return None, None
    try:
        forge = forge_for(repo_url, token, api_url, kind)
    except ValueError as exc:
        if required:
            raise
        said = f"a forge token is set, but {exc}: no rollout is reported to a forge"
        logs.event(log, "forge.unavailable", said, level=logging.WARNING)
        return None, None
    marker = f"gitops-sless:{instance_name}"
    return forge, Reporter(forge, context=instance_name, marker=marker)
