"""Delivery on NATS: one durable pull consumer per function, shared by every replica.

Each (env, function) has a durable consumer on its work subject whose
``max_ack_pending`` is the function's ``concurrency``: the server hands out at most
that many unacknowledged messages, so the limit holds across every reconciler
replica bound to it, and the replicas share the work (each message goes to one of
them). ``ack_wait`` is the worker's timeout plus a margin, and a running attempt
reports progress (``+WPI``) well within it, so only a dead worker's message is
delivered again.

A replica runs a pull loop (:class:`~.natsstore.Puller`) for each function that has
work: the index (which follows every replica's writes) says when a function gets
queued or running invocations, and the work stream's subjects are read at start and
now and then (messages queued by something the index does not show). A loop that
finds nothing for a while stops; its consumer stays on the server, with what waits
on it.

The record decides what a message means (:meth:`Delivery._deliver`); a message is
acknowledged only once the record says what happened, so a crash at any point leaves
a message that is delivered again and read against the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import nats.errors
from nats.js import api

from .engine import EngineUnavailable, Worker
from .model import DEAD, ENDED, QUEUED, RUNNING, Invocation
from .natsstore import Conflict, Puller, Store, parse_work_message, translated

__all__ = ["INTERRUPTED", "Delivery", "interrupted"]

_log = logging.getLogger(__name__)

INTERRUPTED = "interrupted: the reconciler stopped during this attempt"
ACK_MARGIN_SEC = 2.0  # on top of the worker's timeout (which has a cold start's margin)
FETCH_SEC = 5.0  # a pull request's life: an idle loop asks again this often
IDLE_STOP_SEC = 60.0  # a loop with no work for this long stops
DISCOVER_SEC = 5.0  # how often the index is read for functions with work (a backstop)
RESCAN_SEC = 30.0  # how often the work stream's subjects are read
CONFIG_SEC = 5.0  # how often a consumer's limits are compared with the worker's
# a work message whose record is not there yet (its submit is writing it) is
# delivered again after RECORD_WAIT_SEC; after RECORD_GRACE_SEC the submit failed
# (and said so to its caller): the message is dropped
RECORD_WAIT_SEC = 0.1
RECORD_GRACE_SEC = 30.0
# a message that comes before its record's next_at (a clock a little apart from the
# server's) waits the rest holding its place if it is this close, else is scheduled
NEAR_SEC = 1.0
RUN_ERROR_DELAY_SEC = 1.0  # a run that raised is tried again after this (as SQLite's)
RETRY_SEC = 1.0  # a loop that lost its consumer (the server away) tries again after this
STOP_WRITE_SEC = 1.0  # a stopping engine waits this long to record an interrupted attempt


def interrupted(inv: Invocation, now: float) -> Invocation:
    """``inv`` whose running attempt was cut short by a stop: closed, not counted, and
    queued to run again at once."""
    attempts = inv.attempts
    if attempts and attempts[-1].ended is None:
        last = replace(attempts[-1], ended=now, error=INTERRUPTED, counted=False)
        attempts = (*attempts[:-1], last)
    return inv.evolve(status=QUEUED, attempts=attempts, next_at=now)


def after_error(inv: Invocation, error: str, now: float) -> Invocation:
    """Queued again shortly, its open attempt (if any) closed with ``error``: a worker
    that raised (a bug) is treated as SQLite's engine treats it."""
    attempts = inv.attempts
    if attempts and attempts[-1].ended is None:
        attempts = (*attempts[:-1], replace(attempts[-1], ended=now, error=error))
    return inv.evolve(status=QUEUED, attempts=attempts, next_at=now + RUN_ERROR_DELAY_SEC)


class _Saver:
    """The ``save`` a worker gets: each write over the revision of the previous one,
    so a second delivery of the same invocation cannot run beside this one."""

    def __init__(self, store: Store, inv: Invocation, revision: int) -> None:
        self.store = store
        self.latest = inv  # as last stored: a worker's error closes its open attempt
        self.revision = revision

    async def __call__(self, inv: Invocation) -> None:
        self.revision = await self.store.write(inv, expect=self.revision)
        self.latest = inv


