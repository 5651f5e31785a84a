"""One thing worth telling someone: a deploy, a failure and its end, a rollback, a
preview, dead letters. An :class:`Event` is what every provider's message is written
from; :meth:`Event.line` is its one-line summary, :meth:`Event.fields` what a webhook
receives (camelCase, RFC 3339 times, no field that is unset)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..timestamps import rfc3339

__all__ = ["Event", "duration"]

_TITLES = {
    "deployed": "deployed",
    "buildFailed": "build failed",
    "startFailed": "failed to start",
    "jobFailed": "job failed",
    "rolledBack": "rolled back",
    "previewReady": "preview ready",
    "previewClosed": "preview closed",
    "deadLettered": "invocations dead-lettered",
    "resolved": "resolved",
}
MAX_CAUSE = 1000  # characters of a cause a message carries


@dataclass(frozen=True)
class Event:
    kind: str  # one of config.EVENTS, or "resolved"
    env: str
    function: str | None = None  # a function's or a job's name; None: the environment's
    job: bool = False  # ``function`` names a job
    revision: str | None = None  # r3
    commit: str | None = None
    author: str | None = None  # the commit's author, as git records it
    cause: str | None = None  # why it failed, as the status API shows it
    url: str | None = None
    count: int | None = None  # dead letters: how many new; total in ``total``
    total: int | None = None
    was: str | None = None  # resolved: the failure it ends
    since: float | None = None  # resolved: when the failure began
    at: float = field(default_factory=time.time)

    @property
    def title(self) -> str:
        return _TITLES.get(self.kind, self.kind)

    @property
    def failure(self) -> bool:
        return self.kind in ("buildFailed", "startFailed", "jobFailed", "rolledBack")

    @property
    def subject(self) -> str:
        if self.function is None:
            return self.env
        return f"{self.env}/{'job ' if self.job else ''}{self.function}"

    def line(self) -> str:
        """One line that says it all but the cause: ``prod/greet: deployed r3 (abc1234)``."""
        said = f"{self.subject}: {self.title}"
        if self.kind == "deployed":
            said += f" {self.revision or ''}".rstrip()
            said += f" ({self.commit[:12]})" if self.commit else ""
            said += f" by {self.author}" if self.author else ""
        elif self.kind == "resolved":
            was = _TITLES.get(self.was or "", self.was or "failing")
            lasted = duration(self.at - self.since) if self.since is not None else "a while"
            said += f" after {lasted} ({was})"
        elif self.kind == "deadLettered":
            said = f"{self.subject}: {self.count} invocation(s) dead-lettered"
            said += f" ({self.total} in its dead letters)" if self.total is not None else ""
        if self.url and self.kind in ("previewReady", "deployed"):
            said += f": {self.url}"
        return said

    def short_cause(self) -> str | None:
        if not self.cause:
            return None
        cause = self.cause.strip()
        return cause if len(cause) <= MAX_CAUSE else cause[: MAX_CAUSE - 1] + "…"

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "event": self.kind,
            "environment": self.env,
            "function": None if self.job else self.function,
            "job": self.function if self.job else None,
            "summary": self.line(),
            "revision": self.revision,
            "commit": self.commit,
            "author": self.author,
            "cause": self.short_cause(),
            "url": self.url,
            "count": self.count,
            "total": self.total,
            "resolves": self.was,
            "since": rfc3339(self.since) if self.since is not None else None,
            "durationSeconds": round(self.at - self.since) if self.since is not None else None,
            "time": rfc3339(self.at),
        }
        return {key: value for key, value in out.items() if value is not None}


def duration(seconds: float) -> str:
    """``3h 4m``, ``4m 12s``, ``9s``: how long an incident lasted, to the second."""
    days, rest = divmod(max(0, round(seconds)), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n]
    return " ".join(shown[:2]) or "0s"
