"""What the NATS engine does beyond the contract: replicas sharing a server, a replica
killed mid-run, the server killed and started again, events from plain NATS clients,
retries scheduled by the server, dead letters. Each test has a server of its own
(tests/natsserver.py); nothing here asserts a wall-clock time."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import AsyncIterator

import nats
import pytest

from gitops_sless.invocations import nats as nats_engine
from gitops_sless.invocations import natsconsume
from gitops_sless.invocations.engine import EngineUnavailable
from gitops_sless.invocations.model import (
    DEAD,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Filter,
    Invocation,
    Response,
)
from gitops_sless.invocations.nats import NatsEngine
from gitops_sless.invocations.natsevents import event_id

from ..natsserver import NatsServer, nats_server  # noqa: F401 - the fixture
from ..paths import ROOT
from .test_engine_contract import (
    FakeWorker,
    consuming,
    make,
    status_of,
    until_stored,
    wait_for,
)

pytestmark = pytest.mark.anyio


class ShortWorker(FakeWorker):
    """A FakeWorker whose function times out quickly: AckWait is short."""

    def timeout(self, env: str, function: str) -> float:
        return 0.3


@pytest.fixture
async def engines(nats_server: NatsServer) -> AsyncIterator[list[NatsEngine]]:  # noqa: F811
    """Two engines on the same server (two reconciler replicas), started."""
    made = [NatsEngine(nats_server.url), NatsEngine(nats_server.url)]
    for engine in made:
        await engine.start()
    try:
        yield made
    finally:
        for engine in made:
            await engine.close()


async def until(condition, what: str, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    """Wait for an async ``condition`` (a failure after ``timeout``, not a figure)."""
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        await asyncio.sleep(0.02)


# -- replicas


async def test_two_replicas_share_the_work_and_the_limit_and_each_runs_it_once(engines):
    first, second = engines
    workers = [FakeWorker(limit=3), FakeWorker(limit=3)]
    at_once: Counter[str] = Counter()
    most: Counter[str] = Counter()

    def answer(inv: Invocation) -> Invocation:
        return inv.evolve(status=SUCCEEDED, ended=time.time())

    for worker in workers:  # runs of both replicas counted together
        worker.answer = answer
        original = worker.run

        async def run(inv, save, original=original):  # type: ignore[no-untyped-def]
            at_once[inv.function] += 1
            most[inv.function] = max(most[inv.function], at_once[inv.function])
            try:
                await asyncio.sleep(0.02)
                return await original(inv, save)
            finally:
                at_once[inv.function] -= 1

        worker.run = run  # type: ignore[method-assign]
    made = [make(f"fn{i % 2}") for i in range(30)]
    for i, invocation in enumerate(made):
        await (first if i % 2 else second).submit(invocation)
    async with consuming(first, workers[0]), consuming(second, workers[1]):
        await wait_for(lambda: sum(w.finished for w in workers) == len(made), "every run")
        await asyncio.sleep(0.1)  # room for a second run of one to show
    runs = [inv.id for w in workers for inv in w.runs]
    assert sorted(runs) == sorted(inv.id for inv in made)
    assert all(w.runs for w in workers), "both replicas took work"
    assert max(most.values()) <= 3  # one function's concurrency across both replicas
    # each replica's index heard of the other's writes
    for engine in engines:
        counts = await engine.counts()
        assert sum(counts[("prod", f"fn{i}")][0][SUCCEEDED] for i in range(2)) == len(made)


_KILLED_REPLICA = """
import asyncio, sys, time
from gitops_sless.invocations.model import Attempt, RUNNING
from gitops_sless.invocations.nats import NatsEngine

class Stuck:
    def concurrency(self, env, function): return 1
    def timeout(self, env, function): return 0.3
    async def run(self, inv, save):
        attempt = Attempt(inv.attempt + 1, time.time())
        await save(inv.evolve(status=RUNNING, attempts=(*inv.attempts, attempt)))
        await asyncio.Event().wait()  # never ends: killed here

async def main():
    engine = NatsEngine(sys.argv[1])
    await engine.start()
    await engine.consume(Stuck())