class Delivery:
    """The pull loops of one engine and the runs they start."""

    def __init__(self, store: Store, worker: Worker, clock: Callable[[], float]) -> None:
        self.store = store
        self.worker = worker
        self.clock = clock
        self.loops: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.running: dict[tuple[str, str], int] = defaultdict(int)
        self.freed: dict[tuple[str, str], asyncio.Event] = defaultdict(asyncio.Event)
        self.runs: set[asyncio.Task[None]] = set()
        self.noticed: set[tuple[str, str]] = set()
        self.wake = asyncio.Event()

    def notice(self, env: str, function: str) -> None:
        """Work was just queued for this function here: start its loop now."""
        loop = self.loops.get((env, function))
        if loop is None or loop.done():
            self.noticed.add((env, function))
            self.wake.set()

    async def run(self) -> None:
        scanned = -RESCAN_SEC
        self.store.index.on_active = self.notice
        try:
            while True:
                wanted = self.store.index.active_functions() | self.noticed
                self.noticed = set()
                if time.monotonic() - scanned >= RESCAN_SEC:
                    with contextlib.suppress(EngineUnavailable):
                        wanted |= await self.store.work_subjects()
                        scanned = time.monotonic()
                for key in wanted:
                    if key not in self.loops or self.loops[key].done():
                        self.loops[key] = asyncio.ensure_future(self._loop(key))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), DISCOVER_SEC)
                self.wake.clear()
        finally:
            self.store.index.on_active = None
            await self._stop()

    async def _stop(self) -> None:
        # the loops first: a pull request still open would take the messages that the
        # cancelled runs give back, to an inbox no longer read (until AckWait)
        loops = list(self.loops.values())
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        self.loops.clear()
        runs = list(self.runs)
        for task in runs:
            task.cancel()  # each gives its message back (a nak): another replica runs it
        await asyncio.gather(*runs, return_exceptions=True)

    # -- one function's loop

    def _limits(self, env: str, function: str) -> tuple[int, float]:
        limit = max(1, int(self.worker.concurrency(env, function)))
        return limit, float(self.worker.timeout(env, function)) + ACK_MARGIN_SEC

    async def _configure(self, env: str, function: str, limits: tuple[int, float]) -> None:
        """Create the function's consumer, or bring the one another replica made (or
        this one, before a change of the function's policy) to these limits."""
        names = self.store.names
        name = names.consumer(env, function)
        config = api.ConsumerConfig(
            name=name,
            durable_name=name,
            filter_subject=names.work(env, function),
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL,
            max_ack_pending=limits[0],
            ack_wait=limits[1],
            max_deliver=-1,
        )
        with translated(f"consumer {name}"):
            await self.store.js.add_consumer(names.work_stream, config)

    async def _loop(self, key: tuple[str, str]) -> None:
        env, function = key
        names = self.store.names
        puller = Puller(self.store.nc, names.work_stream, names.consumer(env, function))
        await puller.open()
        limits = (0, 0.0)  # as the consumer has them: (0, 0) not configured yet
        checked = idle_since = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                try:
                    if limits[0] == 0 or now - checked >= CONFIG_SEC:
                        checked = now
                        wanted = self._limits(env, function)
                        if wanted != limits:
                            await self._configure(env, function, wanted)
                            limits = wanted
                    free = limits[0] - self.running[key]
                    if free <= 0:
                        self.freed[key].clear()
                        await self.freed[key].wait()
                        continue
                    got = await puller.pull(free, lambda msg: self._start(key, msg), FETCH_SEC)
                except Exception as exc:  # the server away, the consumer gone: again
                    _log.warning("invocations of %s/%s: %s", env, function, exc)
                    limits = (0, 0.0)
                    await asyncio.sleep(RETRY_SEC)
                    continue
                if got:
                    idle_since = time.monotonic()
                elif self._idle(key, idle_since):
                    return
        finally:
            await puller.close()

    def _idle(self, key: tuple[str, str], since: float) -> bool:
        return (
            time.monotonic() - since >= IDLE_STOP_SEC
            and self.running[key] == 0
            and not self.store.index.active(*key)
        )

    def _start(self, key: tuple[str, str], msg: Any) -> None:
        self.running[key] += 1
        task = asyncio.ensure_future(self._handle(key, msg))
        self.runs.add(task)
        task.add_done_callback(self.runs.discard)

    async def _handle(self, key: tuple[str, str], msg: Any) -> None:
        try:
            await self._deliver(msg)
        except asyncio.CancelledError:
            # this engine stops: the message goes to another replica at once, which
            # closes the attempt as interrupted
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except (EngineUnavailable, nats.errors.Error) as exc:  # not acknowledged: it comes again
            _log.warning("invocation message on %s: %s", msg.subject, exc)
        except Exception:
            _log.exception("invocation message on %s", msg.subject)
            with contextlib.suppress(Exception):
                await msg.nak(delay=RUN_ERROR_DELAY_SEC)
        finally:
            self.running[key] -= 1
            self.freed[key].set()

    # -- one message

    async def _deliver(self, msg: Any) -> None:
        parsed = parse_work_message(msg.data)
        if parsed is None:
            _log.warning("not a work message on %s: dropped", msg.subject)
            await msg.term()
            return
        invocation_id, round_start = parsed
        for _ in range(3):  # a compare-and-set lost to another delivery: read again
            got = await self.store.read(invocation_id)
            if got is None or (got[0].status in ENDED and round_start > got[0].round_start):
                await self._unwritten(msg, invocation_id)  # a submit or redrive writing it
                return
            inv, revision = got
            try:
                if inv.status in ENDED or round_start < inv.round_start:
                    await self._finish(msg, inv)  # ended (an ack lost) or superseded
                    return
                now = self.clock()
                if inv.status == RUNNING:
                    alive_until = self._alive_until(inv)
                    if now < alive_until:  # a second message while its attempt may run
                        await msg.nak(delay=alive_until - now)
                        return
                    # its worker died: a live one ends its attempt within its timeout
                    inv = interrupted(inv, now)
                    revision = await self.store.write(inv, expect=revision)
                elif inv.next_at > now:
                    await self._later(msg, inv)
                    return
                await self._run(msg, inv, revision)
                return
            except Conflict:
                continue
        _log.warning("invocation %s: changed under three deliveries in a row", invocation_id)
        await msg.nak(delay=RECORD_WAIT_SEC)

    async def _unwritten(self, msg: Any, invocation_id: str) -> None:
        age = self.clock() - msg.metadata.timestamp.timestamp()
        if age < RECORD_GRACE_SEC:
            await msg.nak(delay=RECORD_WAIT_SEC)
            return
        _log.warning(
            "invocation %s: no record %.0f s after it was queued: dropped", invocation_id, age
        )
        await msg.term()

    def _alive_until(self, inv: Invocation) -> float:
        """Until when the worker of a ``running`` record may still be at its attempt
        (its timeout, and the margin of AckWait: the server waits that long too)."""
        started = inv.attempts[-1].started if inv.attempts else 0.0
        return started + self._limits(inv.env, inv.function)[1]

    async def _run(self, msg: Any, inv: Invocation, revision: int) -> None:
        save = _Saver(self.store, inv, revision)
        beat = asyncio.ensure_future(self._beat(msg, inv))
        try:
            try:
                out = await self.worker.run(inv, save)
                if out.status == RUNNING:
                    raise ValueError("the worker returned it still running")
            except asyncio.CancelledError:
                # this engine stops: the attempt is closed as interrupted here, so the
                # replica the message goes to runs it at once
                if save.latest.status == RUNNING:
                    stopped = interrupted(save.latest, self.clock())
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(save(stopped), STOP_WRITE_SEC)
                raise
            except (Conflict, EngineUnavailable):
                raise
            except Exception as exc:
                _log.exception("invocation %s: the worker failed", inv.id)
                out = after_error(save.latest, f"the worker failed: {exc}"[:300], self.clock())
            await save(out)
        except Conflict:  # another delivery runs it: this message is not needed
            await msg.ack()
            return
        finally:
            beat.cancel()
        await self._settle(msg, out)

    async def _beat(self, msg: Any, inv: Invocation) -> None:
        """Tell the server the attempt goes on, well within ``ack_wait``."""
        every = max(0.2, self._limits(inv.env, inv.function)[1] / 3)
        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def _settle(self, msg: Any, out: Invocation) -> None:
        if out.status in ENDED:
            await self._finish(msg, out)
        elif out.next_at > self.clock():
            await self._later(msg, out)
        else:
            await msg.nak()  # due now: delivered again at once

    async def _finish(self, msg: Any, inv: Invocation) -> None:
        if inv.status == DEAD:
            await self.store.dead_letter(inv)
        await msg.ack()

    async def _later(self, msg: Any, inv: Invocation) -> None:
        """Delivered again at ``next_at``: a message the server publishes then (it holds
        no place of ``max_ack_pending`` meanwhile), or a delayed nak when that is near
        or the server has no message schedules."""
        wait = inv.next_at - self.clock()
        if self.store.schedules and wait > NEAR_SEC:
            await self.store.schedule(inv)
            await msg.ack()
        else:
            await msg.nak(delay=max(0.001, wait))
