"""The activator: calls held while a function at zero starts, limits that answer 429 and 413.

The proxy runs as in test_proxy.py (fast, asgi and h11); the "backend" here is
the test: its ``wake`` hook publishes a route with an upstream (a small socket
server) as a backend does when a replica is healthy, or a failed start.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from gitops_sless.manifests.model import RateLimit, Scale
from gitops_sless.metrics import METRICS
from gitops_sless.state.routes import Route

from .test_proxy import MAX_BODY, Fake, Fakes, ProxyServer, answer

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Sless-Cold-Start: 1\r\n\r\nok"
SCALE = Scale(0, 3, idle_sec=60)


class Backend:
    """What the proxy's wake hook reaches: starts (publishes) a replica after ``delay``."""

    def __init__(self) -> None:
        self.proxy: ProxyServer | None = None
        self.wakes: list[tuple[str, str]] = []
        self.upstream: tuple[str, int] | None = None
        self.delay = 0.2
        self.failure: str | None = None  # publish this failure instead of a replica

    def wake(self, env: str, name: str) -> None:
        self.wakes.append((env, name))
        assert self.proxy is not None
        routes = self.proxy.routes

        def start() -> None:
            time.sleep(self.delay)
            route = routes.get(env, name)
            if route is None:
                return
            if self.failure is not None:
                failed = Route(
                    env,
                    name,
                    route.timeout_sec,
                    (),
                    scale=route.scale,
                    failed=self.failure,
                    retry_at=time.monotonic() + 60,
                )
                routes.set(failed)
            elif self.upstream is not None:
                routes.set(Route(env, name, route.timeout_sec, (self.upstream,), scale=route.scale))

        threading.Thread(target=start, daemon=True).start()


@pytest.fixture(scope="module")
def fakes() -> Iterator[Fakes]:
    fakes = Fakes()
    yield fakes
    fakes.close()


@pytest.fixture(scope="module")
def ok(fakes: Fakes) -> Fake:
    return fakes.start(answer(OK))


@pytest.fixture(scope="module", params=list(ProxyServer.MODES))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[ProxyServer, Backend]]:
    backend = Backend()
    server = ProxyServer(request.param, wake=backend.wake)
    backend.proxy = server
    yield server, backend
    server.stop()


@pytest.fixture
def proxy(served: tuple[ProxyServer, Backend], ok: Fake) -> ProxyServer:
    server, backend = served
    backend.wakes.clear()
    backend.failure = None
    backend.delay = 0.2
    backend.upstream = ("127.0.0.1", ok.port)
    return server


@pytest.fixture
def backend(served: tuple[ProxyServer, Backend]) -> Backend:
    return served[1]


_names = iter(range(1_000_000))


@pytest.fixture
def function(proxy: ProxyServer) -> Iterator[Callable[..., str]]:
    """``function(*upstreams, timeout=5, **route fields) -> name``: a route of this test's."""
    added: list[str] = []

    def add(*upstreams: tuple[str, int], timeout: float = 5, **fields) -> str:
        name = f"fn-{next(_names)}"
        proxy.routes.set(Route("prod", name, timeout, tuple(upstreams), **fields))
        added.append(name)
        return name

    yield add
    for name in added:
        proxy.routes.remove("prod", name)


def _cold_starts(env: str, name: str, phase: str) -> int:
    for labels, (counts, _) in METRICS.cold_start.series.items():
        if dict(labels) == {"env": env, "function": name, "phase": phase, "runtime": ""}:
            return sum(counts)
    return 0


def test_a_call_to_a_function_at_zero_waits_for_its_start_and_says_what_it_cost(
    proxy, backend, function
):
    name = function(scale=SCALE)
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    assert reply.status == 200, reply.body
    assert reply.body == b"ok"
    assert backend.wakes == [("prod", name)]
    waited = int(reply.headers["x-sless-cold-start"])  # the upstream's own value is dropped
    assert waited >= backend.delay * 1000 * 0.9
    assert reply.headers.get_all("x-sless-cold-start") == [str(waited)]
    assert _cold_starts("prod", name, "total") == 1
    assert _cold_starts("prod", name, "answer") == 1
    load = proxy.routes.get("prod", name).load
    assert [round(c.waited_ms) for c in load.cold_starts] == [waited]
    # warm now: the next call neither waits nor says so
    again = proxy.request("GET", f"/fn/prod/{name}/")
    assert again.status == 200
    assert "x-sless-cold-start" not in again.headers
    assert backend.wakes == [("prod", name)]


