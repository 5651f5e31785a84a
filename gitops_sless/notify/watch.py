"""What is worth telling each provider now: the store's records compared with what the
provider was last told (``notified`` rows, kept across restarts).

Events are derived, not caught in flight: each look reads every function's phase,
every job's latest run, the previews and the dead letters, and says what changed for
the provider since it was last told. So a function that fails pass after pass is one
incident (one ``buildFailed``, ``startFailed`` or ``jobFailed`` message), ended by one
``resolved`` message that says how long it lasted once the function is Ready (or the
job's run succeeds, or the function is gone); and a reconciler that restarts in the
middle of it says neither again. A function that crash-loops (Ready while up, Failed in
its backoff) is one incident too: it resolves only once healthy for ``GRACE_SEC``, and a
failure within that time keeps it open. ``deployed`` is said once per revision a function
serves; a function that already served before the provider first looked is not
announced (its ``serving`` row is older than the provider's first look).

A row that an event stands for is written only once the event is delivered
(:meth:`Watcher.delivered`, called by the provider's outbox): until then it is *pending*,
and each look reads the stored rows with the pending ones laid over them, so an event
that waits in an outbox (a receiver down, retries) is not queued again. An event never
delivered (the server stopped, the outbox overflowed, the receiver refused it) has no
row, so the next server derives and sends it once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..state.store import Store
from .config import Provider
from .events import Event

__all__ = ["Watcher"]

HEALTHY = ("Ready", "Disabled", "Idle")  # Idle: scaled to zero, as elsewhere

GRACE_SEC = 60.0  # healthy this long before an incident resolves (SLESS_NOTIFY_GRACE_SEC)

_Key = tuple[str, str, str]  # provider, kind, subject
_Row = dict[str, Any] | None  # {"value", "since"}; None: the row is forgotten


@dataclass(frozen=True)
class _Function:
    env: str
    name: str
    failing: str | None  # buildFailed | startFailed | None
    healthy: bool
    cause: str | None
    served: str | None  # what it serves now (revision and build), Ready only
    record: Mapping[str, Any]


@dataclass(frozen=True)
class _Job:
    env: str
    name: str
    failing: bool
    healthy: bool
    cause: str | None


@dataclass(frozen=True)
class _Facts:
    functions: tuple[_Function, ...]
    jobs: tuple[_Job, ...]
    previews: tuple[Mapping[str, Any], ...]
    dead: Mapping[tuple[str, str], int]


class Watcher:
    """Reads the store once per look and tells each provider only what is news to it."""

    def __init__(
        self,
        store: Store,
        public_url: str,
        author: Callable[[str], str | None] = lambda commit: None,
        dead_letters: Callable[[], Mapping[tuple[str, str], int]] = dict,
        *,
        clock: Callable[[], float] = time.time,
        grace_sec: float = GRACE_SEC,
    ) -> None:
        self.store, self.public_url = store, public_url.rstrip("/")
        self.author = author
        self.dead_letters = dead_letters
        self.clock, self.grace_sec = clock, grace_sec
        self.started = clock()  # a provider's first look counts from here (or follow())
        self.healthy: dict[str, float] = {}  # subject -> since when it has been healthy
        self.healing = False  # the last look kept an incident open for its grace
        self._mark: tuple[Any, ...] | None = None  # what the last look saw
        self._lock = threading.Lock()
        self._pending: dict[_Key, list[tuple[Event, _Row]]] = {}  # oldest first
        self._waiting: dict[int, tuple[Event, _Key]] = {}  # id(event) -> its row's key

    def follow(self) -> None:
        """This replica does not lead (Kubernetes): what is deployed meanwhile is the
        leader's to announce, so a first look, once it leads, counts from now."""
        self.started = self.clock()

    def rows(self, provider: str, kind: str) -> dict[str, dict[str, Any]]:
        """What ``provider`` was told of each subject, or will have been once what waits
        in its outbox is delivered."""
        with self._lock:  # not between delivered()'s write and its end: no row missed
            found = self.store.notified(provider, kind)
            for (name, k, subject), waiting in self._pending.items():
                if name != provider or k != kind:
                    continue
                row = waiting[-1][1]
                if row is None:
                    found.pop(subject, None)
                else:
                    found[subject] = row
        return found

    def pend(self, event: Event, key: _Key, row: _Row) -> None:
        """``row`` is written (None: forgotten) once ``event`` is delivered."""
        with self._lock:
            self._pending.setdefault(key, []).append((event, row))
            self._waiting[id(event)] = (event, key)

    def delivered(self, events: Iterable[Event]) -> None:
        """The outbox delivered ``events``: write the rows they stand for."""
        for event in events:
            with self._lock:
                event_, key = self._waiting.pop(id(event), (None, None))
                if event_ is not event or key is None:
                    continue  # not the watcher's (a rollback), or already written
                waiting = self._pending[key]
                row = next(r for e, r in waiting if e is event)
                waiting[:] = [(e, r) for e, r in waiting if e is not event]
                if not waiting:
                    del self._pending[key]
                provider, kind, subject = key
                if row is None:
                    self.store.forget_notified(provider, kind, subject)
                else:
                    self.store.set_notified(provider, kind, subject, row["value"], row["since"])

    def look(self, providers: Iterable[Provider]) -> dict[str, list[Event]]:
        """provider name -> its new events; what they say is written down once delivered
        (:meth:`delivered`). A look at a store that changed in nothing events are derived
        from reads no more of it (unless an incident waits out its grace)."""
        dead = dict(self.dead_letters())
        mark = (self.store.notify_mark(), sorted(dead.items()))
        if mark == self._mark and not self.healing:
            return {}
        facts = self._facts(dead)
        self._health(facts, self.clock())
        self.healing = False
        found = {p.name: _Told(self, p).news(facts) for p in providers}
        self._mark = mark
        return found

    def _health(self, facts: _Facts, now: float) -> None:
        subjects = [(f"{f.env}/{f.name}", f.healthy) for f in facts.functions]
        subjects += [(f"{j.env}/job/{j.name}", j.healthy) for j in facts.jobs]
        healthy = {subject for subject, ok in subjects if ok}
        self.healthy = {s: self.healthy.get(s, now) for s in healthy}

    def _facts(self, dead: Mapping[tuple[str, str], int]) -> _Facts:
        functions: list[_Function] = []
        jobs: list[_Job] = []
        for env in self.store.environments():
            functions += [self._function(env, r) for r in self.store.functions(env)]
            latest: dict[str, dict[str, Any]] = {}
            for run in self.store.jobs(env):  # newest run first, by name
                latest.setdefault(run["name"], run)
            jobs += [
                _Job(env, n, r["phase"] == "Failed", r["phase"] == "Succeeded", r["error"])
                for n, r in latest.items()
            ]
        previews = tuple(self.store.previews())
        return _Facts(tuple(functions), tuple(jobs), previews, dead)

    def _function(self, env: str, record: Mapping[str, Any]) -> _Function:
        phase = record["phase"]
        failing = None
        if phase == "Failed":
            build = self.store.build_of(dict(record))
            failing = "buildFailed" if build and build["phase"] == "Failed" else "startFailed"
        served = None
        if phase == "Ready":
            served = record.get("serving_revision") or record.get("build_tag")
        return _Function(
            env, record["name"], failing, phase in HEALTHY, record["message"], served, record
        )


