"""What every queue engine does (``gitops_sless/invocations/engine.py``), written against
the :class:`Engine` protocol only: the ``engine`` fixture (conftest.py) runs each test
on every engine."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest

from gitops_sless.invocations.engine import Engine, Save
from gitops_sless.invocations.model import (
    DEAD,
    FAILED,
    QUEUED,
    RUNNING,
    STATUSES,
    SUCCEEDED,
    Attempt,
    Callback,
    Filter,
    Invocation,
    Response,
    new_id,
)

pytestmark = pytest.mark.anyio

WAIT_SEC = 5.0  # the most any condition below is waited for (a failure, not a figure)


def make(
    function: str = "hello", env: str = "prod", key: str | None = None, **changes: object
) -> Invocation:
    invocation = Invocation(
        id=new_id(),
        env=env,
        function=function,
        method="POST",
        path="/orders?x=1",
        headers=(("content-type", "application/json"), ("x-trace", "a")),
        body=b'{"n": 1}',
        created=time.time(),
        client="203.0.113.7",
        idempotency_key=key,
    )
    return invocation.evolve(**changes)


def ended(invocation: Invocation, status: str, when: float | None = None) -> Invocation:
    """``invocation`` after one attempt that ended it with ``status``."""
    when = time.time() if when is None else when
    attempt = Attempt(invocation.attempt + 1, when - 0.1, when, 500, "HTTP 500")
    return invocation.evolve(
        status=status,
        attempts=(*invocation.attempts, attempt),
        response=Response(500, (("content-type", "text/plain"),), b"boom"),
        error="HTTP 500",
        ended=when,
    )


async def wait_for(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + WAIT_SEC
    while not condition():
        assert time.monotonic() < deadline, f"waited {WAIT_SEC} s for {what}"
        await asyncio.sleep(0.01)


class FakeWorker:
    """Runs attempts the way the real worker does (saves ``running`` first), counts
    runs at once per function, and ends each as ``answer`` says (succeeded by default);
    while ``hold`` is set, attempts wait for it to be cleared."""

    def __init__(
        self, limit: int = 10, answer: Callable[[Invocation], Invocation] | None = None
    ) -> None:
        self.limit = limit
        self.answer = answer or (lambda inv: inv.evolve(status=SUCCEEDED, ended=time.time()))
        self.runs: list[Invocation] = []  # each as it was handed over
        self.started: dict[str, list[float]] = {}  # id: when each of its runs began
        self.at_once: Counter[str] = Counter()  # function: runs under way now
        self.most: Counter[str] = Counter()  # function: most runs under way at once
        self.finished = 0
        self.hold = asyncio.Event()
        self.hold.set()

    def concurrency(self, env: str, function: str) -> int:
        return self.limit

    def timeout(self, env: str, function: str) -> float:
        return 30.0

    async def run(self, invocation: Invocation, save: Save) -> Invocation:
        self.runs.append(invocation)
        self.started.setdefault(invocation.id, []).append(time.time())
        self.at_once[invocation.function] += 1
        fn = invocation.function
        self.most[fn] = max(self.most[fn], self.at_once[fn])
        try:
            attempt = Attempt(invocation.attempt + 1, time.time())
            running = invocation.evolve(status=RUNNING, attempts=(*invocation.attempts, attempt))
            await save(running)
            await self.hold.wait()
            closed = replace(attempt, ended=time.time(), status_code=200)
            done = running.evolve(
                attempts=(*invocation.attempts, closed),
                response=Response(200, (), b"ok"),
            )
            return self.answer(done)
        finally:
            self.at_once[fn] -= 1
            self.finished += 1


@asynccontextmanager
async def consuming(engine: Engine, worker: FakeWorker) -> AsyncIterator[None]:
    task = asyncio.create_task(engine.consume(worker))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def status_of(engine: Engine, invocation_id: str) -> str | None:
    found = await engine.get(invocation_id)
    return None if found is None else found.status


async def until_stored(engine: Engine, ids: list[str], status: str) -> None:
    """Wait until the engine has stored ``status`` for each of ``ids``: a run's outcome is
    saved after the worker hands it back (``finished`` counts before that)."""
    deadline = time.monotonic() + WAIT_SEC
    while (statuses := [await status_of(engine, i) for i in ids]) != [status] * len(ids):
        assert time.monotonic() < deadline, f"waited {WAIT_SEC} s for {status}: {statuses}"
        await asyncio.sleep(0.01)


# -- storing and reading


async def test_a_submitted_invocation_reads_back_as_it_was_submitted(engine: Engine) -> None:
    invocation = make(callback=Callback("https://example.com/done"))
    stored, created = await engine.submit(invocation)
    assert (stored, created) == (invocation, True)
    assert await engine.get(invocation.id) == invocation
    assert await engine.get(new_id()) is None


async def test_an_idempotency_key_gives_back_the_first_invocation(engine: Engine) -> None:
    first, created = await engine.submit(make(key="order-7"))
    assert created
    again, created = await engine.submit(make(key="order-7", body=b"other"))
    assert (again, created) == (first, False)
    other_function, created = await engine.submit(make("other", key="order-7"))
    assert created and other_function.id != first.id
    other_env, created = await engine.submit(make(env="staging", key="order-7"))
    assert created and other_env.id != first.id
    assert len(await engine.list(Filter())) == 3


async def test_a_listing_filters_and_pages_oldest_first(engine: Engine) -> None:
    made = [make("a"), make("b"), make("a", env="staging"), make("a"), make("b")]
    for invocation in made:
        await engine.submit(invocation)
    await engine.save(ended(made[3], DEAD))
    await engine.save(ended(made[4], SUCCEEDED))
    ids = sorted(inv.id for inv in made)

    def listed(found: list[Invocation]) -> list[str]:
        return [inv.id for inv in found]

    assert listed(await engine.list(Filter())) == ids
    assert listed(await engine.list(Filter(env="prod", function="a"))) == sorted(
        [made[0].id, made[3].id]
    )
    assert listed(await engine.list(Filter(status=DEAD))) == [made[3].id]
    both = Filter(statuses=frozenset({DEAD, SUCCEEDED}))
    assert listed(await engine.list(both)) == sorted([made[3].id, made[4].id])
    assert listed(await engine.list(Filter(env="prod", status=QUEUED))) == sorted(
        [made[0].id, made[1].id]
    )
    pages, after = [], None
    while page := await engine.list(Filter(limit=2, after=after)):
        pages.append(listed(page))
        after = page[-1].id
    assert pages == [ids[0:2], ids[2:4], ids[4:]]


async def test_counts_give_each_status_and_the_oldest_queued(engine: Engine) -> None:
    a1, a2, a3, b1 = make("a"), make("a"), make("a"), make("b")
    for invocation in (a1, a2, a3, b1):
        await engine.submit(invocation)
    await engine.save(ended(a3, FAILED))
    await engine.save(ended(b1, DEAD))
    counts = await engine.counts()
    assert counts[("prod", "a")] == (
        {QUEUED: 2, RUNNING: 0, SUCCEEDED: 0, FAILED: 1, DEAD: 0},
        min(a1.created, a2.created),
    )
    statuses, oldest = counts[("prod", "b")]
    assert dict(statuses) == {**dict.fromkeys(STATUSES, 0), DEAD: 1}
    assert oldest is None


# -- consuming


async def test_each_invocation_runs_once_and_its_outcome_is_stored(engine: Engine) -> None:
    made = [make(f"fn{i % 3}") for i in range(24)]
    for invocation in made:
        await engine.submit(invocation)
    worker = FakeWorker(limit=4)
    async with consuming(engine, worker):
        await wait_for(lambda: worker.finished == len(made), "every run")
        await until_stored(engine, [inv.id for inv in made], SUCCEEDED)
        await asyncio.sleep(0.05)  # room for a wrong second delivery to show
    assert sorted(inv.id for inv in worker.runs) == sorted(inv.id for inv in made)
    for invocation in made:
        stored = await engine.get(invocation.id)
        assert stored is not None and stored.status == SUCCEEDED
        assert stored.response == Response(200, (), b"ok")
        assert [(a.number, a.status_code) for a in stored.attempts] == [(1, 200)]


async def test_no_more_than_the_concurrency_of_one_function_run_at_once(engine: Engine) -> None:
    busy = [make("busy") for _ in range(10)]
    other = [make("other") for _ in range(2)]
    worker = FakeWorker(limit=3)
    worker.hold.clear()
    async with consuming(engine, worker):
        for invocation in busy + other:
            await engine.submit(invocation)
        # the other function is not held up by the busy one's full slots
        await wait_for(lambda: worker.at_once == {"busy": 3, "other": 2}, "the first runs")
        await asyncio.sleep(0.05)
        assert worker.at_once == {"busy": 3, "other": 2}
        worker.hold.set()
        await wait_for(lambda: worker.finished == 12, "every run")
    assert worker.most == {"busy": 3, "other": 2}
    assert len(worker.runs) == 12


async def test_a_retry_runs_again_only_once_it_is_due(engine: Engine) -> None:
    delay = 0.3
    retry_at: dict[str, float] = {}

    def once_more(inv: Invocation) -> Invocation:
        if inv.attempt == 1:
            retry_at[inv.id] = time.time() + delay
            return inv.evolve(status=QUEUED, next_at=retry_at[inv.id], error="HTTP 503")
        return inv.evolve(status=SUCCEEDED, ended=time.time(), error=None)

    worker = FakeWorker(answer=once_more)
    invocation = make()
    async with consuming(engine, worker):
        await engine.submit(invocation)
        await wait_for(lambda: worker.finished == 2, "the retry")
        await until_stored(engine, [invocation.id], SUCCEEDED)
    first, second = worker.started[invocation.id]
    assert second >= retry_at[invocation.id] > first
    stored = await engine.get(invocation.id)
    assert stored is not None and stored.status == SUCCEEDED
    assert [a.number for a in stored.attempts] == [1, 2]


async def test_a_redrive_queues_a_dead_or_failed_invocation_for_a_new_round(
    engine: Engine,
) -> None:
    dead, failed, done = make(), make(), make()
    for invocation, status in ((dead, DEAD), (failed, FAILED), (done, SUCCEEDED)):
        await engine.submit(invocation)
        await engine.save(ended(invocation, status))
    again = await engine.redrive(dead.id)
    assert again is not None and again.status == QUEUED
    assert again.round_start == 1 and len(again.attempts) == 1 and again.failures == 0
    assert again.next_at <= time.time()
    assert await engine.get(dead.id) == again
    assert await status_of(engine, failed.id) == FAILED
    assert (await engine.redrive(failed.id) or failed).status == QUEUED
    unchanged = await engine.redrive(done.id)
    assert unchanged is not None and unchanged.status == SUCCEEDED
    assert await engine.redrive(new_id()) is None
    worker = FakeWorker()
    async with consuming(engine, worker):
        await wait_for(lambda: worker.finished == 2, "the redriven runs")
        await until_stored(engine, [dead.id, failed.id], SUCCEEDED)
    assert {inv.id for inv in worker.runs} == {dead.id, failed.id}
    stored = await engine.get(dead.id)
    assert stored is not None and stored.status == SUCCEEDED
    assert [a.number for a in stored.attempts] == [1, 2]


async def test_every_dead_invocation_of_a_function_is_redriven(engine: Engine) -> None:
    mine = [make("a"), make("a"), make("a")]
    theirs = [make("b"), make("a", env="staging")]
    for invocation in mine + theirs:
        await engine.submit(invocation)
        await engine.save(ended(invocation, DEAD))
    await engine.save(ended(mine[2], FAILED))  # not dead: stays
    assert await engine.redrive_dead("prod", "a") == 2
    statuses = [await status_of(engine, inv.id) for inv in mine + theirs]
    assert statuses == [QUEUED, QUEUED, FAILED, DEAD, DEAD]
    assert await engine.redrive_dead("prod", "a") == 0


async def test_an_event_reaches_every_function_subscribed_to_it(engine: Engine) -> None:
    engine.set_subscriptions(
        {
            ("prod", "a"): frozenset({"orders.created"}),
            ("prod", "b"): frozenset({"orders.created", "orders.paid"}),
            ("prod", "c"): frozenset({"orders.paid"}),
            ("staging", "a"): frozenset({"orders.created"}),
        }
    )
    headers = (("content-type", "application/json"),)
    returned = await engine.publish("prod", "orders.created", b"{}", headers, "198.51.100.1")
    worker = FakeWorker()
    async with consuming(engine, worker):
        await wait_for(lambda: worker.finished == 2, "both runs")
        await asyncio.sleep(0.05)  # room for a wrong third one to show
    assert sorted((inv.env, inv.function) for inv in worker.runs) == [("prod", "a"), ("prod", "b")]
    for invocation in worker.runs:
        assert (invocation.method, invocation.path, invocation.body) == ("POST", "/", b"{}")
        assert (invocation.headers, invocation.client) == (headers, "198.51.100.1")
        assert invocation.subject == "orders.created"
    assert returned == [] or {inv.id for inv in returned} == {inv.id for inv in worker.runs}


# -- callbacks and collecting


async def test_due_callbacks_are_the_ended_ones_pending_and_due(engine: Engine) -> None:
    now = time.time()
    due = make(callback=Callback("https://example.com/a"))
    later = make(callback=Callback("https://example.com/b"))
    delivered = make(callback=Callback("https://example.com/c"))
    not_ended = make(callback=Callback("https://example.com/d"))
    for invocation in (due, later, delivered, not_ended):
        await engine.submit(invocation)
    pending = Callback("", "pending", 1, now - 1)
    await engine.save(ended(due, SUCCEEDED).evolve(callback=replace(pending, url="a")))
    await engine.save(ended(later, DEAD).evolve(callback=replace(pending, next_at=now + 60)))
    await engine.save(ended(delivered, FAILED).evolve(callback=Callback("c", "delivered")))
    await engine.save(not_ended.evolve(status=QUEUED, callback=pending))
    found = await engine.due_callbacks(now)
    assert [inv.id for inv in found] == [due.id]
    assert found[0].callback == replace(pending, url="a")
    assert {inv.id for inv in await engine.due_callbacks(now + 61)} == {due.id, later.id}


async def test_collect_forgets_what_ended_before_and_frees_its_key(engine: Engine) -> None:
    now = time.time()
    old, recent, waiting = make(key="k1"), make(key="k2"), make(key="k3")
    for invocation in (old, recent, waiting):
        await engine.submit(invocation)
    await engine.save(ended(old, SUCCEEDED, now - 100))
    await engine.save(ended(recent, DEAD, now - 10))
    assert await engine.collect(now - 50) == 1
    assert await engine.get(old.id) is None
    assert await status_of(engine, recent.id) == DEAD
    assert await status_of(engine, waiting.id) == QUEUED
    anew, created = await engine.submit(make(key="k1"))
    assert created and anew.id != old.id
    assert (await engine.submit(make(key="k2")))[1] is False
    assert await engine.collect(now - 50) == 0
