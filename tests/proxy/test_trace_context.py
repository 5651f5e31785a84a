"""W3C Trace Context through ``/fn/`` (issue 31): a caller's valid ``traceparent`` (and
its ``tracestate``) reach the function as sent; without one, or with one that is not
valid, the proxy starts a trace (its id the request id the proxy made), and a
``tracestate`` that came with an invalid one is dropped. On both request paths."""

from __future__ import annotations

import re

import pytest

from .test_proxy import proxy, route, runtime  # noqa: F401 - fixtures

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
STARTED = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")


def received(proxy, route, runtime, headers: dict[str, str]) -> tuple[dict[str, str], dict]:  # noqa: F811
    name = route(runtime)
    reply = proxy.request("GET", f"/fn/prod/{name}/t", headers=headers)
    assert reply.status == 200, reply.body
    return reply.headers, reply.json()["event"]["_headers"]


def test_a_valid_trace_context_reaches_the_function_as_sent(proxy, route, runtime):  # noqa: F811
    sent = {"traceparent": PARENT, "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"}
    _, got = received(proxy, route, runtime, sent)
    assert got["traceparent"] == PARENT
    assert got["tracestate"] == sent["tracestate"]


def test_a_later_version_is_carried_on_as_sent(proxy, route, runtime):  # noqa: F811
    later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-adds"
    _, got = received(proxy, route, runtime, {"traceparent": later})
    assert got["traceparent"] == later


def test_a_call_without_a_trace_starts_one_named_by_its_request_id(proxy, route, runtime):  # noqa: F811
    answer, got = received(proxy, route, runtime, {})
    started = STARTED.fullmatch(got["traceparent"])
    assert started is not None, got["traceparent"]
    assert started.group(1) == answer["x-request-id"] == got["x-request-id"]
    assert started.group(2) != "0" * 16
    # two calls, two traces
    _, again = received(proxy, route, runtime, {})
    assert again["traceparent"][3:35] != started.group(1)


def test_a_callers_own_request_id_gets_a_trace_id_of_its_own(proxy, route, runtime):  # noqa: F811
    answer, got = received(proxy, route, runtime, {"X-Request-Id": "order-4711"})
    assert answer["x-request-id"] == "order-4711"
    started = STARTED.fullmatch(got["traceparent"])
    assert started is not None and started.group(1) != "0" * 32


@pytest.mark.parametrize(
    "traceparent",
    [
        "garbage",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
    ],
)
def test_an_invalid_trace_is_replaced_and_its_state_dropped(proxy, route, runtime, traceparent):  # noqa: F811
    _, got = received(proxy, route, runtime, {"traceparent": traceparent, "tracestate": "a=b"})
    started = STARTED.fullmatch(got["traceparent"])
    assert started is not None and started.group(1) != "4bf92f3577b34da6a3ce929d0e0e4736"
    assert "tracestate" not in got
