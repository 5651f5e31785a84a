"""The SQLite engine's own promises: a kill -9 loses nothing ``submit`` returned, and an
attempt cut by a kill runs again on the next start; the queue sleeps when idle.

Run as a program it measures submits (not a test: figures depend on the machine):
``.venv/bin/python -m tests.invocations.test_sqlite_engine [folder]``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gitops_sless.invocations.engine import EngineUnavailable, Save
from gitops_sless.invocations.model import QUEUED, RUNNING, SUCCEEDED, Invocation, new_id
from gitops_sless.invocations.sqlite import INTERRUPTED, SqliteEngine

from .test_engine_contract import FakeWorker, consuming, make, until_stored, wait_for

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_SEC = 20.0

# submits from 16 tasks without end, printing each id once submit returned; after
# 300 it kills itself with writes still on the way to the disk
SUBMITTER = """
import asyncio, os, sys, time
from pathlib import Path
from gitops_sless.invocations.model import Invocation, new_id
from gitops_sless.invocations.sqlite import SqliteEngine

async def main():
    engine = SqliteEngine(Path(sys.argv[1]))
    await engine.start()
    printed = 0

    async def submitter(n):
        nonlocal printed
        while True:
            inv = Invocation(new_id(), "prod", "f%d" % n, "POST", "/", (), b"x", time.time())
            await engine.submit(inv)
            print(inv.id, flush=True)
            printed += 1
            if printed == 300:
                os.kill(os.getpid(), 9)

    await asyncio.gather(*(submitter(n) for n in range(16)))

asyncio.run(main())
"""

# consumes with a worker that saves the attempt running, says so, and hangs there
HANGER = """
import asyncio, sys, time
from pathlib import Path
from gitops_sless.invocations.model import Attempt
from gitops_sless.invocations.sqlite import SqliteEngine

class Hanger:
    def concurrency(self, env, function):
        return 1

    def timeout(self, env, function):
        return 30.0

    async def run(self, inv, save):
        attempt = Attempt(inv.attempt + 1, time.time())
        await save(inv.evolve(status="running", attempts=(*inv.attempts, attempt)))
        print("running", inv.id, flush=True)
        await asyncio.Event().wait()

async def main():
    engine = SqliteEngine(Path(sys.argv[1]))
    await engine.start()
    await engine.consume(Hanger())

asyncio.run(main())
"""


def child(code: str, db: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), str(db)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )


async def test_a_kill_right_after_submit_returned_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "invocations.db"
    proc = child(SUBMITTER, db)
    out, _ = await asyncio.to_thread(proc.communicate, timeout=CHILD_TIMEOUT_SEC)
    assert proc.returncode == -signal.SIGKILL
    printed = out.split()
    assert len(printed) >= 300
    with sqlite3.connect(db) as found:
        stored = {row[0] for row in found.execute("SELECT id FROM invocations")}
    assert set(printed) <= stored
    engine = SqliteEngine(db)
    await engine.start()
    try:
        one = await engine.get(printed[-1])
        assert one is not None and (one.status, one.body) == (QUEUED, b"x")
    finally:
        await engine.close()


async def test_an_attempt_cut_by_a_kill_runs_again_on_the_next_start(tmp_path: Path) -> None:
    db = tmp_path / "invocations.db"
    engine = SqliteEngine(db)
    await engine.start()
    invocation = make()
    await engine.submit(invocation)
    await engine.close()
    proc = child(HANGER, db)
    try:
        line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
        assert line.split() == ["running", invocation.id]
    finally:
        proc.kill()
        await asyncio.to_thread(proc.communicate)
    engine = SqliteEngine(db)
    await engine.start()
    try:
        again = await engine.get(invocation.id)
        assert again is not None and again.status == QUEUED
        assert again.next_at <= time.time()
        (cut,) = again.attempts
        assert (cut.error, cut.counted) == (INTERRUPTED, False)
        assert cut.ended is not None and again.failures == 0
        worker = FakeWorker()
        async with consuming(engine, worker):
            await wait_for(lambda: worker.finished == 1, "the run after the restart")
            await until_stored(engine, [invocation.id], SUCCEEDED)
        done = await engine.get(invocation.id)
        assert done is not None and done.status == SUCCEEDED
        assert [(a.number, a.counted) for a in done.attempts] == [(1, False), (2, True)]
    finally:
        await engine.close()


@pytest.fixture
async def engine(tmp_path: Path, anyio_backend: str) -> AsyncIterator[SqliteEngine]:
    """This module's engine: SQLite only, with a short retention."""
    made = SqliteEngine(tmp_path / "invocations.db", retention_sec=0.2)
    await made.start()
    yield made
    await made.close()


async def test_a_worker_that_raises_loses_nothing(engine: SqliteEngine) -> None:
    class Broken(FakeWorker):
        async def run(self, invocation: Invocation, save: Save) -> Invocation:
            await super().run(invocation, save)
            raise RuntimeError("a bug")

    worker = Broken()
    invocation = make()
    async with consuming(engine, worker):
        await engine.submit(invocation)
        await wait_for(lambda: worker.finished == 1, "the run")
        await wait_for(lambda: not engine._inflight, "its outcome stored")
        stored = await engine.get(invocation.id)
    assert stored is not None and stored.status == QUEUED
    (attempt,) = stored.attempts
    assert attempt.error == "the worker failed: a bug" and attempt.ended is not None
    assert stored.next_at == pytest.approx(attempt.ended + 1.0)
    assert len(worker.runs) == 1  # not again before its next_at


