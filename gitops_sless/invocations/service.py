"""Asynchronous invocations in a running server: the engine, its workers, callbacks,
housekeeping, and the queue triggers taken from what the repository declares.

:class:`Invocations` lives on the event loop that serves ``/fn/`` (its workers call
the proxy there, in process): :meth:`Invocations.start` from that loop (the API's
lifespan), :meth:`Invocations.stop` at shutdown. Everything the API asks of it is
a coroutine on that loop too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from ipaddress import IPv4Network, IPv6Network
from typing import Any

from ..metrics import METRICS
from ..state.routes import RouteTable
from .callbacks import CallbackSecrets, deliver, refusal
from .engine import Counts, Engine
from .model import ENDED, STATUSES, Filter, Invocation
from .submit import Submitter
from .worker import Caller, Runner

__all__ = ["Invocations"]

_log = logging.getLogger(__name__)

Network = IPv4Network | IPv6Network
CALLBACK_TICK_SEC = 1.0  # how often due callbacks are looked for (an end wakes it sooner)
COUNT_TICK_SEC = 5.0  # the queue's gauges in /metrics
COLLECT_TICK_SEC = 60.0
CALLBACKS_AT_ONCE = 16
START_TIMEOUT_SEC = 10.0
SECRET_RETRY_SEC = 60.0


class Invocations:
    """Asynchronous invocations over one engine (None: refused, with ``unavailable``)."""

    def __init__(
        self,
        engine: Engine | None,
        routes: RouteTable,
        call: Caller,
        secrets: CallbackSecrets,
        *,
        max_body_bytes: int,
        retention_sec: float = 86400.0,
        callback_allow: Sequence[Network] = (),
        own_networks: Sequence[Network] = (),
        unavailable: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.routes = routes
        self.secrets = secrets
        self.retention_sec = retention_sec
        self.callback_allow = tuple(callback_allow)
        self.own_networks = tuple(own_networks)
        self.clock = clock
        self.runner = Runner(routes, call, clock=clock, ended=self._ended)
        self.submitter = Submitter(
            routes,
            engine,
            max_body_bytes=max_body_bytes,
            callback_refusal=self._refusal,
            unavailable=unavailable if engine is None else None,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._callbacks_due = asyncio.Event()
        self._counts: Counts = {}
        self._declared = bool(routes.all_declared())
        routes.watch_declarations(self._declarations_changed)

    @property
    def enabled(self) -> bool:
        return self.engine is not None

    async def start(self) -> None:
        """Open the engine and start its workers (on the loop that serves ``/fn/``)."""
        if self.engine is None or self._tasks:
            return
        self._loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            await asyncio.wait_for(engine.start(), START_TIMEOUT_SEC)
            started = True
        except Exception as exc:  # a queue server down must not keep /fn/ from serving
            _log.warning("the queue is not available (%s): trying again in the background", exc)
            started = False

        async def consume() -> None:
            if not started:
                await engine.start()
            self._apply_subscriptions()
            await engine.consume(self.runner)

        self._apply_subscriptions()
        self._tasks = [
            asyncio.ensure_future(self._forever("consume", consume)),
            asyncio.ensure_future(self._forever("callbacks", self._callbacks)),
            asyncio.ensure_future(self._forever("housekeeping", self._housekeeping)),
        ]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.engine is not None:
            await self.engine.close()

    async def _forever(self, what: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run ``run`` again after it fails: a bug in one loop must not stop the queue."""
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                _log.exception("asynchronous invocations: %s failed; again in 5 s", what)
                await asyncio.sleep(5)

    # -- the repository's queue triggers

    def _declarations_changed(self) -> None:
        self._declared = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._apply_subscriptions)

    def _apply_subscriptions(self) -> None:
        # before anything is declared (a restart, a follower that has not read the
        # Function resources yet) an empty set would drop every other replica's
        # subscriptions on a shared NATS server
        if self.engine is None or not self._declared:
            return
        subscriptions = {
            (env, name): frozenset(declared.subjects)
            for env, functions in self.routes.all_declared().items()
            for name, declared in functions.items()
            if declared.subjects
        }
        self.engine.set_subscriptions(subscriptions)

    # -- what the API asks

    async def get(self, invocation_id: str) -> Invocation | None:
        return await self._engine().get(invocation_id)

    async def list(self, which: Filter) -> list[Invocation]:
        return await self._engine().list(which)

    async def redrive(self, invocation_id: str) -> Invocation | None:
        return await self._engine().redrive(invocation_id)

    async def redrive_dead(self, env: str, function: str) -> int:
        return await self._engine().redrive_dead(env, function)

    async def publish(
        self,
        env: str,
        subject: str,
        body: bytes,
        headers: tuple[tuple[str, str], ...],
        client: str | None,
    ) -> list[Invocation]:
        return await self._engine().publish(env, subject, body, headers, client)

    def counts(self, env: str, function: str) -> dict[str, int]:
        """The function's invocations by status, as last counted (every few seconds)."""
        found = self._counts.get((env, function))
        return dict(found[0]) if found else dict.fromkeys(STATUSES, 0)

    def dead_letters(self) -> dict[tuple[str, str], int]:
        """(env, function) -> its dead invocations, as last counted (every few seconds)."""
        return {key: found[0].get("dead", 0) for key, found in self._counts.items()}

    def _engine(self) -> Engine:
        if self.engine is None:
            raise LookupError("asynchronous invocations are off")
        return self.engine

    # -- callbacks, counting, collecting

    async def _refusal(self, url: str) -> str | None:
        return await refusal(url, self.callback_allow, self.own_networks)

    def _ended(self, invocation: Invocation) -> None:
        if invocation.callback is not None:
            self._callbacks_due.set()

    async def _callbacks(self) -> None:
        engine = self.engine
        assert engine is not None
        limit = asyncio.Semaphore(CALLBACKS_AT_ONCE)
        running: set[str] = set()  # ids being delivered: never two deliveries of one
        tasks: set[asyncio.Task[None]] = set()

        async def one(invocation: Invocation) -> None:
            async with limit:
                try:
                    secret = self.secrets.secret(invocation.env)
                except (OSError, ValueError) as exc:  # the operator's to fix: say it, wait
                    _log.error("callback of %s not signed: %s", invocation.id, exc)
                    callback = replace(
                        invocation.callback,  # type: ignore[arg-type]
                        next_at=self.clock() + SECRET_RETRY_SEC,
                        error=f"the callback secret cannot be read: {exc}",
                    )
                else:
                    callback = await deliver(
                        invocation,
                        secret=secret,
                        allowed=self.callback_allow,
                        own=self.own_networks,
                    )
                try:
                    # read again: a redrive while it was delivered must not be undone
                    current = await engine.get(invocation.id)
                    if current is not None and current.ended == invocation.ended:
                        await engine.save(current.evolve(callback=callback))
                finally:
                    running.discard(invocation.id)

        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._callbacks_due.wait(), CALLBACK_TICK_SEC)
            self._callbacks_due.clear()
            for invocation in await self.engine.due_callbacks(self.clock()):
                if invocation.id in running or invocation.status not in ENDED:
                    continue
                running.add(invocation.id)
                task = asyncio.ensure_future(one(invocation))
                tasks.add(task)  # held until done: the loop keeps only weak references
                task.add_done_callback(tasks.discard)

    async def _housekeeping(self) -> None:
        assert self.engine is not None
        collected_at = 0.0
        while True:
            now = self.clock()
            # a short retention is collected soon after it passes, a long one every minute
            if now - collected_at >= min(COLLECT_TICK_SEC, max(1.0, self.retention_sec / 4)):
                collected_at = now
                gone = await self.engine.collect(now - self.retention_sec)
                if gone:
                    _log.info("forgot %d invocations ended over the retention", gone)
            self._counts = await self.engine.counts()
            self._export(self._counts, now)
            await asyncio.sleep(COUNT_TICK_SEC)

    @staticmethod
    def _export(counts: Counts, now: float) -> None:
        by_status: list[tuple[float, dict[str, str]]] = []
        oldest: list[tuple[float, dict[str, str]]] = []
        for (env, function), (statuses, first) in sorted(counts.items()):
            labels = {"env": env, "function": function}
            by_status += [(statuses.get(s, 0), {**labels, "status": s}) for s in STATUSES]
            oldest.append((max(0.0, now - first) if first is not None else 0.0, labels))
        METRICS.async_invocations.replace(by_status)
        METRICS.async_oldest.replace(oldest)