def test_fifty_first_calls_all_wait_for_one_start(proxy, backend, function):
    name = function(scale=SCALE)
    # long enough that all 50 are in before the replica is, on a loaded machine too (at
    # 0.5 s a few came in after it and, rightly, were not cold starts)
    backend.delay = 3.0
    with ThreadPoolExecutor(50) as pool:
        replies = list(pool.map(lambda _: proxy.request("GET", f"/fn/prod/{name}/"), range(50)))
    assert [r.status for r in replies] == [200] * 50
    assert all("x-sless-cold-start" in r.headers for r in replies)
    assert len(backend.wakes) == 1  # one start asked for, whatever the number waiting


def test_a_start_that_does_not_come_in_time_is_504_naming_it(proxy, backend, function):
    name = function(timeout=1, scale=SCALE)
    backend.upstream = None  # the start never completes
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    assert reply.status == 504
    assert "did not start within 1s" in json.loads(reply.body)["error"]
    assert proxy.routes.get("prod", name).load.waiting == 0


def test_a_failed_start_is_502_with_its_cause_and_no_new_start_while_it_backs_off(
    proxy, backend, function
):
    name = function(scale=SCALE)
    backend.failure = "the runtime ended before it was healthy: ImportError: no module 'x'"
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    assert reply.status == 502
    error = json.loads(reply.body)["error"]
    assert error == f"function failed to start: {backend.failure}"
    again = proxy.request("GET", f"/fn/prod/{name}/")  # within the backoff: at once
    assert again.status == 502
    assert len(backend.wakes) == 1


def test_a_function_with_a_fixed_count_and_no_replica_is_still_503(proxy, backend, function):
    name = function()
    reply = proxy.request("GET", f"/fn/prod/{name}/")
    assert reply.status == 503
    assert backend.wakes == []


def test_calls_past_the_rate_limit_get_429_with_retry_after(proxy, ok, function):
    name = function(("127.0.0.1", ok.port), rate_limit=RateLimit(0.5, 2))
    statuses = [proxy.request("GET", f"/fn/prod/{name}/") for _ in range(3)]
    assert [r.status for r in statuses] == [200, 200, 429]
    refused = statuses[2]
    assert refused.headers["retry-after"] == "2"  # one token every 2 s
    assert "rate limit" in json.loads(refused.body)["error"]
    assert proxy.recorded(refused).status == 429


def test_a_body_over_the_function_limit_is_413_before_it_reaches_the_function(
    proxy, fakes, function
):
    seen = fakes.start(answer(OK))
    name = function(("127.0.0.1", seen.port), max_body_bytes=10)
    reply = proxy.request("POST", f"/fn/prod/{name}/", body=b"x" * 11)
    assert reply.status == 413
    assert json.loads(reply.body)["error"] == "request body larger than 10 bytes"
    assert seen.requests == []
    fits = proxy.request("POST", f"/fn/prod/{name}/", body=b"x" * 10)
    assert fits.status == 200
    # the proxy's own limit stays the ceiling
    wide = function(("127.0.0.1", seen.port), max_body_bytes=MAX_BODY * 4)
    over = proxy.request("POST", f"/fn/prod/{wide}/", body=b"x" * (MAX_BODY + 1))
    assert over.status == 413


def _held(release: threading.Event) -> Callable:
    """An upstream that answers each call once ``release`` is set."""

    async def handler(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        await reader.readuntil(b"\r\n\r\n")
        fake.requests.append(b"")
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 10)
        writer.write(OK)
        await writer.drain()

    return handler


def test_concurrency_holds_extra_calls_in_order_and_refuses_past_the_queue(proxy, fakes, function):
    release = threading.Event()
    slow = fakes.start(_held(release))
    name = function(("127.0.0.1", slow.port), concurrency=1)
    load = proxy.routes.get("prod", name).load
    with ThreadPoolExecutor(12) as pool:
        first = pool.submit(proxy.request, "GET", f"/fn/prod/{name}/")
        _wait(lambda: len(slow.requests) == 1)
        waiting = [pool.submit(proxy.request, "GET", f"/fn/prod/{name}/") for _ in range(10)]
        _wait(lambda: load.waiting == 10)
        assert len(slow.requests) == 1  # one slot: the others wait in the proxy
        refused = proxy.request("GET", f"/fn/prod/{name}/")  # the queue holds 10 per slot
        assert refused.status == 429
        assert refused.headers["retry-after"] == "1"
        release.set()
        assert first.result().status == 200
        assert [f.result().status for f in waiting] == [200] * 10
    assert load.inflight == 0 and load.waiting == 0


def _wait(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