class _Told:
    """One provider's look: its rows, read once, and the events that differ from them."""

    def __init__(self, watcher: Watcher, provider: Provider) -> None:
        self.w, self.p, self.store = watcher, provider, watcher.store
        self.now = watcher.clock()
        meta = self.store.notified(provider.name, "meta").get("started")
        if meta is None:
            self.store.set_notified(provider.name, "meta", "started", "", watcher.started)
        self.started = meta["since"] if meta else watcher.started
        self.events: list[Event] = []

    def news(self, facts: _Facts) -> list[Event]:
        self._incidents(facts)
        self._deployed(facts.functions)
        self._previews(facts.previews)
        self._dead(facts.dead)
        return self.events

    def _rows(self, kind: str) -> dict[str, dict[str, Any]]:
        return self.w.rows(self.p.name, kind)

    def _set(self, kind: str, subject: str, value: str, since: float | None = None) -> None:
        """A row no event stands for (what served before the first look): written now."""
        self.store.set_notified(self.p.name, kind, subject, value, since or self.now)

    def _forget(self, kind: str, subject: str) -> None:
        self.store.forget_notified(self.p.name, kind, subject)

    def _say(self, event: Event, kind: str, subject: str, value: str | None) -> None:
        """Queue ``event``; its row (``value``; None: forgotten) is written once delivered."""
        row = None if value is None else {"value": value, "since": self.now}
        self.w.pend(event, (self.p.name, kind, subject), row)
        self.events.append(event)

    # --- failures and their end ----------------------------------------------------------

    def _incidents(self, facts: _Facts) -> None:
        open_ = self._rows("incident")
        seen: set[str] = set()
        for fn in facts.functions:
            subject = f"{fn.env}/{fn.name}"
            seen.add(subject)
            self._incident(subject, open_, fn.failing, fn.healthy, fn.env, fn.name, fn.cause)
        for job in facts.jobs:
            subject = f"{job.env}/job/{job.name}"
            seen.add(subject)
            failing = "jobFailed" if job.failing else None
            self._incident(subject, open_, failing, job.healthy, job.env, job.name, job.cause)
        for subject, row in open_.items():
            if subject not in seen:  # removed from the repository, or its preview closed
                env, _, rest = subject.partition("/")
                job = rest.startswith("job/")
                name = rest.removeprefix("job/") if job else rest
                cause = "no longer declared"
                gone = Event("resolved", env, name, job, cause=cause, at=self.now)
                self._resolve(subject, row, gone)

    def _incident(
        self,
        subject: str,
        open_: Mapping[str, Mapping[str, Any]],
        failing: str | None,
        healthy: bool,
        env: str,
        name: str,
        cause: str | None,
    ) -> None:
        job = failing == "jobFailed" or subject.startswith(f"{env}/job/")
        if failing and subject not in open_ and self.p.wants(failing, env, name):
            self._say(Event(failing, env, name, job, cause=cause), "incident", subject, failing)
        elif healthy and subject in open_:
            since = self.w.healthy.get(subject, self.now)
            if self.now - since < self.w.grace_sec:  # it may fail again: not over yet
                self.w.healing = True
                return
            event = Event("resolved", env, name, job, at=since)
            self._resolve(subject, open_[subject], event)

    def _resolve(self, subject: str, row: Mapping[str, Any], event: Event) -> None:
        if not self.p.hears_of(event.env, event.function):
            self._forget("incident", subject)
            return
        resolved = Event(
            "resolved",
            event.env,
            event.function,
            event.job,
            cause=event.cause,
            was=row["value"],
            since=row["since"],
            at=event.at,
        )
        self._say(resolved, "incident", subject, None)

    # --- deploys, previews, dead letters ------------------------------------------------

    def _deployed(self, functions: Iterable[_Function]) -> None:
        told = self._rows("deployed")
        since: dict[str, dict[str, float]] = {}  # env -> function -> when it was deployed
        present: set[str] = set()
        for fn in functions:
            subject = f"{fn.env}/{fn.name}"
            present.add(subject)
            if fn.served is None or not self.p.wants("deployed", fn.env, fn.name):
                continue
            if told.get(subject, {}).get("value") == fn.served:
                continue
            if subject not in told:
                if fn.env not in since:
                    rows = self.store.serving(fn.env)
                    since[fn.env] = {r["name"]: r["deployed"] for r in rows}
                if since[fn.env].get(fn.name, self.now) < self.started:
                    self._set("deployed", subject, fn.served)  # served before we looked
                    continue
            self._say(self._deploy_event(fn), "deployed", subject, fn.served)
        for subject in set(told) - present:
            self._forget("deployed", subject)

    def _deploy_event(self, fn: _Function) -> Event:
        record = fn.record
        commit = record.get("revision")
        try:
            author = self.w.author(commit) if commit else None
        except Exception:  # the mirror is being fetched into, or the commit is gone
            author = None
        return Event(
            "deployed",
            fn.env,
            fn.name,
            revision=record.get("serving_revision") or record.get("build_tag"),
            commit=commit,
            author=author,
            url=record.get("url"),
        )

    def _previews(self, previews: Iterable[Mapping[str, Any]]) -> None:
        told = self._rows("preview")
        present = {f"pr-{row['number']}" for row in previews}
        for env in set(told) - present:  # its row is gone: closed, whatever we said last
            if told[env]["value"] != "Closed" and self.p.wants("previewClosed", env, None):
                self._say(Event("previewClosed", env), "preview", env, None)
            else:
                self._forget("preview", env)
        for row in previews:
            env = f"pr-{row['number']}"
            if row["state"] == "Ready":
                kind, value = "previewReady", f"Ready {row['head']}"
            elif row["state"] in ("Closed", "TearingDown"):
                kind, value = "previewClosed", "Closed"
            else:
                continue
            if told.get(env, {}).get("value") == value or not self.p.wants(kind, env, None):
                continue
            if env not in told and row["updated"] < self.started:
                self._set("preview", env, value)
                continue  # so before we first looked
            url = f"{self.w.public_url}/fn/{env}/" if kind == "previewReady" else None
            self._say(Event(kind, env, commit=row["head"], url=url), "preview", env, value)

    def _dead(self, dead: Mapping[tuple[str, str], int]) -> None:
        told = self._rows("dead")
        for (env, name), count in sorted(dead.items()):
            subject = f"{env}/{name}"
            before = int(told.get(subject, {}).get("value", "0"))
            if count == before or not self.p.wants("deadLettered", env, name):
                continue
            if count > before:
                event = Event("deadLettered", env, name, count=count - before, total=count)
                self._say(event, "dead", subject, str(count))
            else:
                self._set("dead", subject, str(count))
        present = {f"{env}/{name}" for env, name in dead}
        for subject in set(told) - present:  # its dead letters expired: start again at 0
            self._forget("dead", subject)
