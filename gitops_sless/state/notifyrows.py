"""The status store's rows of notifications (see ``notify``): what each provider was last
told about each subject, so that a restart of the reconciler says nothing twice. A part of
:class:`~.store.Store`, kept apart to keep each module to one subject.

A row is keyed by its provider, a kind (``incident``, ``deployed``, ``preview``,
``dead``) and a subject (``<env>/<function>``, ``<env>/job/<name>``, ``pr-7``); its
``value`` is what was said (a cause, a revision, a state, a count) and ``since`` when
it became true (an incident's start, for the ``resolved`` message's duration).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["NOTIFY_TABLE", "NotifyRows"]

NOTIFY_TABLE = """
CREATE TABLE IF NOT EXISTS notified (
    provider TEXT NOT NULL,
    kind TEXT NOT NULL,
    subject TEXT NOT NULL,
    value TEXT NOT NULL,
    since REAL NOT NULL,
    PRIMARY KEY (provider, kind, subject)
);
"""


class NotifyRows:
    """Methods of :class:`~.store.Store` (which supplies ``_tx``, ``_all`` and ``_lock``)."""

    _lock: threading.RLock

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def _all(self, sql: str, *args: Any) -> list[dict[str, Any]]:
        raise NotImplementedError

    def notified(self, provider: str, kind: str) -> dict[str, dict[str, Any]]:
        """subject -> {"value", "since"}: what ``provider`` was last told of each subject."""
        rows = self._all(
            "SELECT subject, value, since FROM notified WHERE provider = ? AND kind = ?",
            provider,
            kind,
        )
        return {row["subject"]: {"value": row["value"], "since": row["since"]} for row in rows}

    def set_notified(
        self, provider: str, kind: str, subject: str, value: str, since: float | None = None
    ) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO notified (provider, kind, subject, value, since)"
                " VALUES (?, ?, ?, ?, ?)",
                (provider, kind, subject, value, time.time() if since is None else since),
            )

    def forget_notified(self, provider: str, kind: str, subject: str) -> None:
        with self._tx() as db:
            db.execute(
                "DELETE FROM notified WHERE provider = ? AND kind = ? AND subject = ?",
                (provider, kind, subject),
            )

    def notify_mark(self) -> tuple[Any, ...]:
        """A cheap mark of what notifications are derived from (function records, job runs,
        previews): equal marks, nothing to look at again."""
        row = self._all(
            "SELECT (SELECT COUNT(*) FROM functions) AS f, (SELECT MAX(updated) FROM functions)"
            " AS fu, (SELECT COUNT(*) FROM jobs) AS j, (SELECT MAX(COALESCE(finished, started,"
            " 0)) FROM jobs) AS ju, (SELECT COUNT(*) FROM previews) AS p,"
            " (SELECT MAX(updated) FROM previews) AS pu"
        )[0]
        return tuple(row.values())
