"""What an attempt's outcome means: retries with backoff, final 4xx, dead letters, maxAge,
Retry-After, and the request as the function receives it through the real proxy."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gitops_sless.invocations.model import Callback, Invocation
from gitops_sless.invocations.worker import Answer, ProxyCaller, Runner, retry_after
from gitops_sless.manifests.model import AsyncPolicy
from gitops_sless.proxy.app import ProxyApp
from gitops_sless.state.routes import Declared, Route, RouteTable


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Script:
    """A caller that answers from a list, and keeps what it was asked."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.calls: list[Invocation] = []

    async def __call__(self, invocation: Invocation) -> Answer:
        self.calls.append(invocation)
        return self.answers.pop(0)


def table(policy: AsyncPolicy) -> RouteTable:
    routes = RouteTable()
    routes.declare("prod", {"orders": Declared("Ready", async_policy=policy)})
    routes.set(Route("prod", "orders", 30.0, (("127.0.0.1", 1),)))
    return routes


def invocation(created: float, **changes: Any) -> Invocation:
    inv = Invocation("id1", "prod", "orders", "POST", "/", (), b"{}", created)
    return inv.evolve(**changes)


async def run_until_ended(
    runner: Runner, inv: Invocation, clock: Clock
) -> tuple[Invocation, list[Invocation]]:
    """Run attempts as an engine would: each when due, the clock moved to it."""
    saved: list[Invocation] = []

    async def save(current: Invocation) -> None:
        saved.append(current)

    while True:
        clock.now = max(clock.now, inv.next_at)
        inv = await runner.run(inv, save)
        if inv.status != "queued":
            return inv, saved


def test_a_5xx_is_retried_with_doubling_backoff_then_dead() -> None:
    clock = Clock()
    policy = AsyncPolicy(retries=3, backoff_sec=2.0, max_backoff_sec=5.0)
    script = Script(*[Answer(500, body=b"boom")] * 4)
    runner = Runner(table(policy), script, clock=clock, jitter=lambda: 0.0)
    delays: list[float] = []
    inv = invocation(clock.now)

    async def save(_: Invocation) -> None:
        pass

    async def go() -> Invocation:
        current = inv
        while True:
            clock.now = max(clock.now, current.next_at)
            before = clock.now
            current = await runner.run(current, save)
            if current.status != "queued":
                return current
            delays.append(current.next_at - before)

    ended = asyncio.run(go())
    assert delays == [2.0, 4.0, 5.0]  # doubled, capped at maxBackoff
    assert ended.status == "dead"
    assert len(ended.attempts) == 4
    assert ended.error == "HTTP 500: boom (after 4 attempts: retries spent)"
    assert [a.status_code for a in ended.attempts] == [500] * 4
    assert ended.response is not None and ended.response.body == b"boom"


def test_jitter_adds_at_most_a_fifth() -> None:
    clock = Clock()
    runner = Runner(
        table(AsyncPolicy(backoff_sec=10.0)),
        Script(Answer(503)),
        clock=clock,
        jitter=lambda: 1.0,
    )

    async def save(_: Invocation) -> None:
        pass

    after = asyncio.run(runner.run(invocation(clock.now), save))
    assert after.status == "queued"
    assert after.next_at - clock.now == pytest.approx(12.0)


def test_a_4xx_is_final_and_429_is_not() -> None:
    clock = Clock()
    runner = Runner(table(AsyncPolicy()), Script(Answer(404, body=b"no such order")), clock=clock)
    ended, _ = asyncio.run(run_until_ended(runner, invocation(clock.now), clock))
    assert ended.status == "failed"
    assert ended.error == "HTTP 404: no such order"
    assert len(ended.attempts) == 1

    runner = Runner(table(AsyncPolicy()), Script(Answer(429), Answer(200, body=b"ok")), clock=clock)
    ended, _ = asyncio.run(run_until_ended(runner, invocation(clock.now), clock))
    assert ended.status == "succeeded"
    assert [a.status_code for a in ended.attempts] == [429, 200]


def test_no_answer_at_all_is_retried() -> None:
    clock = Clock()
    script = Script(Answer(None, error="connection refused"), Answer(201))
    runner = Runner(table(AsyncPolicy()), script, clock=clock)
    ended, saved = asyncio.run(run_until_ended(runner, invocation(clock.now), clock))
    assert ended.status == "succeeded"
    assert ended.attempts[0].error == "connection refused"
    # saved as running, with the new attempt, before each call
    assert [s.status for s in saved] == ["running", "running"]
    assert [len(s.attempts) for s in saved] == [1, 2]


def test_retry_after_from_the_function_is_honoured() -> None:
    clock = Clock()
    script = Script(Answer(503, headers=(("Retry-After", "120"),)), Answer(200))
    runner = Runner(table(AsyncPolicy(backoff_sec=1.0)), script, clock=clock, jitter=lambda: 0)

    async def save(_: Invocation) -> None:
        pass

    after = asyncio.run(runner.run(invocation(clock.now), save))
    assert after.next_at - clock.now == 120.0
    assert retry_after((("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT"),), 1445412480.0) == 0.0


