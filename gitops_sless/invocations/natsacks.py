"""JetStream publishes whose acknowledgements are awaited as plain futures.

nats-py's ``js.publish`` is a request: a NUID token and a future with a done callback,
``asyncio.wait_for`` (a timer and a wrapping future) and a dataclass built from the
ack, for every message. A submission publishes two (its record and its work message)
and a run two more: on one core, at thousands of submissions a second, that
machinery was about a tenth of a submission's CPU (bench/async.py). Here one
wildcard subscription takes every ack, a counter names them, one timer each bounds
the wait, and a disconnection fails them all at once (nothing answers them then).

What an ack says is read as nats-py reads it: no responders (JetStream not there),
an API error (a failed compare-and-set is :class:`Conflict`), or the sequence the
message was stored at.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors

from .engine import EngineUnavailable

__all__ = ["Acks", "Conflict"]

WRONG_LAST_SEQUENCE = frozenset({10071, 10164})  # the server's codes for a failed compare


class Conflict(Exception):
    """A compare-and-set write found the record changed since it was read."""


class Acks:
    """Publishes on ``nc`` and waits for JetStream's acks, each within ``timeout``."""

    def __init__(self, nc: Any, timeout: float) -> None:
        self.nc = nc
        self.timeout = timeout
        self._prefix = ""
        self._count = 0
        # reply subject -> (the ack's future, its timer)
        self._waiting: dict[str, tuple[asyncio.Future[Any], asyncio.TimerHandle]] = {}
        self._sub: Any = None

    async def start(self) -> None:
        self._prefix = self.nc.new_inbox() + "."
        self._sub = await self.nc.subscribe(self._prefix + "*", cb=self._on_ack)

    async def _on_ack(self, msg: Any) -> None:
        waiting = self._waiting.pop(msg.subject, None)
        if waiting is not None:
            future, timer = waiting
            timer.cancel()
            if not future.done():
                future.set_result(msg)

    def _expire(self, reply: str, what: str) -> None:
        waiting = self._waiting.pop(reply, None)
        if waiting is not None and not waiting[0].done():
            exc = EngineUnavailable(f"NATS: {what}: no answer within {self.timeout:g}s")
            waiting[0].set_exception(exc)

    def fail_all(self, why: str) -> None:
        """Every ack still awaited fails with ``why`` (the connection is gone)."""
        waiting, self._waiting = self._waiting, {}
        for future, timer in waiting.values():
            timer.cancel()
            if not future.done():
                future.set_exception(EngineUnavailable(why))

    async def send(
        self, subject: str, data: bytes, headers: dict[str, str], what: str
    ) -> asyncio.Future[Any]:
        """Publish; the future is the ack's message (:meth:`stored` reads it)."""
        self._count += 1
        reply = self._prefix + str(self._count)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        timer = loop.call_later(self.timeout, self._expire, reply, what)
        self._waiting[reply] = (future, timer)
        try:
            await self.nc.publish(subject, data, reply=reply, headers=headers)
        except (nats.errors.Error, OSError) as exc:
            self._waiting.pop(reply, None)
            timer.cancel()
            raise EngineUnavailable(f"NATS: {what}: {exc!r}") from exc
        return future

    async def stored(self, future: asyncio.Future[Any], what: str) -> int:
        """The sequence the message was stored at, once acknowledged."""
        return sequence_of(await future, what)

    async def publish(self, subject: str, data: bytes, headers: dict[str, str], what: str) -> int:
        return await self.stored(await self.send(subject, data, headers, what), what)


def sequence_of(msg: Any, what: str) -> int:
    headers = msg.headers
    if headers and headers.get("Status") == "503":
        raise EngineUnavailable(f"NATS: {what}: no responders (is JetStream enabled?)")
    try:
        ack = json.loads(msg.data)
    except ValueError:
        raise EngineUnavailable(f"NATS: {what}: an ack that is not JSON: {msg.data!r}") from None
    error = ack.get("error")
    if error is not None:
        if error.get("err_code") in WRONG_LAST_SEQUENCE:
            raise Conflict(what)
        raise EngineUnavailable(f"NATS: {what}: {error.get('description') or error!r}")
    return int(ack["seq"])
