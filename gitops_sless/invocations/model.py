"""One asynchronous invocation, as every queue engine keeps it: the request as it came
in, its attempts, its response, and the callback that reports its end.

Plain values, turned to and from JSON (:meth:`Invocation.to_json`) so that an engine
that keeps records as documents (NATS's key-value bucket) and one that keeps them in
rows (SQLite) hold exactly the same thing.
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "ENDED",
    "MAX_RESPONSE_BYTES",
    "STATUSES",
    "Attempt",
    "Callback",
    "Filter",
    "Invocation",
    "Response",
    "new_id",
]

QUEUED, RUNNING, SUCCEEDED, FAILED, DEAD = "queued", "running", "succeeded", "failed", "dead"
STATUSES = (QUEUED, RUNNING, SUCCEEDED, FAILED, DEAD)
ENDED = frozenset({SUCCEEDED, FAILED, DEAD})
# the most response body bytes kept in a record; the rest is cut (``Response.truncated``)
MAX_RESPONSE_BYTES = 256 * 1024


def new_id() -> str:
    """A 26-character id that sorts by submission time: 48 bits of milliseconds, then
    80 random bits, in lowercase base32hex (RFC 4648 §7: its alphabet is in ASCII order,
    so ids compare as their times do and ``list`` reads newest last)."""
    raw = (time.time_ns() // 1_000_000).to_bytes(6, "big") + os.urandom(10)
    return base64.b32hexencode(raw).decode("ascii").rstrip("=").lower()


@dataclass(frozen=True)
class Attempt:
    """One try: when it ran, what the function answered (None: no answer) and why it
    failed (None: it did not)."""

    number: int  # 1 for the first
    started: float  # seconds since the epoch
    ended: float | None = None
    status_code: int | None = None
    error: str | None = None
    # False: cut short by the reconciler's own stop (a kill, a restart): not the
    # function's failure, so it does not count against ``retries``
    counted: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "started": self.started,
            "ended": self.ended,
            "statusCode": self.status_code,
            "error": self.error,
            "counted": self.counted,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Attempt:
        return cls(
            data["number"],
            data["started"],
            data["ended"],
            data["statusCode"],
            data["error"],
            data["counted"],
        )


@dataclass(frozen=True)
class Response:
    """The function's answer to the attempt that ended the invocation."""

    status_code: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    truncated: bool = False  # the body was longer than MAX_RESPONSE_BYTES

    def to_json(self) -> dict[str, Any]:
        return {
            "statusCode": self.status_code,
            "headers": [list(h) for h in self.headers],
            "body": base64.b64encode(self.body).decode("ascii"),
            "truncated": self.truncated,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Response:
        return cls(
            data["statusCode"],
            tuple((k, v) for k, v in data["headers"]),
            base64.b64decode(data["body"]),
            data["truncated"],
        )


@dataclass(frozen=True)
class Callback:
    """Where the outcome goes when the invocation ends, and how that delivery went."""

    url: str
    state: str = "waiting"  # waiting (for the end), pending, delivered, failed
    attempts: int = 0
    next_at: float = 0.0  # seconds since the epoch: when to try again (state pending)
    error: str | None = None  # why the last delivery failed

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": self.state,
            "attempts": self.attempts,
            "nextAt": self.next_at,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Callback:
        return cls(data["url"], data["state"], data["attempts"], data["nextAt"], data["error"])


@dataclass(frozen=True)
class Invocation:
    """One asynchronous call of a function in an environment.

    ``path`` is the sub-path and query sent to the function (``/orders?x=1``), as a
    synchronous call through ``/fn/{env}/{name}`` would send it; ``headers`` are the
    client's, in order (the proxy adds its own at each attempt, as for any call);
    ``client`` is the address the request came from, for ``X-Forwarded-For``.
    """

    id: str
    env: str
    function: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    created: float  # seconds since the epoch
    client: str | None = None
    status: str = QUEUED
    attempts: tuple[Attempt, ...] = ()
    next_at: float = 0.0  # seconds since the epoch: not started before (a retry's backoff)
    response: Response | None = None
    error: str | None = None  # why it failed or died
    ended: float | None = None
    idempotency_key: str | None = None
    callback: Callback | None = None
    subject: str | None = None  # the queue trigger's subject that made it, if one did
    # attempts before this index belong to earlier rounds: a redrive starts a new one
    round_start: int = 0
    # when the round began (a redrive; None: at submission): maxAge counts from it
    round_started: float | None = None

    @property
    def attempt(self) -> int:
        """How many attempts have started."""
        return len(self.attempts)

    @property
    def failures(self) -> int:
        """Failed attempts of this round that count against ``retries``."""
        return sum(1 for a in self.attempts[self.round_start :] if a.counted and a.error)

    @property
    def age_from(self) -> float:
        """When this round began: maxAge counts from here."""
        return self.created if self.round_started is None else self.round_started

    def evolve(self, **changes: Any) -> Invocation:
        return replace(self, **changes)

    def redriven(self, now: float) -> Invocation:
        """Queued again for a new round, due now: its attempts kept as history, its last
        outcome cleared, its callback waiting for the new end, maxAge counted anew."""
        callback = None if self.callback is None else Callback(self.callback.url)
        return replace(
            self,
            status=QUEUED,
            next_at=now,
            round_start=len(self.attempts),
            round_started=now,
            error=None,
            ended=None,
            response=None,
            callback=callback,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "env": self.env,
            "function": self.function,
            "method": self.method,
            "path": self.path,
            "headers": [list(h) for h in self.headers],
            "body": base64.b64encode(self.body).decode("ascii"),
            "created": self.created,
            "client": self.client,
            "status": self.status,
            "attempts": [a.to_json() for a in self.attempts],
            "nextAt": self.next_at,
            "response": None if self.response is None else self.response.to_json(),
            "error": self.error,
            "ended": self.ended,
            "idempotencyKey": self.idempotency_key,
            "callback": None if self.callback is None else self.callback.to_json(),
            "subject": self.subject,
            "roundStart": self.round_start,
            "roundStarted": self.round_started,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Invocation:
        return cls(
            id=data["id"],
            env=data["env"],
            function=data["function"],
            method=data["method"],
            path=data["path"],
            headers=tuple((k, v) for k, v in data["headers"]),
            body=base64.b64decode(data["body"]),
            created=data["created"],
            client=data["client"],
            status=data["status"],
            attempts=tuple(Attempt.from_json(a) for a in data["attempts"]),
            next_at=data["nextAt"],
            response=None if data["response"] is None else Response.from_json(data["response"]),
            error=data["error"],
            ended=data["ended"],
            idempotency_key=data["idempotencyKey"],
            callback=None if data["callback"] is None else Callback.from_json(data["callback"]),
            subject=data["subject"],
            round_start=data["roundStart"],
            round_started=data.get("roundStarted"),  # not in records of before 2026-12-06
        )


@dataclass(frozen=True)
class Filter:
    """Which invocations a listing wants: every field that is set must match."""

    env: str | None = None
    function: str | None = None
    status: str | None = None
    limit: int = 100
    # ids sort by time: a page after this id (the last of the previous page)
    after: str | None = None
    statuses: frozenset[str] = field(default_factory=frozenset)

    def matches(self, inv: Invocation) -> bool:
        return (
            (self.env is None or inv.env == self.env)
            and (self.function is None or inv.function == self.function)
            and (self.status is None or inv.status == self.status)
            and (not self.statuses or inv.status in self.statuses)
            and (self.after is None or inv.id > self.after)
        )