asyncio.run(main())
"""


async def test_a_replica_killed_mid_run_leaves_its_invocation_to_another(engines):
    first, second = engines
    invocation = make("slow")
    replica = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_REPLICA), first.url],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )
    try:
        await first.submit(invocation)
        await until(
            lambda: _is(first, invocation.id, RUNNING), "the other replica's run", timeout=30
        )
    finally:
        os.killpg(replica.pid, signal.SIGKILL)
        replica.wait()
    worker = ShortWorker()
    async with consuming(second, worker):
        await wait_for(lambda: worker.finished == 1, "the run after AckWait")  # type: ignore[arg-type]
        await until_stored(second, [invocation.id], SUCCEEDED)
    stored = await second.get(invocation.id)
    assert stored is not None and stored.status == SUCCEEDED
    cut, done = stored.attempts
    assert (cut.counted, cut.error) == (False, natsconsume.INTERRUPTED)
    assert (done.number, done.status_code, done.counted) == (2, 200, True)


async def _is(engine: NatsEngine, invocation_id: str, status: str) -> bool:
    return await status_of(engine, invocation_id) == status


async def test_a_stopped_replica_hands_its_runs_over_at_once(engines):
    first, second = engines
    held = FakeWorker()
    held.hold.clear()
    invocation = make()
    async with consuming(first, held):
        await first.submit(invocation)
        await wait_for(lambda: held.at_once["hello"] == 1, "the run")
    # the stop nak'ed it: the other replica runs it without waiting for AckWait (30 s)
    worker = FakeWorker()
    async with consuming(second, worker):
        await wait_for(lambda: worker.finished == 1, "the run elsewhere")
        await until_stored(second, [invocation.id], SUCCEEDED)
    stored = await second.get(invocation.id)
    assert stored is not None and stored.status == SUCCEEDED
    assert [a.counted for a in stored.attempts] == [False, True]


# -- the server away


async def test_nothing_queued_is_lost_when_the_server_is_killed(nats_server):  # noqa: F811
    engine, observer = NatsEngine(nats_server.url), NatsEngine(nats_server.url)
    await engine.start()
    await observer.start()
    worker = ShortWorker(limit=2)
    worker.hold.clear()
    try:
        async with consuming(engine, worker):
            before = [make() for _ in range(8)]
            for invocation in before:
                await engine.submit(invocation)
            await wait_for(lambda: worker.at_once["hello"] == 2, "two runs")
            nats_server.stop()  # kill -9: the two running cannot store their end
            worker.hold.set()
            with pytest.raises(EngineUnavailable):
                await engine.submit(make())
            nats_server.start()
            await until(lambda: _connected(engine), "the reconnection")
            after = [make() for _ in range(4)]
            for invocation in after:
                await engine.submit(invocation)
            await until(lambda: _all(engine, before + after, SUCCEEDED), "every run", 30)
        # the other replica's index followed the restart too
        await until(lambda: _counted(observer, SUCCEEDED, len(before + after)), "the observer", 30)
    finally:
        await engine.close()
        await observer.close()


async def _connected(engine: NatsEngine) -> bool:
    return engine._nc is not None and engine._nc.is_connected


async def _all(engine: NatsEngine, made: list[Invocation], status: str) -> bool:
    return all([await status_of(engine, inv.id) == status for inv in made])


async def _counted(engine: NatsEngine, status: str, n: int) -> bool:
    counts = await engine.counts()
    return counts.get(("prod", "hello"), ({}, None))[0].get(status) == n


async def test_a_submit_while_the_server_is_down_is_refused_not_held(nats_server, monkeypatch):  # noqa: F811
    monkeypatch.setattr(nats_engine, "CONNECT_TIMEOUT_SEC", 0.5)
    engine = NatsEngine(nats_server.url)
    await engine.start()
    try:
        nats_server.stop()
        # a bound far above the engine's own: a hang fails here rather than hangs
        for call in (engine.submit(make()), engine.get("x"), engine.counts()):
            with pytest.raises(EngineUnavailable):
                await asyncio.wait_for(call, 20)
    finally:
        await engine.close()
    unreachable = NatsEngine(nats_server.url)
    with pytest.raises(EngineUnavailable):
        await asyncio.wait_for(unreachable.start(), 20)
    await unreachable.close()


# -- queue triggers


async def test_an_event_from_any_nats_client_reaches_productions_functions_only(engines):
    engine = engines[0]
    engine.set_subscriptions(
        {
            ("prod", "a"): frozenset({"orders.created"}),
            ("prod", "b"): frozenset({"orders.created"}),
            ("pr-7", "a"): frozenset({"orders.created"}),
        }
    )
    client = await nats.connect(engine.url)
    try:
        js = client.jetstream()

        async def ready() -> bool:  # the three subscriptions are on the server
            try:
                found = await js.consumers_info("SLESS_EVENTS")
            except nats.js.errors.NotFoundError:
                return False
            return len(found) == 3

        await until(ready, "the subscriptions")
        await js.publish("orders.created", b'{"n": 1}', headers={"content-type": "text/json"})
        await engine.publish("pr-7", "orders.created", b'{"n": 2}', (), "192.0.2.9")
    finally:
        await client.close()
    worker = FakeWorker()
    async with consuming(engine, worker):
        await wait_for(lambda: worker.finished == 3, "three runs")
        await asyncio.sleep(0.1)  # room for a wrong fourth one to show
    runs = sorted((inv.env, inv.function, inv.body, inv.client) for inv in worker.runs)
    assert runs == [
        ("pr-7", "a", b'{"n": 2}', "192.0.2.9"),
        ("prod", "a", b'{"n": 1}', None),
        ("prod", "b", b'{"n": 1}', None),
    ]
    prod = [inv for inv in worker.runs if inv.env == "prod"]
    assert all(inv.headers == (("content-type", "text/json"),) for inv in prod)
    assert all(inv.subject == "orders.created" for inv in worker.runs)


def test_an_events_invocation_id_is_the_same_at_each_delivery():
    one = event_id(1_700_000_000.123, 42, "prod", "a")
    assert one == event_id(1_700_000_000.123, 42, "prod", "a")
    assert len(one) == 26 and one.isalnum() and one == one.lower()
    others = {
        event_id(1_700_000_000.123, 43, "prod", "a"),
        event_id(1_700_000_000.123, 42, "prod", "b"),
    }
    assert one not in others and len(others) == 2


# -- retries and dead letters


@pytest.mark.parametrize("schedules", [True, False], ids=["scheduled", "nak-delay"])
async def test_a_retry_waits_its_time(engines, schedules):
    engine = engines[0]
    assert engine._store is not None
    engine._store.schedules = schedules  # as on a server without message schedules
    delay = natsconsume.NEAR_SEC + 0.3  # far enough to be scheduled
    retry_at: dict[str, float] = {}

    def once_more(inv: Invocation) -> Invocation:
        if inv.attempt == 1 and inv.function == "flaky":
            retry_at[inv.id] = time.time() + delay
            return inv.evolve(status=QUEUED, next_at=retry_at[inv.id], error="HTTP 503")
        return inv.evolve(status=SUCCEEDED, ended=time.time(), error=None)

    worker = FakeWorker(limit=1, answer=once_more)
    flaky, later = make("flaky"), make("flaky")
    async with consuming(engine, worker):
        await engine.submit(flaky)
        await wait_for(lambda: flaky.id in retry_at, "the first attempt")
        await engine.submit(later)
        await wait_for(lambda: worker.finished == 3, "the retry")
    first, second = worker.started[flaky.id]
    assert second >= retry_at[flaky.id] > first
    if schedules:  # waiting on the server's schedule, the retry held no place
        assert worker.started[later.id][0] < retry_at[flaky.id]


async def test_a_dead_invocation_leaves_a_dead_letter_until_redriven(engines):
    engine = engines[0]
    worker = FakeWorker(answer=lambda inv: inv.evolve(status=DEAD, ended=time.time()))
    invocation = make("doomed")
    async with consuming(engine, worker):
        await engine.submit(invocation)
        await wait_for(lambda: worker.finished == 1, "the run")
        await until(lambda: _is(engine, invocation.id, DEAD), "the end")
    client = await nats.connect(engine.url)
    try:
        js = client.jetstream()
        letter = await js.get_last_msg("SLESS_DEAD", f"sless.dead.prod.doomed.{invocation.id}")
        assert json.loads(letter.data)["status"] == DEAD
        assert await engine.redrive_dead("prod", "doomed") == 1
        state = (await js.stream_info("SLESS_DEAD")).state
        assert state.messages == 0
    finally:
        await client.close()
    assert await status_of(engine, invocation.id) == QUEUED


async def test_a_work_message_whose_record_never_came_is_dropped(engines, monkeypatch):
    engine = engines[0]
    monkeypatch.setattr(natsconsume, "RECORD_GRACE_SEC", 0.3)
    client = await nats.connect(engine.url)
    try:
        js = client.jetstream()
        # what a submit leaves when its record could not be written (and it said 503)
        await js.publish("sless.inv.prod.ghost", b'{"id": "nosuchrecord", "round": 0}')
        worker = FakeWorker()
        async with consuming(engine, worker):

            async def drained() -> bool:
                return (await js.stream_info("SLESS_INVOCATIONS")).state.messages == 0

            await until(drained, "the message dropped")
        assert worker.runs == []
    finally:
        await client.close()


async def test_a_response_too_long_for_the_server_is_stored_cut(engines):
    engine = engines[0]
    long = b"x" * 900_000  # over 1 MB in the record (base64): the server's max_payload

    def answer(inv: Invocation) -> Invocation:
        response = Response(200, (), long)
        return inv.evolve(status=SUCCEEDED, ended=time.time(), response=response)

    worker = FakeWorker(answer=answer)
    invocation = make()
    async with consuming(engine, worker):
        await engine.submit(invocation)
        await until(lambda: _is(engine, invocation.id, SUCCEEDED), "the end")
    stored = await engine.get(invocation.id)
    assert stored is not None and stored.response is not None
    assert stored.response.truncated
    assert 0 < len(stored.response.body) < len(long) and long.startswith(stored.response.body)


async def test_a_consumer_deleted_under_a_running_engine_is_made_again(engines):
    engine = engines[0]
    worker = FakeWorker()
    async with consuming(engine, worker):
        await engine.submit(make())
        await wait_for(lambda: worker.finished == 1, "the first run")
        client = await nats.connect(engine.url)
        try:  # an operator's mistake, or a server that lost its store
            await client.jetstream().delete_consumer("SLESS_INVOCATIONS", "inv_prod_hello")
        finally:
            await client.close()
        await engine.submit(make())
        await until(lambda: _async(worker.finished == 2), "the run after it")


async def _async(value: bool) -> bool:
    return value


async def test_a_dropped_subscription_takes_no_more_events(engines):
    engine = engines[0]
    worker = FakeWorker()
    async with consuming(engine, worker):
        engine.set_subscriptions({("prod", "a"): frozenset({"orders.created", "orders.paid"})})
        await engine.publish("prod", "orders.created", b"1", (), None)
        await wait_for(lambda: worker.finished == 1, "the first run")
        engine.set_subscriptions({("prod", "a"): frozenset({"orders.paid"})})
        await engine.publish("prod", "orders.created", b"2", (), None)  # no one takes it
        await engine.publish("prod", "orders.paid", b"3", (), None)
        await wait_for(lambda: worker.finished == 2, "the second run")
        await asyncio.sleep(0.1)  # room for a wrong third one to show
    assert sorted(inv.body for inv in worker.runs) == [b"1", b"3"]
    client = await nats.connect(engine.url)
    try:
        info = await client.jetstream().stream_info("SLESS_EVENTS")
        assert sorted(info.config.subjects) == ["orders.paid", "sless.events.>"]
        assert len(await client.jetstream().consumers_info("SLESS_EVENTS")) == 1
    finally:
        await client.close()


async def test_a_second_message_for_a_running_invocation_does_not_run_it_again(engines):
    engine = engines[0]
    worker = FakeWorker()
    worker.hold.clear()
    invocation = make()
    async with consuming(engine, worker):
        await engine.submit(invocation)
        await wait_for(lambda: worker.at_once["hello"] == 1, "the run")
        client = await nats.connect(engine.url)
        try:  # a duplicate, as a retried schedule or an ack lost in a crash may leave
            body = json.dumps({"id": invocation.id, "round": 0}).encode()
            await client.jetstream().publish("sless.inv.prod.hello", body)
        finally:
            await client.close()
        await asyncio.sleep(0.2)  # room for it to be delivered and (wrongly) run
        worker.hold.set()
        await until(lambda: _is(engine, invocation.id, SUCCEEDED), "the end")
        await asyncio.sleep(0.1)
    assert len(worker.runs) == 1


async def test_a_listing_of_queued_ones_does_not_chase_a_queue_being_worked_through(
    engines, monkeypatch
):
    """A runner that takes queued invocations faster than a listing reads records: the
    listing reads no record its index already shows taken (before, ``?status=queued
    &limit=1`` read every record the queue had passed, one at a time: seconds under
    load, bench/async.py), and finds one still queued."""
    engine = engines[0]
    submitted = [make() for _ in range(31)]
    for invocation in submitted:
        await engine.submit(invocation)
    store = engine._store
    read = store.read
    reads: list[str] = []

    async def runner_ahead(invocation_id: str):  # type: ignore[no-untyped-def]
        reads.append(invocation_id)
        # meanwhile the runner takes ten more of the first 30 (written as a run does)
        for inv in sorted(submitted, key=lambda i: i.id)[: min(len(reads) * 10, 30)]:
            got = await read(inv.id)
            if got is not None and got[0].status == QUEUED:
                await store.write(got[0].evolve(status=RUNNING), expect=got[1])
        return await read(invocation_id)

    monkeypatch.setattr(store, "read", runner_ahead)
    found = await engine.list(Filter(function="hello", status=QUEUED, limit=1))
    last = max(submitted, key=lambda i: i.id)
    assert [inv.id for inv in found] == [last.id]  # the one the runner has not reached
    assert len(reads) == 4  # the 1st, 11th, 21st and 31st: before, all 31
