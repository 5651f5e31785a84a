"""A function's asynchronous invocations on the dashboard: how many are in each status,
and the newest dead letters with their causes.

The counts are the service's own (:meth:`Invocations.counts`, counted every few
seconds, a plain read from any thread). The dead letters are a listing, a coroutine on
the loop that runs the service: :meth:`QueueReader.read` is awaited there by the
function page's route, which renders the page in a worker thread afterwards. A listing
is read again only when the counts change (or ``KEEP_SEC`` later), so an open page's
refresh every few seconds does not read a function's dead letters each time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import quote, urlencode

from ...invocations import model
from ...invocations.service import Invocations
from ...timestamps import rfc3339
from .html import DASH, NO_HTML, Html, _clip, _code, _facts, _h, _section, _table, _tr, _when

__all__ = ["DeadLetter", "Queue", "QueueReader", "dead_badge", "section"]

_log = logging.getLogger(__name__)

SHOWN = 10  # dead letters on the page
SCAN = 200  # dead letters read to find the newest (ids do not sort by time)
READ_TIMEOUT_SEC = 2.0  # a queue that does not answer leaves the page without its list
# a listing is read again after this long even when the counts are the same (a redrive
# that died again between two countings)
KEEP_SEC = 10.0
MAX_KEPT = 1024
_DEAD_COLUMNS = ("Invocation", "Died", "Attempts", "Cause")


@dataclass(frozen=True)
class DeadLetter:
    """What the page shows of one dead invocation (never its request or response)."""

    id: str
    died: float | None
    attempts: int
    cause: str

    @classmethod
    def of(cls, inv: model.Invocation) -> DeadLetter:
        last = inv.attempts[-1].error if inv.attempts else None
        cause = inv.error or last or "no cause recorded"
        if last and last not in cause:  # the error an attempt met, under the reason it died
            cause = f"{cause}; last attempt: {last}"
        return cls(inv.id, inv.ended, inv.attempt, cause)


@dataclass(frozen=True)
class Queue:
    """A function's invocations by status, its newest dead letters, or why they are not read."""

    counts: dict[str, int]
    dead: tuple[DeadLetter, ...] = field(default=())
    scanned: int = 0  # how many dead letters were read to find the newest
    problem: str | None = None


# per (env, name): the counts when read, when (monotonic), how many read, the newest
_Kept = tuple[tuple[int, ...], float, int, tuple[DeadLetter, ...]]


class QueueReader:
    """Reads a function's :class:`Queue` from the service, on the service's loop."""

    def __init__(self, service: Invocations | None) -> None:
        self.service = service
        self._kept: dict[tuple[str, str], _Kept] = {}

    def counts(self, env: str, name: str) -> dict[str, int] | None:
        """The counts (None: the queue is off); any thread."""
        if self.service is None or not self.service.enabled:
            return None
        return self.service.counts(env, name)

    async def read(self, env: str, name: str) -> Queue | None:
        """None when the function has no asynchronous invocations (or the queue is off)."""
        counts = self.counts(env, name)
        if not counts or not any(counts.values()):
            return None
        if not counts.get(model.DEAD):
            return Queue(counts)
        key = tuple(counts.get(status, 0) for status in model.STATUSES)
        kept = self._kept.get((env, name))
        now = time.monotonic()
        if kept and kept[0] == key and now - kept[1] < KEEP_SEC:
            return Queue(counts, kept[3], kept[2])
        assert self.service is not None
        which = model.Filter(env=env, function=name, status=model.DEAD, limit=SCAN)
        try:
            found = await asyncio.wait_for(self.service.list(which), READ_TIMEOUT_SEC)
        except Exception as exc:  # the queue down or slow: the page still shows
            _log.warning("the dead letters of %s/%s cannot be read: %s", env, name, exc)
            return Queue(counts, problem=str(exc) or type(exc).__name__)
        newest = sorted(found, key=lambda inv: inv.ended or inv.created, reverse=True)
        dead = tuple(DeadLetter.of(inv) for inv in newest[:SHOWN])
        if len(self._kept) >= MAX_KEPT:
            self._kept.clear()
        self._kept[(env, name)] = (key, now, len(found), dead)
        return Queue(counts, dead, len(found))


def section(env: str, name: str, queue: Queue | None, now: float) -> Html:
    """The function page's section; nothing for a function without asynchronous calls."""
    if queue is None:
        return NO_HTML
    counts = queue.counts
    facts = _facts((status.capitalize(), str(counts.get(status, 0))) for status in model.STATUSES)
    listing = "/api/v1/invocations?" + urlencode({"env": env, "function": name})
    note = _h(
        '<p class="muted">Counted every few seconds; <a href="{href}" data-api>the API lists '
        "them</a>.</p>",
        href=listing,
    )
    return _section(
        "async", "Asynchronous invocations", Html(facts + note + _dead(env, name, queue, now))
    )


def _dead(env: str, name: str, queue: Queue, now: float) -> Html:
    dead = queue.counts.get(model.DEAD, 0)
    if not dead:
        return NO_HTML
    if queue.problem is not None:
        return _h(
            '<h3>Dead letters</h3><p class="error">They cannot be read now: {p}</p>',
            p=queue.problem,
        )
    rows = (
        _tr(
            _DEAD_COLUMNS,
            [
                _h(
                    '<a href="/api/v1/invocations/{id}" data-api><code>{id}</code></a>',
                    id=quote(letter.id, safe=""),
                ),
                _when(rfc3339(letter.died), now) if letter.died else DASH,
                str(letter.attempts),
                _clip(letter.cause),
            ],
            _h(' id="dead-{id}"', id=letter.id),
        )
        for letter in queue.dead
    )
    shown = len(queue.dead)
    of = f"The newest {shown} of {dead}" if dead > shown else f"All {shown}, the newest first"
    if queue.scanned >= SCAN and dead > SCAN:
        of += f" (the newest of the {SCAN} read)"
    redrive = f"gitops-sless invocations redrive --dead --env {env} --function {name}"
    return _h(
        '<h3 id="dead-letters">Dead letters</h3><p class="muted">{of}; {cmd} queues them '
        "again.</p>{table}",
        of=of,
        cmd=_code(redrive),
        table=_table(_DEAD_COLUMNS, rows),
    )


def dead_badge(counts: dict[str, int] | None) -> Html:
    """The overview's "N dead" next to a function with dead letters."""
    dead = (counts or {}).get(model.DEAD, 0)
    if not dead:
        return NO_HTML
    return _h(
        ' <span class="badge bad" title="{n} asynchronous invocations dead">'
        '<span aria-hidden="true">✕</span> {n} dead</span>',
        n=dead,
    )