async def test_an_idle_queue_sleeps(engine: SqliteEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    passes = 0
    dispatch = engine._dispatch

    async def counted(*args: object) -> float | None:
        nonlocal passes
        passes += 1
        return await dispatch(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "_dispatch", counted)
    later = make(next_at=time.time() + 3600)
    await engine.submit(later)
    async with consuming(engine, FakeWorker()):
        await asyncio.sleep(0.3)
    assert passes <= 2  # the first pass, and the submit's wake-up if it came after


async def test_a_key_past_the_retention_makes_a_new_invocation(engine: SqliteEngine) -> None:
    first, _ = await engine.submit(make(key="k"))
    assert (await engine.submit(make(key="k")))[1] is False
    await asyncio.sleep(0.25)  # the fixture's retention is 0.2 s
    second, created = await engine.submit(make(key="k"))
    assert created and second.id != first.id
    assert (await engine.submit(make(key="k")))[0] == second
    assert await engine.get(first.id) == first  # the record stays until collected


async def test_a_database_from_a_newer_release_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "invocations.db"
    with sqlite3.connect(db) as newer:
        newer.execute("PRAGMA user_version = 99")
    with pytest.raises(EngineUnavailable, match="newer"):
        await SqliteEngine(db).start()


async def test_a_closed_engine_refuses_work(engine: SqliteEngine) -> None:
    await engine.close()
    await engine.close()  # idempotent
    with pytest.raises(EngineUnavailable):
        await engine.submit(make())
    with pytest.raises(EngineUnavailable):
        await engine.get(new_id())


async def test_closing_stops_the_consumer_and_its_runs(engine: SqliteEngine) -> None:
    worker = FakeWorker()
    worker.hold.clear()
    invocation = make()
    await engine.submit(invocation)
    consumer = asyncio.create_task(engine.consume(worker))
    await wait_for(lambda: worker.at_once["hello"] == 1, "the run")
    await engine.close()
    await asyncio.wait_for(consumer, 5)
    assert worker.at_once["hello"] == 0
    reopened = SqliteEngine(engine.path)
    await reopened.start()  # the cut attempt comes back queued
    try:
        assert (await reopened.get(invocation.id) or invocation).status == QUEUED
    finally:
        await reopened.close()


# -- by hand: submits per second


async def _measure(folder: Path, tasks: int = 16, each: int = 2000) -> None:
    engine = SqliteEngine(folder / "invocations.db")
    await engine.start()
    latencies: list[float] = []

    async def submitter(n: int) -> None:
        for _ in range(each):
            inv = Invocation(new_id(), "prod", f"f{n}", "POST", "/", (), b"{}", time.time())
            began = time.perf_counter()
            await engine.submit(inv)
            latencies.append(time.perf_counter() - began)

    began = time.perf_counter()
    await asyncio.gather(*(submitter(n) for n in range(tasks)))
    took = time.perf_counter() - began
    await engine.close()
    latencies.sort()
    total = tasks * each

    def at(q: float) -> float:
        return latencies[int(q * (total - 1))] * 1000

    print(
        f"{tasks} submitters x {each}: {total / took:,.0f} submits/s,"
        f" p50 {at(0.5):.2f} ms, p99 {at(0.99):.2f} ms, max {latencies[-1] * 1000:.2f} ms"
    )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(_measure(Path(sys.argv[1])))
    else:
        with tempfile.TemporaryDirectory(dir=ROOT) as scratch:  # on the disk, not tmpfs
            asyncio.run(_measure(Path(scratch)))


class Gated(FakeWorker):
    """Each run, once stored running, waits for its own gate (all of them once
    ``released``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.gates: dict[str, asyncio.Event] = {}
        self.released = False

    async def run(self, invocation: Invocation, save: Save) -> Invocation:
        gate = self.gates[invocation.id] = asyncio.Event()
        if self.released:
            gate.set()

        async def saved_then_gated(record: Invocation) -> None:
            await save(record)
            if record.status == RUNNING:
                await gate.wait()

        return await super().run(invocation, saved_then_gated)

    def release(self) -> None:
        self.released = True
        for gate in self.gates.values():
            gate.set()


async def test_due_invocations_past_the_free_slots_run_when_slots_free(
    engine: SqliteEngine,
) -> None:
    """Two queued while all three slots are taken; one slot frees: one of the two
    starts, and the other must when the rest free (before, the consumer forgot the
    function's due time once it had read fewer rows than slots and busy runs: the
    second stayed queued until some other submission of that function; bench/async.py
    saw 3 to 8 stranded after a kill -9)."""
    worker = Gated(limit=3)
    first = [make() for _ in range(3)]
    for inv in first:
        await engine.submit(inv)
    async with consuming(engine, worker):
        await wait_for(lambda: len(worker.gates) == 3, "three runs")
        await until_stored(engine, [inv.id for inv in first], RUNNING)
        more = [make() for _ in range(2)]
        for inv in more:
            await engine.submit(inv)
        await asyncio.sleep(0.2)  # no free slot: nothing more starts
        assert len(worker.gates) == 3
        worker.gates[first[0].id].set()
        await wait_for(lambda: len(worker.gates) == 4, "a fourth run in the freed slot")
        worker.release()
        await until_stored(engine, [inv.id for inv in first + more], SUCCEEDED)
