"""Queue triggers on NATS: events on subjects become invocations of the functions
subscribed to them.

The stream ``<PREFIX>_EVENTS`` (interest retention: an event is kept until every
subscription has taken it) holds the subscribed subjects: production's (the main
environment's) bare, so any NATS client publishing ``orders.created`` triggers its
functions, and ``<prefix>.events.>`` for previews, whose events are
``<prefix>.events.<env>.<subject>``: a preview never receives production's events.
Its subjects follow the subscriptions (:meth:`Events.set`).

One durable consumer per (env, function, subject), created before an event can
arrive for it and delivering only events published after that (a new subscription
does not replay the past). Each event becomes an invocation (``POST /``, the event's
body and headers, ``subject`` set) whose id is derived from the event (its stream
sequence and time, the env and the function): a redelivered event finds its
invocation already stored and does not make a second one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from .engine import EngineUnavailable
from .model import Invocation
from .natsstore import Conflict, ConsumerGone, Names, Puller, Store, translated

__all__ = ["Events", "event_id"]

_log = logging.getLogger(__name__)

Subscriptions = Mapping[tuple[str, str], frozenset[str]]
Stored = Callable[[Invocation], Awaitable[None]]

CONSUMER_PREFIX = "ev_"
EVENTS_AT_ONCE = 64
EVENT_ACK_WAIT_SEC = 30.0
FETCH_SEC = 5.0
APPLY_RETRY_SEC = 5.0
APPLY_WAIT_SEC = 5.0  # a publish waits this long at most for new subscriptions to apply
# headers the server or a client library sets for JetStream, not the publisher's
_OWN_HEADERS = ("nats-", "status", "description")
# the address of the client that posted an event to the API (for X-Forwarded-For);
# events from NATS clients have none
CLIENT_HEADER = "Sless-Client"


def event_id(created: float, stream_seq: int, env: str, function: str) -> str:
    """The id of the invocation an event makes for one function: the same each time the
    event is delivered, in the layout of :func:`~.model.new_id` (it sorts by time)."""
    millis = int(created * 1000).to_bytes(6, "big")
    digest = hashlib.sha256(f"{stream_seq}/{created!r}/{env}/{function}".encode()).digest()
    return base64.b32encode(millis + digest[:10]).decode("ascii").rstrip("=").lower()


def consumer_name(env: str, function: str, subject: str) -> str:
    digest = hashlib.sha256(subject.encode()).hexdigest()[:16]
    return f"{CONSUMER_PREFIX}{env}_{function}_{digest}"


class Events:
    """The events stream and its consumers for one engine."""

    def __init__(self, store: Store, retention_sec: float, stored: Stored) -> None:
        self.store = store
        self.names: Names = store.names
        self.retention_sec = retention_sec
        self.stored = stored  # told of each invocation made (its function's loop starts)
        self.wanted: Subscriptions | None = None  # None: not told yet: delete nothing
        self.changed = asyncio.Event()
        self.applied: dict[str, tuple[str, str, str]] = {}  # consumer -> (env, fn, subject)
        self.applied_event = asyncio.Event()
        self.version = 0  # of the subscriptions set: bumped by each set()
        self.caught_up = asyncio.Event()  # every set tried once at least
        self.caught_up.set()

    def set(self, subscriptions: Subscriptions) -> None:
        self.wanted = {key: frozenset(subjects) for key, subjects in subscriptions.items()}
        self.version += 1
        self.caught_up.clear()
        self.changed.set()

    async def applied_now(self, timeout: float) -> None:
        """Wait until the subscriptions set so far are the server's (an event published
        right after a subscription reaches it)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.caught_up.wait(), timeout)

    # -- the stream's subjects and the consumers follow the subscriptions

    async def keep_applied(self) -> None:
        """Until cancelled: apply the subscriptions whenever they change (and again
        after a failure, e.g. while the server is away)."""
        while True:
            self.changed.clear()
            version = self.version
            try:
                await self._apply()
                if version == self.version:
                    self.caught_up.set()
                self.applied_event.set()
                await self.changed.wait()
            except EngineUnavailable as exc:
                # e.g. a subject another stream of the account already takes
                _log.warning("queue triggers: %s; again in %ss", exc, APPLY_RETRY_SEC)
                if version == self.version:
                    self.caught_up.set()  # a publish does not wait for what failed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), APPLY_RETRY_SEC)

    def _consumers(self) -> dict[str, tuple[str, str, str]]:
        return {
            consumer_name(env, function, subject): (env, function, subject)
            for (env, function), subjects in (self.wanted or {}).items()
            for subject in subjects
            if self._allowed(env, subject)
        }

    def _allowed(self, env: str, subject: str) -> bool:
        if env == self.names.main_env and subject.split(".", 1)[0] == self.names.prefix:
            _log.warning("queue trigger %s: the engine's own subjects are not events", subject)
            return False
        return True

    async def _apply(self) -> None:
        consumers = self._consumers()
        bare = sorted({s for env, _, s in consumers.values() if env == self.names.main_env})
        await self._stream([self.names.preview_events, *bare])
        js = self.store.js
        stream = self.names.events_stream
        for name, (env, function, subject) in consumers.items():
            if name in self.applied:
                continue
            config = api.ConsumerConfig(
                name=name,
                durable_name=name,
                filter_subject=self.names.event_subject(env, subject),
                ack_policy=api.AckPolicy.EXPLICIT,
                deliver_policy=api.DeliverPolicy.NEW,
                ack_wait=EVENT_ACK_WAIT_SEC,
                max_deliver=-1,
            )
            with translated(f"consumer {name}"):
                try:
                    await js.consumer_info(stream, name)  # kept as it is: it has its place
                except nats.js.errors.NotFoundError:
                    await js.add_consumer(stream, config)
            self.applied[name] = (env, function, subject)
        if self.wanted is not None:
            await self._drop_unwanted(set(consumers))

    async def _stream(self, subjects: list[str]) -> None:
        js = self.store.js
        config = api.StreamConfig(
            name=self.names.events_stream,
            subjects=subjects,
            retention=api.RetentionPolicy.INTEREST,
            storage=api.StorageType.FILE,
            max_age=self.retention_sec,
        )
        with translated("the events stream"):
            try:
                info = await js.stream_info(self.names.events_stream)
            except nats.js.errors.NotFoundError:
                await js.add_stream(config)
                return
            if set(info.config.subjects or []) != set(subjects):
                await js.update_stream(config)

    async def _drop_unwanted(self, wanted: set[str]) -> None:
        js = self.store.js
        stream = self.names.events_stream
        with translated("the events stream's consumers"):
            found = [c.name for c in await _all_consumers(js, stream)]
            for name in found:
                if name.startswith(CONSUMER_PREFIX) and name not in wanted:
                    await js.delete_consumer(stream, name)
        for name in set(self.applied) - wanted:
            del self.applied[name]

    # -- events to invocations

    async def publish(
        self, env: str, subject: str, body: bytes, headers: dict[str, str], client: str | None
    ) -> None:
        await self.applied_now(APPLY_WAIT_SEC)
        if client is not None:
            headers = {**headers, CLIENT_HEADER: client}
        # no stream takes it (suppressed): no function of env subscribes to it
        with (
            translated(f"publish on {subject}"),
            contextlib.suppress(nats.js.errors.NoStreamResponseError),
        ):
            await self.store.js.publish(
                self.names.event_subject(env, subject), body, headers=headers or None
            )

    async def consume(self) -> None:
        """Until cancelled: a pull loop per subscription this engine has applied."""
        loops: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                for name in self.applied:
                    if name not in loops or loops[name].done():
                        loops[name] = asyncio.ensure_future(self._loop(name))
                for name in set(loops) - set(self.applied):
                    loops.pop(name).cancel()
                self.applied_event.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.applied_event.wait(), APPLY_RETRY_SEC)
        finally:
            for task in loops.values():
                task.cancel()
            await asyncio.gather(*loops.values(), return_exceptions=True)

    async def _loop(self, name: str) -> None:
        env, function, subject = self.applied[name]
        puller = await Puller(self.store.nc, self.names.events_stream, name).open()
        taking: set[asyncio.Task[None]] = set()
        room = asyncio.Event()

        def take(msg: Any) -> None:
            task = asyncio.ensure_future(self._take(msg, env, function, subject))
            taking.add(task)
            task.add_done_callback(lambda done: (taking.discard(done), room.set()))

        try:
            while name in self.applied:
                if len(taking) >= EVENTS_AT_ONCE:
                    room.clear()
                    await room.wait()
                    continue
                try:
                    await puller.pull(EVENTS_AT_ONCE - len(taking), take, FETCH_SEC)
                except ConsumerGone:  # made again by the next application
                    self.applied.pop(name, None)
                    self.changed.set()
                    return
                except Exception as exc:  # the server away: again
                    _log.warning("queue trigger %s of %s/%s: %s", subject, env, function, exc)
                    await asyncio.sleep(1.0)
        finally:
            await puller.close()
            for task in taking:
                task.cancel()
            await asyncio.gather(*taking, return_exceptions=True)

    async def _take(self, msg: Any, env: str, function: str, subject: str) -> None:
        meta = msg.metadata
        created = meta.timestamp.timestamp()
        received = dict(msg.headers or {})
        client = received.pop(CLIENT_HEADER, None)
        headers = tuple(
            (k, v) for k, v in received.items() if not k.lower().startswith(_OWN_HEADERS)
        )
        inv = Invocation(
            id=event_id(created, meta.sequence.stream, env, function),
            env=env,
            function=function,
            method="POST",
            path="/",
            headers=headers,
            body=msg.data or b"",
            created=time.time(),
            client=client,
            subject=subject,
        )
        try:
            with contextlib.suppress(Conflict):  # made by an earlier delivery of this event
                await self.store.write(inv, expect=0)
            await self.store.publish_work(inv)  # stored once within the duplicate window
            await msg.ack()
        except (EngineUnavailable, nats.errors.Error) as exc:
            _log.warning("event on %s for %s/%s: %s (it comes again)", subject, env, function, exc)
            return
        await self.stored(inv)


async def _all_consumers(js: Any, stream: str) -> list[Any]:
    found: list[Any] = []
    while True:
        page = await js.consumers_info(stream, offset=len(found))
        found.extend(page)
        if len(page) < 256:
            return found
