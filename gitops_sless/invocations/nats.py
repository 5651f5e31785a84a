"""The queue engine on NATS JetStream, for a cluster: every reconciler replica shares it.

Where things live is in :mod:`.natsstore`, delivery in :mod:`.natsconsume`, queue
triggers in :mod:`.natsevents`, the summaries that counting and listing read in
:mod:`.natsindex`. In short:

- a record per invocation in the key-value bucket ``<prefix>_invocations``;
- a work message per invocation (and per retry, at its time) in the work-queue
  stream ``<PREFIX>_INVOCATIONS``, delivered by a durable consumer per function whose
  ``max_ack_pending`` is the function's concurrency;
- idempotency keys in ``<prefix>_idempotency`` (``sha256(env/function/key)`` -> id),
  created only if absent, expiring after the retention;
- dead letters in ``<PREFIX>_DEAD``; events in ``<PREFIX>_EVENTS``.

:meth:`NatsEngine.submit` writes the record and publishes the work message at once
(both acknowledged by the server before it returns: stored). A failure of either
answers :class:`~.engine.EngineUnavailable` and undoes what it can; a work message
whose record never appears is dropped by the consumer after a grace period, so a
refused submission does not run. Nothing is buffered while the connection is down:
calls fail at once with EngineUnavailable, and a submit under way when the
connection drops is refused then rather than at its timeout.

Needs NATS 2.11 (per-message TTLs) and, for retries that hold no place of their
function's concurrency while they wait, 2.12 (message schedules). A record is one
message: a request body is limited by the server's ``max_payload`` (1 MB by default,
so about 700 KB of body once base64-encoded); a response is cut to fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.js import api

from .engine import Counts, EngineUnavailable, Worker
from .model import DEAD, ENDED, FAILED, Filter, Invocation
from .natsacks import Acks
from .natsconsume import Delivery
from .natsevents import Events
from .natsindex import IndexWatch, RecordIndex
from .natsstore import (
    PAYLOAD_SLACK,
    Conflict,
    Names,
    Store,
    check_name,
    stream_configs,
    translated,
)

__all__ = ["NatsEngine"]

_log = logging.getLogger(__name__)

CONNECT_TIMEOUT_SEC = 5.0  # start() gives up after this (the service tries again)
CLOSE_STEP_SEC = 5.0  # the longest each step of a close may take
REQUEST_TIMEOUT_SEC = 5.0  # any one request to the server: nothing waits forever
KEY_WAIT_SEC = 2.0  # a key's first holder has this long to write its record
READS_AT_ONCE = 64
# the record's JSON around its body: request headers and the path are bounded by the
# proxy's head limit, attempts and the response kept short (see natsstore)
RECORD_OVERHEAD = 96 * 1024


class NatsEngine:
    """Invocations on a NATS server (``url``: ``nats://host:port``) with JetStream."""

    name = "nats"

    def __init__(
        self,
        url: str,
        *,
        main_env: str = "prod",
        retention_sec: float = 86400.0,
        prefix: str = "sless",
    ) -> None:
        self.url = url
        self.names = Names(prefix, main_env)
        self.retention_sec = retention_sec
        self.clock = time.time
        self.index = RecordIndex()
        self._nc: Any = None
        self._store: Store | None = None
        self._keys: Any = None
        self._watch: IndexWatch | None = None
        self._events: Events | None = None
        self._subscriptions: Mapping[tuple[str, str], frozenset[str]] | None = None
        self._delivery: Delivery | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._starting = asyncio.Lock()

    # -- life

    @property
    def max_body_bytes(self) -> int | None:
        """The largest request body one record can hold (None: not connected yet): the
        record is one message, its body base64 in JSON, under the server's max_payload."""
        nc = self._nc
        if nc is None or not nc.is_connected:
            return None
        return max(0, (nc.max_payload - PAYLOAD_SLACK - RECORD_OVERHEAD) * 3 // 4)

    async def start(self) -> None:
        async with self._starting:
            if self._store is not None:
                return
            try:
                await asyncio.wait_for(self._open(), CONNECT_TIMEOUT_SEC)
            except (nats.errors.Error, OSError, TimeoutError, EngineUnavailable) as exc:
                await self._close_connection()
                raise EngineUnavailable(f"NATS at {self.url}: {exc!r}") from exc

    async def _open(self) -> None:
        self._nc = await nats.connect(
            self.url,
            name="gitops-sless",
            connect_timeout=2,
            reconnect_time_wait=0.5,
            max_reconnect_attempts=-1,  # a server restart is waited out, never given up on
            # nothing buffered while reconnecting: a submit refused then (503) must not
            # be sent later anyway when the connection comes back
            pending_size=0,
            error_cb=self._error,
            disconnected_cb=self._disconnected,
            reconnected_cb=self._reconnected,
        )
        js = self._nc.jetstream(timeout=REQUEST_TIMEOUT_SEC)
        version = self._nc.connected_server_version
        if (version.major, version.minor) < (2, 11):  # per-message TTLs (deletion markers)
            raise EngineUnavailable(f"NATS server {version}: 2.11 or later is needed")
        schedules = (version.major, version.minor) >= (2, 12)
        if not schedules:
            _log.warning(
                "NATS %s has no message schedules (2.12): retries wait holding a place", version
            )
        for config in stream_configs(self.names, self.retention_sec, schedules=schedules):
            await _ensure_stream(js, config)
        await js.create_key_value(
            api.KeyValueConfig(
                bucket=self.names.records, history=1, storage=api.StorageType.FILE, direct=True
            )
        )
        self._keys = await js.create_key_value(
            api.KeyValueConfig(
                bucket=self.names.keys,
                history=1,
                ttl=self.retention_sec,
                storage=api.StorageType.FILE,
                direct=True,
            )
        )
        acks = Acks(self._nc, REQUEST_TIMEOUT_SEC)
        await acks.start()
        store = Store(self._nc, js, acks, self.names, self.index, schedules=schedules)
        self._watch = IndexWatch(js, store.record_stream, store.record_prefix, self.index)
        await self._watch.start(REQUEST_TIMEOUT_SEC)
        self._events = Events(store, self.retention_sec, self._made)
        if self._subscriptions is not None:
            self._events.set(self._subscriptions)
        self._tasks.append(asyncio.ensure_future(self._events.keep_applied()))
        self._store = store

    async def close(self) -> None:
        # every step bounded: a stop (serve's too) never waits on a server that is gone
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_STEP_SEC)
        if self._watch is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._watch.stop(), CLOSE_STEP_SEC)
            self._watch = None
        self._store = self._events = None
        await self._close_connection()

    async def _close_connection(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.flush(), 1.0)  # the naks of stopped runs
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), CLOSE_STEP_SEC)

    async def _error(self, exc: Exception) -> None:
        _log.debug("NATS %s: %r", self.url, exc)

    async def _disconnected(self) -> None:
        if self._nc is not None and not self._nc.is_closed:  # not our own close
            _log.warning("NATS %s: disconnected; reconnecting", self.url)
        # writes waiting for answers that cannot come: refused now, not at their timeout
        if self._store is not None:
            self._store.acks.fail_all(f"NATS at {self.url}: disconnected before the answer")

    async def _reconnected(self) -> None:
        _log.info("NATS %s: reconnected", self.url)

    def _ready(self) -> Store:
        """The store, if the server can be asked now (else at once EngineUnavailable:
        a request sent while reconnecting would only wait for its timeout)."""
        store = self._store
        if store is None or self._nc is None or not self._nc.is_connected:
            raise EngineUnavailable(f"NATS at {self.url}: not connected")
        return store

    # -- submitting

    async def submit(self, invocation: Invocation) -> tuple[Invocation, bool]:
        check_name("environment", invocation.env)
        check_name("function", invocation.function)
        store = self._ready()
        key = None
        if invocation.idempotency_key is not None:
            key, existing = await self._claim(invocation)
            if existing is not None:
                return existing, False
        try:
            written, published = await store.submit(invocation)
        except EngineUnavailable:  # nothing was sent
            await self._undo(invocation, key, record=False)
            raise
        failure = next((r for r in (written, published) if isinstance(r, Exception)), None)
        if isinstance(written, Conflict) and isinstance(published, int):
            failure = None  # the same invocation submitted twice: it is stored
        if failure is not None:
            await self._undo(invocation, key, record=not isinstance(written, Exception))
            if isinstance(failure, EngineUnavailable):
                raise failure
            raise EngineUnavailable(f"NATS: submit {invocation.id}: {failure!r}") from failure
        if self._delivery is not None:
            self._delivery.notice(invocation.env, invocation.function)
        return invocation, True

    def _key(self, inv: Invocation) -> str:
        raw = f"{inv.env}/{inv.function}/{inv.idempotency_key}"
        return hashlib.sha256(raw.encode()).hexdigest()

    async def _claim(self, inv: Invocation) -> tuple[str, Invocation | None]:
        """Take ``inv``'s idempotency key for it, or the invocation that holds it."""
        key = self._key(inv)
        for _ in range(3):
            with translated(f"idempotency key of {inv.id}"):
                try:
                    await self._keys.create(key, inv.id.encode())
                    return key, None
                except nats.js.errors.KeyWrongLastSequenceError:
                    pass
                try:
                    entry = await self._keys.get(key)
                except nats.js.errors.KeyNotFoundError:
                    continue  # it expired meanwhile
            holder = await self._holder(entry.value.decode())
            if holder is not None:
                return key, holder
            # its submit failed without taking the key back: this one takes it over
            with translated(f"idempotency key of {inv.id}"):
                try:
                    await self._keys.update(key, inv.id.encode(), last=entry.revision)
                    return key, None
                except nats.js.errors.KeyWrongLastSequenceError:
                    continue
        raise EngineUnavailable(f"idempotency key of {inv.id}: contended; try again")

    async def _holder(self, invocation_id: str) -> Invocation | None:
        """The invocation that holds a key; its submit may still be writing it."""
        deadline = time.monotonic() + KEY_WAIT_SEC
        while True:
            got = await self._store_or_raise().read(invocation_id)
            if got is not None:
                return got[0]
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)

    async def _undo(self, inv: Invocation, key: str | None, *, record: bool) -> None:
        """A failed submit takes back what it wrote (best effort: the server may be
        gone; a work message left behind is dropped for want of a record)."""
        with contextlib.suppress(Exception):
            if record:
                await asyncio.wait_for(self._store_or_raise().delete(inv.id), 1.0)
            if key is not None:
                await asyncio.wait_for(self._keys.purge(key), 1.0)

    def _store_or_raise(self) -> Store:
        if self._store is None:
            raise EngineUnavailable(f"NATS at {self.url}: not started")
        return self._store

    # -- queue triggers

    async def publish(
        self,
        env: str,
        subject: str,
        body: bytes,
        headers: tuple[tuple[str, str], ...],
        client: str | None,
    ) -> list[Invocation]:
        """Publish the event on NATS; the subscriptions' consumers make the invocations
        (so []): the same path as an event any NATS client publishes."""
        check_name("environment", env)
        self._ready()
        merged: dict[str, str] = {}
        for name, value in headers:  # NATS headers hold one value per name here
            merged[name] = f"{merged[name]}, {value}" if name in merged else value
        assert self._events is not None
        await self._events.publish(env, subject, body, merged, client)
        return []

    def set_subscriptions(self, subscriptions: Mapping[tuple[str, str], frozenset[str]]) -> None:
        self._subscriptions = dict(subscriptions)
        if self._events is not None:
            self._events.set(self._subscriptions)

    async def _made(self, inv: Invocation) -> None:
        if self._delivery is not None:
            self._delivery.notice(inv.env, inv.function)

    # -- delivery

    async def consume(self, worker: Worker) -> None:
        if self._store is None:
            await self.start()
        store, events = self._store_or_raise(), self._events
        assert events is not None
        self._delivery = Delivery(store, worker, self.clock)
        try:
            await asyncio.gather(self._delivery.run(), events.consume())
        finally:
            self._delivery = None

    # -- records

    async def save(self, invocation: Invocation) -> None:
        await self._ready().write(invocation)

    async def get(self, invocation_id: str) -> Invocation | None:
        got = await self._ready().read(invocation_id)
        return None if got is None else got[0]

    async def _records(self, ids: list[str]) -> list[Invocation]:
        """The records of ``ids`` in that order, read a few at a time; ids without one
        (collected: this index had not heard yet) are left out."""
        store = self._ready()
        found: list[Invocation] = []
        for start in range(0, len(ids), READS_AT_ONCE):
            chunk = ids[start : start + READS_AT_ONCE]
            for key, got in zip(chunk, await asyncio.gather(*map(store.read, chunk)), strict=True):
                if got is None:
                    self.index.forget(key, 1 << 62, seen_by_watch=True)
                else:
                    found.append(got[0])
        return found

    async def list(self, which: Filter) -> list[Invocation]:
        self._ready()
        found: list[Invocation] = []
        candidates = iter(self.index.ids(which))
        index = self.index
        while len(found) < which.limit:
            # The index moves on while records are read (a queue being worked through
            # passes a listing of its queued ones by): what no longer matches it is
            # not read. It may also be a moment behind another replica's writes:
            # each record read is checked against ``which`` too.
            chunk = []
            for key in candidates:
                summary = index.get(key)
                if summary is not None and summary.matches(which):
                    chunk.append(key)
                    if len(chunk) == which.limit:
                        break
            if not chunk:
                break
            found += [inv for inv in await self._records(chunk) if which.matches(inv)]
        return found[: which.limit]

    async def counts(self) -> Counts:
        self._ready()
        return self.index.counts()

    async def due_callbacks(self, now: float) -> list[Invocation]:
        records = await self._records(self.index.due_callbacks(now))
        return [
            inv
            for inv in records
            if inv.status in ENDED
            and inv.callback is not None
            and inv.callback.state == "pending"
            and inv.callback.next_at <= now
        ]

    # -- redriving

    async def redrive(self, invocation_id: str) -> Invocation | None:
        return (await self._redrive(invocation_id))[0]

    async def _redrive(
        self, invocation_id: str, statuses: tuple[str, ...] = (DEAD, FAILED)
    ) -> tuple[Invocation | None, bool]:
        """The record after a redrive, and whether this call redrove it."""
        store = self._ready()
        for _ in range(3):
            got = await store.read(invocation_id)
            if got is None:
                return None, False
            inv, revision = got
            if inv.status not in statuses:
                return inv, False
            again = inv.redriven(self.clock())
            # the message first: until the record says this round it waits for it
            await store.publish_work(again)
            try:
                await store.write(again, expect=revision)
            except Conflict:
                continue  # redriven (or changed) meanwhile: read it again
            with contextlib.suppress(EngineUnavailable):
                await store.drop_dead_letter(inv)
            if self._delivery is not None:
                self._delivery.notice(inv.env, inv.function)
            return again, True
        raise EngineUnavailable(f"redrive {invocation_id}: the record kept changing")

    async def redrive_dead(self, env: str, function: str) -> int:
        store = self._ready()
        ids = set(self.index.with_status(env, function, DEAD))
        ids |= set(await store.dead_ids(env, function))  # dead here before the index heard
        count = 0
        for invocation_id in sorted(ids):
            _, redriven = await self._redrive(invocation_id, (DEAD,))
            count += redriven
        return count

    # -- forgetting

    async def collect(self, before: float) -> int:
        store = self._ready()
        count = 0
        for inv in await self._records(self.index.ended_before(before)):
            if inv.status not in ENDED or inv.ended is None or inv.ended >= before:
                continue
            await store.delete(inv.id)
            if inv.idempotency_key is not None:
                with translated(f"idempotency key of {inv.id}"):
                    await self._keys.purge(self._key(inv))
            if inv.status == DEAD:
                await store.drop_dead_letter(inv)
            count += 1
        return count


async def _ensure_stream(js: Any, config: Any) -> None:
    """Create the stream, or bring an existing one to this configuration."""
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError:
        await js.update_stream(config)
