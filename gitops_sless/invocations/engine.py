"""What a queue engine does: keep invocations durably and hand them out to run.

Two engines behave the same (``tests/invocations/test_engine_contract.py`` runs the
same tests on both): :mod:`.sqlite`, embedded in the state directory, and
:mod:`.nats`, NATS JetStream for a cluster. The engine owns *storing* and
*delivering*; what an attempt does and what its outcome means (retry, dead, a
callback) is the :class:`Worker`'s, the same for both.

The rules every engine keeps:

- ``submit`` returns only once the invocation is durable: a kill -9 right after
  loses nothing.
- ``consume`` hands an invocation to one worker at a time, in any replica, and at
  most ``worker.concurrency(env, function)`` of one function at once (across every
  replica where the engine can: NATS counts acks pending).
- An invocation whose worker dies mid-attempt (the process killed, the connection
  lost) is delivered again: its running attempt is closed with ``counted=False``
  and an error saying so, and it runs again without waiting for a backoff (at least
  once: the function may have run, so handlers must be idempotent).
- Records of ended invocations stay readable until :meth:`Engine.collect`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from .model import Filter, Invocation

__all__ = ["Counts", "Engine", "EngineUnavailable", "Save", "Worker"]

# per (env, function): how many invocations are in each status, and the submission
# time of the oldest queued one (None: nothing queued)
Counts = Mapping[tuple[str, str], tuple[Mapping[str, int], float | None]]

Save = Callable[[Invocation], Awaitable[None]]


class EngineUnavailable(Exception):
    """The queue's store cannot take or give work now (a NATS server down): the caller
    answers 503 and tries later; nothing accepted before is lost."""


class Worker(Protocol):
    """Runs one attempt of an invocation and says what became of it."""

    def concurrency(self, env: str, function: str) -> int:
        """How many of this function's invocations may run at once."""
        ...

    def timeout(self, env: str, function: str) -> float:
        """Seconds one attempt may take at most (the function's timeout, with a margin
        for a cold start): an engine that redelivers unacknowledged work (NATS's
        AckWait) waits at least this long."""
        ...

    async def run(self, invocation: Invocation, save: Save) -> Invocation:
        """Run the next attempt of ``invocation`` (status ``queued``, due).

        Before calling the function it saves the invocation as ``running`` with the new
        attempt (``await save(...)``), so a kill during the call is seen on restart.
        Returns it ended (``succeeded``, ``failed``, ``dead``) or ``queued`` again with
        ``next_at`` set for a retry; the engine stores that and delivers it again at
        ``next_at``. It may also return ``dead`` without any new attempt (too old).
        An exception from ``save`` (another replica took the invocation: NATS's
        compare-and-set) must propagate: this run then stores nothing.
        """
        ...


class Engine(Protocol):
    """A durable queue of invocations, with their records."""

    name: str  # "sqlite" or "nats", shown by the status API

    @property
    def max_body_bytes(self) -> int | None:
        """The largest request body this engine can keep (None: no limit of its own;
        submissions over it are 413, as over the function's maxBodyBytes)."""
        ...

    async def start(self) -> None:
        """Connect or open; recover what a previous process left running."""
        ...

    async def close(self) -> None:
        """Stop consuming and let go of the store (idempotent)."""
        ...

    async def submit(self, invocation: Invocation) -> tuple[Invocation, bool]:
        """Store a new ``queued`` invocation durably, returning ``(it, True)``.

        With an ``idempotency_key`` that an invocation of the same environment and
        function already holds (within the retention), nothing is stored and that one
        is returned with ``False``. Raises :class:`EngineUnavailable`.
        """
        ...

    async def publish(
        self,
        env: str,
        subject: str,
        body: bytes,
        headers: tuple[tuple[str, str], ...],
        client: str | None,
    ) -> list[Invocation]:
        """An event on ``subject`` in ``env``: one invocation (``POST /``, this body and
        these headers) per function of ``env`` subscribed to it
        (:meth:`set_subscriptions`), stored durably, all or none. Returns them (the
        NATS engine may return [] and create them as its consumers read the event)."""
        ...

    def set_subscriptions(self, subscriptions: Mapping[tuple[str, str], frozenset[str]]) -> None:
        """The queue triggers now declared: per (env, function), the subjects it takes.
        Replaces the previous set; called whenever routes change."""
        ...

    async def consume(self, worker: Worker) -> None:
        """Run until cancelled: hand each due ``queued`` invocation to ``worker.run`` and
        store what it returns. Several ``run`` calls are under way at once."""
        ...

    async def save(self, invocation: Invocation) -> None:
        """Store a record as it is now (a callback's state, a running attempt)."""
        ...

    async def get(self, invocation_id: str) -> Invocation | None: ...

    async def list(self, which: Filter) -> list[Invocation]:
        """Matching invocations, oldest first, at most ``which.limit``."""
        ...

    async def counts(self) -> Counts: ...

    async def redrive(self, invocation_id: str) -> Invocation | None:
        """A ``dead`` or ``failed`` invocation queued again, due now, for a new round of
        attempts (``round_start`` = its attempts so far; its history is kept). None if
        there is no such id; unchanged if it is not dead or failed."""
        ...

    async def redrive_dead(self, env: str, function: str) -> int:
        """Every dead invocation of a function redriven; how many."""
        ...

    async def due_callbacks(self, now: float) -> list[Invocation]:
        """Ended invocations whose callback is ``pending`` with ``next_at <= now``."""
        ...

    async def collect(self, before: float) -> int:
        """Forget ended invocations that ended before ``before`` (seconds since the
        epoch), and their idempotency keys; how many."""
        ...
