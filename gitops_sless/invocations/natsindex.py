"""What the NATS engine knows of every record without reading it: an in-memory index.

Counting, listing, finding due callbacks and what to collect would otherwise read
every record of the key-value bucket (bodies and responses included) each time the
status API or housekeeping asks, every few seconds. Instead each record written
carries a one-line summary in a message header (:data:`HEADER`: status, env,
function, times, callback state), and every engine follows the bucket with a
headers-only consumer (the values never travel), so each replica holds a small
summary per record, updated as any replica writes.

Entries are ordered by the bucket's revision (the stream sequence): an engine applies
its own writes at once (so it reads what it wrote), and an older revision arriving
later from the watch never undoes a newer one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.js import api

from .engine import Counts
from .model import ENDED, QUEUED, RUNNING, STATUSES, Filter, Invocation

__all__ = ["HEADER", "IndexWatch", "RecordIndex", "Summary", "summary_of"]

_log = logging.getLogger(__name__)

HEADER = "Sless-Index"
KV_OPERATION = "KV-Operation"
MARKER_REASON = "Nats-Marker-Reason"  # the server's own markers (a TTL ran out)
ACTIVE = frozenset({QUEUED, RUNNING})


@dataclass(frozen=True, slots=True)
class Summary:
    revision: int
    status: str
    env: str
    function: str
    created: float
    ended: float | None
    callback: str | None  # the callback's state, None without one
    callback_at: float

    def matches(self, which: Filter) -> bool:
        return (
            (which.env is None or self.env == which.env)
            and (which.function is None or self.function == which.function)
            and (which.status is None or self.status == which.status)
            and (not which.statuses or self.status in which.statuses)
        )


def summary_of(inv: Invocation) -> str:
    """The header line for a record (names hold no spaces: they are DNS labels)."""
    cb = inv.callback
    return " ".join(
        (
            inv.status,
            inv.env,
            inv.function,
            repr(inv.created),
            "-" if inv.ended is None else repr(inv.ended),
            "-" if cb is None else cb.state,
            "0" if cb is None else repr(cb.next_at),
        )
    )


def _parse(revision: int, line: str) -> Summary | None:
    try:
        status, env, function, created, ended, callback, callback_at = line.split(" ")
        return Summary(
            revision,
            status,
            env,
            function,
            float(created),
            None if ended == "-" else float(ended),
            None if callback == "-" else callback,
            float(callback_at),
        )
    except ValueError:
        return None


class RecordIndex:
    """Summaries by invocation id; deletions remembered until the watch passes them."""

    def __init__(self) -> None:
        self._entries: dict[str, Summary] = {}
        # id -> the revision of its deletion: a late write seen by the watch must not
        # bring a collected record back
        self._gone: dict[str, int] = {}
        # (env, function) -> its invocations queued or running, kept as entries change:
        # the delivery loop asks every second
        self._active: Counter[tuple[str, str]] = Counter()
        # told when a function gets work where it had none (any replica's submit): its
        # delivery loop starts without waiting for the next look
        self.on_active: Callable[[str, str], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, revision: int, line: str | None) -> None:
        if revision <= self._gone.get(key, 0):
            return
        known = self._entries.get(key)
        if known is not None and known.revision >= revision:
            return
        summary = _parse(revision, line) if line else None
        if summary is None:  # written by something else than this engine: not ours
            return
        self._set(key, summary)

    def _set(self, key: str, summary: Summary | None) -> None:
        known = self._entries.pop(key, None)
        if known is not None and known.status in ACTIVE:
            pair = (known.env, known.function)
            self._active[pair] -= 1
            if not self._active[pair]:
                del self._active[pair]
        if summary is not None:
            self._entries[key] = summary
            if summary.status in ACTIVE:
                pair = (summary.env, summary.function)
                self._active[pair] += 1
                if self._active[pair] == 1 and self.on_active is not None:
                    self.on_active(*pair)

    def forget(self, key: str, revision: int, *, seen_by_watch: bool) -> None:
        known = self._entries.get(key)
        if known is not None and known.revision < revision:
            self._set(key, None)
        if seen_by_watch:
            # the watch reached the deletion: nothing older can come after it
            if self._gone.get(key, 0) <= revision:
                self._gone.pop(key, None)
        elif revision > self._gone.get(key, 0):
            self._gone[key] = revision

    def get(self, key: str) -> Summary | None:
        return self._entries.get(key)

    def counts(self) -> Counts:
        statuses: dict[tuple[str, str], dict[str, int]] = defaultdict(
            lambda: dict.fromkeys(STATUSES, 0)
        )
        oldest: dict[tuple[str, str], float] = {}
        for s in self._entries.values():
            key = (s.env, s.function)
            found = statuses[key]
            found[s.status] = found.get(s.status, 0) + 1
            if s.status == QUEUED and (key not in oldest or s.created < oldest[key]):
                oldest[key] = s.created
        return {key: (found, oldest.get(key)) for key, found in statuses.items()}

    def ids(self, which: Filter) -> list[str]:
        """Ids that may match ``which`` (the records say for sure), in id order."""
        after = which.after
        return sorted(
            key
            for key, s in self._entries.items()
            if (after is None or key > after) and s.matches(which)
        )

    def due_callbacks(self, now: float) -> list[str]:
        """Ids of due callbacks, the longest due first."""
        due = [
            (s.callback_at, key)
            for key, s in self._entries.items()
            if s.status in ENDED and s.callback == "pending" and s.callback_at <= now
        ]
        return [key for _, key in sorted(due)]

    def ended_before(self, before: float) -> list[str]:
        return sorted(
            key
            for key, s in self._entries.items()
            if s.status in ENDED and s.ended is not None and s.ended < before
        )

    def active_functions(self) -> set[tuple[str, str]]:
        """(env, function) of every invocation queued or running: where work waits."""
        return set(self._active)

    def active(self, env: str, function: str) -> bool:
        return (env, function) in self._active

    def with_status(self, env: str, function: str, status: str) -> list[str]:
        return sorted(
            key
            for key, s in self._entries.items()
            if s.env == env and s.function == function and s.status == status
        )


class IndexWatch:
    """Keeps a :class:`RecordIndex` up to date from the records' stream.

    An ordered consumer, headers only, last value per key first: nats-py recreates it
    from the last sequence it saw when the connection or the server comes back.
    """

    def __init__(self, js: Any, stream: str, key_prefix: str, index: RecordIndex) -> None:
        self.js = js
        self.stream = stream
        self.key_prefix = key_prefix
        self.index = index
        self.synced = asyncio.Event()
        self._sub: Any = None

    async def start(self, timeout: float) -> None:
        """Subscribe and wait until the index holds every record written so far."""
        self._sub = await self.js.subscribe(
            f"{self.key_prefix}>",
            stream=self.stream,
            cb=self._on_message,
            ordered_consumer=True,
            headers_only=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            idle_heartbeat=2.0,
        )
        info = await self._sub.consumer_info()
        if info.num_pending == 0 and info.delivered.stream_seq == 0:
            self.synced.set()
        await asyncio.wait_for(self.synced.wait(), timeout)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may be gone already
                _log.debug("index watch: unsubscribe: %s", exc)

    async def _on_message(self, msg: Any) -> None:
        revision, pending = _positions(msg)
        key = msg.subject[len(self.key_prefix) :]
        headers = msg.headers or {}
        if KV_OPERATION in headers or MARKER_REASON in headers:
            self.index.forget(key, revision, seen_by_watch=True)
        else:
            self.index.put(key, revision, headers.get(HEADER))
        if pending == 0:
            self.synced.set()


def _positions(msg: Any) -> tuple[int, int]:
    """A delivered message's stream sequence and the messages still pending, from its
    ack subject (``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>
    .<time>.<pending>``, or with a domain and an account hash after ``ACK``): every
    record write comes back through the watch, and nats-py's ``metadata`` builds
    three objects for these two numbers."""
    tokens = msg.reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[8])
    meta = msg.metadata
    return meta.sequence.stream, meta.num_pending
