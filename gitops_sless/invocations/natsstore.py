"""The NATS engine's names and its reads and writes on JetStream.

One place says what lives where (:class:`Names`) and how a record, a work message, a
retry's schedule and a dead letter are written (:class:`Store`), so the delivery
loop, the queue triggers and the engine's API agree.

- Records: the key-value bucket ``<prefix>_invocations``, one key per invocation id
  (ids are lowercase base32: valid keys), the value :meth:`Invocation.to_json`, with
  a summary header for the index (:mod:`.natsindex`). Writes that hand a record from
  one owner to the next are compare-and-set on the key's revision, so two deliveries
  of one invocation never both run it.
- Work: the stream ``<PREFIX>_INVOCATIONS`` (work-queue retention), one subject per
  function, ``<prefix>.inv.<env>.<function>``. A message names an invocation and the
  round it starts (``{"id": ..., "round": ...}``): the record is the only copy of the
  invocation, the message says "run it".
- Retries: a message scheduled by the server (NATS 2.12 message schedules) on
  ``<prefix>.sched.<env>.<function>.<id>`` that becomes a work message at ``next_at``;
  one schedule per id (a new one replaces it).
- Dead letters: ``<PREFIX>_DEAD``, ``<prefix>.dead.<env>.<function>.<id>``, the record
  as it died (one per id: a rollup), for operators and :meth:`redrive_dead`.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from .engine import EngineUnavailable
from .model import Invocation
from .natsacks import WRONG_LAST_SEQUENCE, Acks, Conflict
from .natsindex import HEADER, KV_OPERATION, RecordIndex, summary_of

__all__ = ["Conflict", "ConsumerGone", "Names", "Puller", "Store", "translated"]

_log = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
_PREFIX = re.compile(r"^[A-Za-z0-9_-]+$")
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
# the server removes a deleted record's marker after this: by then every engine's
# watch has seen it (one that was away longer reads the record as missing)
MARKER_TTL_SEC = 3600.0
PAYLOAD_SLACK = 2048  # of max_payload, for the headers


class ConsumerGone(Exception):
    """A pull found no consumer (deleted, or lost with the server's store)."""


@contextlib.contextmanager
def translated(what: str) -> Any:
    """NATS's errors (connection down, timeouts, JetStream unavailable) as
    :class:`EngineUnavailable`, translated once here."""
    try:
        yield
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        if isinstance(exc, nats.js.errors.APIError) and exc.err_code in WRONG_LAST_SEQUENCE:
            raise Conflict(what) from exc
        raise EngineUnavailable(f"NATS: {what}: {exc!r}") from exc


def check_name(kind: str, value: str) -> str:
    """Environment and function names become subject tokens and parts of consumer
    names: only DNS labels (no dots, wildcards or spaces) are taken."""
    if not _NAME.match(value):
        raise ValueError(f"{kind} {value!r}: not a DNS label (lowercase letters, digits, '-')")
    return value


@dataclass(frozen=True)
class Names:
    prefix: str
    main_env: str

    def __post_init__(self) -> None:
        if not _PREFIX.match(self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: only letters, digits, '-' and '_'")

    @property
    def work_stream(self) -> str:
        return f"{self.prefix.upper()}_INVOCATIONS"

    @property
    def dead_stream(self) -> str:
        return f"{self.prefix.upper()}_DEAD"

    @property
    def events_stream(self) -> str:
        return f"{self.prefix.upper()}_EVENTS"

    @property
    def records(self) -> str:
        return f"{self.prefix}_invocations"

    @property
    def keys(self) -> str:
        return f"{self.prefix}_idempotency"

    def work(self, env: str, function: str) -> str:
        return f"{self.prefix}.inv.{env}.{function}"

    def schedule(self, inv: Invocation) -> str:
        return f"{self.prefix}.sched.{inv.env}.{inv.function}.{inv.id}"

    def dead(self, env: str, function: str, invocation_id: str = "*") -> str:
        return f"{self.prefix}.dead.{env}.{function}.{invocation_id}"

    def consumer(self, env: str, function: str) -> str:
        # '_' is in no DNS label: env "a-b" + "c" and "a" + "b-c" get different names
        return f"inv_{env}_{function}"

    def event_subject(self, env: str, subject: str) -> str:
        """Production's events are the bare subject (any NATS client publishing there
        counts); a preview's are its own, so it never takes production's."""
        if env == self.main_env:
            return subject
        return f"{self.prefix}.events.{env}.{subject}"

    @property
    def preview_events(self) -> str:
        return f"{self.prefix}.events.>"


def _at(when: float) -> str:
    moment = datetime.datetime.fromtimestamp(when, datetime.UTC)
    return "@at " + moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _json(inv: Invocation) -> bytes:
    return json.dumps(inv.to_json(), separators=(",", ":")).encode()


def work_message(inv: Invocation) -> bytes:
    return json.dumps({"id": inv.id, "round": inv.round_start}).encode()


def parse_work_message(data: bytes) -> tuple[str, int] | None:
    try:
        body = json.loads(data)
        return str(body["id"]), int(body["round"])
    except (ValueError, TypeError, KeyError):
        return None


class Store:
    """Records, work, schedules and dead letters on one connection's JetStream."""

    def __init__(
        self, nc: Any, js: Any, acks: Acks, names: Names, index: RecordIndex, *, schedules: bool
    ) -> None:
        self.nc = nc
        self.js = js
        self.acks = acks  # records and work: the writes of every submission and run
        self.names = names
        self.index = index
        self.schedules = schedules  # the server schedules messages (2.12+)
        self.record_stream = f"KV_{names.records}"
        self.record_prefix = f"$KV.{names.records}."

    # -- records

    async def read(self, invocation_id: str) -> tuple[Invocation, int] | None:
        """The record and its revision (None: no such record)."""
        with translated(f"read invocation {invocation_id}"):
            try:
                msg = await self.js.get_msg(
                    self.record_stream, subject=self.record_prefix + invocation_id, direct=True
                )
            except nats.js.errors.NotFoundError:
                return None
        if not msg.data or (msg.headers and KV_OPERATION in msg.headers):
            return None
        return Invocation.from_json(json.loads(msg.data)), int(msg.seq)

    async def write(self, inv: Invocation, expect: int | None = None) -> int:
        """Store ``inv``; with ``expect`` only over that revision (0: a new key), else
        :class:`Conflict`. Returns the new revision."""
        summary = summary_of(inv)
        headers = {HEADER: summary}
        if expect is not None:
            headers[EXPECTED_LAST] = str(expect)
        data, what = self._encoded(inv), f"write invocation {inv.id}"
        seq = await self.acks.publish(self.record_prefix + inv.id, data, headers, what)
        self.index.put(inv.id, seq, summary)
        return seq

    async def submit(self, inv: Invocation) -> tuple[int | Exception, int | Exception]:
        """A new record and its work message, both sent before either ack is awaited
        (one round trip): each one's stored sequence, or what went wrong with it."""
        summary = summary_of(inv)
        record = f"write invocation {inv.id}"
        work = f"queue invocation {inv.id}"
        acks = self.acks
        headers = {HEADER: summary, EXPECTED_LAST: "0"}
        written = await acks.send(self.record_prefix + inv.id, self._encoded(inv), headers, record)
        try:
            subject = self.names.work(inv.env, inv.function)
            queued = await acks.send(subject, work_message(inv), {"Nats-Msg-Id": inv.id}, work)
        except EngineUnavailable as exc:
            queued = exc
        results: list[int | Exception] = []
        for sent, what in ((written, record), (queued, work)):
            try:
                stored = sent if isinstance(sent, Exception) else await acks.stored(sent, what)
                results.append(stored)
            except (EngineUnavailable, Conflict) as exc:
                results.append(exc)
        seq = results[0]
        if isinstance(seq, int):
            self.index.put(inv.id, seq, summary)
        return results[0], results[1]

    def _encoded(self, inv: Invocation) -> bytes:
        """The record as stored, within the server's ``max_payload`` (1 MB unless
        configured): a response body too long for it is cut (``truncated``), as one over
        MAX_RESPONSE_BYTES is; a request too long for it is refused."""
        data = _json(inv)
        room = self.nc.max_payload - PAYLOAD_SLACK
        response = inv.response
        if len(data) > room and response is not None and response.body:
            cut = (len(data) - room) * 3 // 4 + 8  # base64: 4 characters per 3 bytes
            body = response.body[: max(0, len(response.body) - cut)]
            data = _json(inv.evolve(response=replace(response, body=body, truncated=True)))
        if len(data) > room:
            raise EngineUnavailable(
                f"invocation {inv.id}: its record of {len(data)} bytes is more than the NATS"
                f" server's max_payload ({self.nc.max_payload}) allows: raise max_payload"
            )
        return data

    async def delete(self, invocation_id: str) -> None:
        headers = {KV_OPERATION: "PURGE", "Nats-Rollup": "sub"}
        with translated(f"delete invocation {invocation_id}"):
            ack = await self.js.publish(
                self.record_prefix + invocation_id, b"", headers=headers, msg_ttl=MARKER_TTL_SEC
            )
        self.index.forget(invocation_id, ack.seq, seen_by_watch=False)

    # -- work

    async def publish_work(self, inv: Invocation) -> None:
        """The message that has ``inv`` run; published twice within the duplicate
        window (a retried publish, a redelivered event) it is stored once."""
        msg_id = inv.id if inv.round_start == 0 else f"{inv.id}.{inv.round_start}"
        subject = self.names.work(inv.env, inv.function)
        headers = {"Nats-Msg-Id": msg_id}
        await self.acks.publish(subject, work_message(inv), headers, f"queue invocation {inv.id}")

    async def schedule(self, inv: Invocation) -> None:
        """A work message for ``inv`` at ``inv.next_at``, replacing any earlier one."""
        headers = {
            "Nats-Schedule": _at(inv.next_at),
            "Nats-Schedule-Target": self.names.work(inv.env, inv.function),
        }
        with translated(f"schedule invocation {inv.id}"):
            await self.js.publish(self.names.schedule(inv), work_message(inv), headers=headers)

    # -- dead letters

    async def dead_letter(self, inv: Invocation) -> None:
        with translated(f"dead letter of {inv.id}"):
            await self.js.publish(
                self.names.dead(inv.env, inv.function, inv.id),
                self._encoded(inv),
                headers={"Nats-Rollup": "sub"},  # one letter per invocation
            )

    async def drop_dead_letter(self, inv: Invocation) -> None:
        with translated(f"drop the dead letter of {inv.id}"):
            await self.js.purge_stream(
                self.names.dead_stream, subject=self.names.dead(inv.env, inv.function, inv.id)
            )

    async def dead_ids(self, env: str, function: str) -> list[str]:
        """Ids with a dead letter for this function (subjects end with the id)."""
        with translated(f"dead letters of {env}/{function}"):
            info = await self.js.stream_info(
                self.names.dead_stream, subjects_filter=self.names.dead(env, function)
            )
        return sorted(subject.rsplit(".", 1)[1] for subject in (info.state.subjects or {}))

    async def work_subjects(self) -> set[tuple[str, str]]:
        """(env, function) of every subject holding work messages now."""
        with translated("the work stream's subjects"):
            info = await self.js.stream_info(
                self.names.work_stream, subjects_filter=f"{self.names.prefix}.inv.>"
            )
        return {tuple(s.split(".")[-2:]) for s in info.state.subjects or {}}  # type: ignore[misc]


def stream_configs(names: Names, retention_sec: float, *, schedules: bool) -> list[Any]:
    """The work stream and the dead letters' (the events' follow the subscriptions)."""
    work = api.StreamConfig(
        name=names.work_stream,
        subjects=[f"{names.prefix}.inv.>", f"{names.prefix}.sched.>"],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE,
        # a retry is a message the server publishes at its time (2.12+): a message
        # nak'ed with a delay would hold one of max_ack_pending's places meanwhile
        allow_msg_schedules=True if schedules else None,
    )
    dead = api.StreamConfig(
        name=names.dead_stream,
        subjects=[f"{names.prefix}.dead.>"],
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        max_age=retention_sec,
        allow_rollup_hdrs=True,
    )
    return [work, dead]


class Puller:
    """A durable pull consumer's messages, each handed over the moment it arrives.

    nats-py's ``fetch(n)`` returns only once ``n`` messages came or its timeout passed:
    one message of a batch would wait there, not running, while a place is free. Here
    each pull request asks for the places free now, and every message is passed on at
    once; the server keeps the request open (and sends heartbeats) until it expires.
    """

    HEARTBEAT_SEC = 1.0  # no heartbeat for two of these: the server is gone

    def __init__(self, nc: Any, stream: str, consumer: str) -> None:
        self.nc = nc
        self.next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.inbox = self.nc.new_inbox()
        self._sub: Any = None

    async def open(self) -> Puller:
        self._sub = await self.nc.subscribe(self.inbox)
        return self

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def pull(self, batch: int, take: Callable[[Any], None], expires: float) -> int:
        """One request for up to ``batch`` messages, each given to ``take``; returns how
        many came, once ``batch`` did, the request ended or the server went quiet."""
        request = {
            "batch": batch,
            "expires": int(expires * 1e9),
            "idle_heartbeat": int(self.HEARTBEAT_SEC * 1e9),
        }
        await self.nc.publish(self.next, json.dumps(request).encode(), reply=self.inbox)
        got = 0
        deadline = time.monotonic() + expires + self.HEARTBEAT_SEC
        while got < batch:
            quiet = min(2 * self.HEARTBEAT_SEC, deadline - time.monotonic())
            if quiet <= 0:
                break
            try:
                msg = await self._sub.next_msg(timeout=quiet)
            except TimeoutError:
                break  # the request expired unseen, or the server is away
            status = None if msg.data or not msg.headers else msg.headers.get("Status")
            if status is None:
                take(msg)
                got += 1
            elif status == "503" or "Deleted" in msg.headers.get("Description", ""):
                raise ConsumerGone(self.next)  # 503: no responders, nothing to pull from
            elif status != "100":  # 404/408: nothing more for it; 409: the server ended it
                break
        return got
