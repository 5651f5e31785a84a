"""What every page of the dashboard shares: its data sources and the header."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...state.routes import RouteTable
from ...state.store import MAX_SYNCS, Store
from ..models import Status, Sync
from .html import (
    NO_HTML,
    Cell,
    Commits,
    Html,
    _ago,
    _badge,
    _code,
    _epoch,
    _facts,
    _h,
    _join,
    _sha,
    _sync_time,
    _when,
)
from .queue import QueueReader


class Site:
    """What every page shows (the header), read at request time from the store and the mirror."""

    def __init__(
        self,
        reconciler: Any,
        store: Store,
        repository: str,
        branch: str,
        poll: float | None,
        forge: str | None = None,
    ) -> None:
        self.reconciler = reconciler
        self.forge = forge
        self.store = store
        self.repository = repository
        self.branch = branch
        self.poll_interval = poll
        self.commits = Commits(self._mirror_path)
        # (env, name) -> an autoscaled function's replicas and cold starts (scaling.describe)
        self.scaling: Callable[[str, str], dict[str, Any] | None] | None = None
        # asynchronous invocations: counts and dead letters (no service: none shown)
        self.queue = QueueReader(None)
        # the proxy's table (how warm each kept revision is) and where functions answer
        self.routes = RouteTable()
        self.fn_url = ""
        self.trace_url = ""  # --trace-url-template: where a call's trace is shown

    def _mirror_path(self) -> Path | None:
        path = getattr(getattr(self.reconciler, "source", None), "path", None)
        return Path(path) if path else None

    def _status(self) -> Status:
        env = self.reconciler.env
        return Status.from_rows(
            repository=self.repository,
            branch=self.branch,
            environment=env,
            functions=self.store.functions(env),
            syncs=self.store.syncs(MAX_SYNCS, env),
        )

    # the header, on every page ----------------------------------------------------------

    def header(self, status: Status, now: float, signout: Html = NO_HTML) -> Html:
        facts: list[tuple[str, Cell]] = [
            ("Repository", _code(status.repository)),
            ("Branch", _code(status.branch)),
            ("Revision", self._revision(status, now)),
            ("Last sync", self._last_sync(status.last_sync, now)),
        ]
        if self.poll_interval:
            facts.append(("Next poll", self._next_poll(status.last_sync, now)))
        sync = status.last_sync
        error = _h('<pre class="sync-error">{e}</pre>', e=sync.error) if sync and sync.error else ""
        return _h(
            '<header id="top" class="top" data-live><p class="brand"><a href="/">gitops-sless'
            "</a></p>{signout}{facts}{error}</header>",
            signout=signout,
            facts=_facts(facts),
            error=Html(error),
        )

    def _revision(self, status: Status, now: float) -> Html:
        revision = status.fetched_revision
        if not revision:
            return Html("nothing fetched yet")
        parts = [_sha(revision)]
        commit = self.commits.get(revision)
        if commit:
            parts.append(_h(' <span class="subject">{s}</span>', s=commit.subject))
            ago = _ago(now - commit.time)
            parts.append(_h(' <span class="muted">{a}, {ago}</span>', a=commit.author, ago=ago))
        good = status.last_good_revision
        if good and good != revision:
            parts.append(_h(' <span class="muted">(last good {g})</span>', g=_sha(good)))
        return _join(parts)

    def _last_sync(self, sync: Sync | None, now: float) -> Html:
        if sync is None:
            return Html("no sync yet")
        return _h(
            "{badge} {trigger}, {when}",
            badge=_badge(sync.result),
            trigger=sync.trigger,
            when=_when(_sync_time(sync), now),
        )

    def _next_poll(self, sync: Sync | None, now: float) -> str:
        """An estimate: polls come every interval, and the latest pass is usually one."""
        interval = self.poll_interval or 0
        if sync is not None and sync.result == "Running":
            return "a sync is running"
        last = _sync_time(sync) if sync else None
        due = _epoch(last) + interval - now if last else interval
        return f"in about {math.ceil(due)} s (every {interval:g} s)" if due >= 1 else "due now"

    # the index ----------------------------------------------------------------------------