def test_an_invocation_older_than_max_age_dies_without_an_attempt() -> None:
    clock = Clock()
    script = Script()
    runner = Runner(table(AsyncPolicy(max_age_sec=60.0)), script, clock=clock)
    ended, saved = asyncio.run(run_until_ended(runner, invocation(clock.now - 61), clock))
    assert ended.status == "dead"
    assert ended.attempts == ()
    assert ended.error == "older than maxAge 1m: no attempt started"
    assert script.calls == [] and saved == []


def test_a_retry_that_would_start_after_max_age_is_dead_now() -> None:
    clock = Clock()
    script = Script(Answer(500))
    policy = AsyncPolicy(retries=5, backoff_sec=100.0, max_age_sec=60.0)
    runner = Runner(table(policy), script, clock=clock, jitter=lambda: 0)
    ended, _ = asyncio.run(run_until_ended(runner, invocation(clock.now), clock))
    assert ended.status == "dead"
    assert "would pass maxAge 1m" in (ended.error or "")


def test_interrupted_attempts_do_not_spend_retries() -> None:
    from gitops_sless.invocations.model import Attempt

    clock = Clock()
    cut = Attempt(1, clock.now - 5, clock.now - 4, None, "interrupted", counted=False)
    runner = Runner(table(AsyncPolicy(retries=0)), Script(Answer(200)), clock=clock)
    ended, _ = asyncio.run(run_until_ended(runner, invocation(clock.now, attempts=(cut,)), clock))
    assert ended.status == "succeeded"
    assert [a.number for a in ended.attempts] == [1, 2]


def test_an_ended_invocation_has_its_callback_pending() -> None:
    clock = Clock()
    runner = Runner(table(AsyncPolicy()), Script(Answer(200)), clock=clock)
    inv = invocation(clock.now, callback=Callback("https://example.com/done"))
    ended, _ = asyncio.run(run_until_ended(runner, inv, clock))
    assert ended.callback is not None
    assert ended.callback.state == "pending"


# -- through the real proxy, to a real function server


class Echo(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        reply = json.dumps(
            {"path": self.path, "headers": dict(self.headers.items()), "body": body.decode()}
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_function_gets_the_request_as_a_synchronous_call_with_the_invocation_headers() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        routes = RouteTable()
        routes.declare("prod", {"orders": Declared("Ready")})
        routes.set(Route("prod", "orders", 10.0, (server.server_address[:2],)))
        proxy = ProxyApp(routes)
        inv = Invocation(
            "01abc",
            "prod",
            "orders",
            "POST",
            "/new/one?x=1&y=%20",
            (("content-type", "text/plain"), ("x-custom", "kept"), ("content-length", "5")),
            b"hello",
            1.0,
            client="203.0.113.9",
        ).evolve(attempts=(), status="running")
        from gitops_sless.invocations.model import Attempt

        inv = inv.evolve(attempts=(Attempt(1, 1.0), Attempt(2, 2.0)))

        async def go() -> Answer:
            try:
                return await ProxyCaller(proxy)(inv)
            finally:
                await proxy.aclose()

        answer = asyncio.run(go())
    finally:
        server.shutdown()
        server.server_close()
    assert answer.status_code == 200
    seen = json.loads(answer.body)
    assert seen["path"] == "/new/one?x=1&y=%20"
    assert seen["body"] == "hello"
    headers = {k.lower(): v for k, v in seen["headers"].items()}
    assert headers["x-custom"] == "kept"
    assert headers["x-invocation-id"] == "01abc"
    assert headers["x-invocation-attempt"] == "2"
    assert headers["x-forwarded-for"] == "203.0.113.9"


def test_a_redrive_counts_max_age_anew() -> None:
    clock = Clock()
    runner = Runner(table(AsyncPolicy(max_age_sec=60.0)), Script(Answer(200)), clock=clock)
    dead = invocation(clock.now - 3600, status="dead", ended=clock.now - 3000)
    ended, _ = asyncio.run(run_until_ended(runner, dead.redriven(clock.now), clock))
    assert ended.status == "succeeded"


def test_a_function_on_its_way_is_waited_for_without_spending_an_attempt() -> None:
    clock = Clock()
    routes = RouteTable()  # a restart before its first pass: nothing declared yet
    script = Script()
    runner = Runner(routes, script, clock=clock)

    async def save(_: Invocation) -> None:
        pass

    after = asyncio.run(runner.run(invocation(clock.now), save))
    assert (after.status, after.attempts, script.calls) == ("queued", (), [])
    assert after.next_at > clock.now

    routes.declare("prod", {"orders": Declared("Building")})
    after = asyncio.run(runner.run(invocation(clock.now), save))
    assert (after.status, after.attempts) == ("queued", ())

    routes.declare("prod", {"orders": Declared("Failed", "build failed")})
    script.answers.append(Answer(503, body=b'{"error": "function not ready"}'))  # the proxy's
    after = asyncio.run(runner.run(invocation(clock.now), save))
    assert len(after.attempts) == 1 and after.error == "HTTP 503: function not ready"
