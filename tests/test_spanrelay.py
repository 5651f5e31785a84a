"""The relay of the local runtimes' spans (``gitops_sless.telemetry.relay``) from the
sender's side: whatever a function posts, the reconciler answers 400 for what is not
OTLP JSON spans it can export (never an exception of its own), exports nothing of a
post it refuses, and a function cannot say it is another."""

from __future__ import annotations

import json

import pytest

from gitops_sless import telemetry
from gitops_sless.telemetry import relay

SPAN = {
    "traceId": "4bf92f3577b34da6a3ce929d0e0e4736",
    "spanId": "00f067aa0ba902b7",
    "startTimeUnixNano": "1",
    "endTimeUnixNano": "2",
}


def body(*spans: dict, **extra: object) -> bytes:
    return json.dumps(
        {"resourceSpans": [{"scopeSpans": [{"spans": list(spans)}]}], **extra}
    ).encode()


@pytest.fixture
def recorded(monkeypatch) -> list[tuple]:
    found: list[tuple] = []
    monkeypatch.setattr(relay, "record", lambda *a, **k: found.append((a, k)))
    return found


@pytest.mark.parametrize(
    "sent",
    [
        b"[" * 200_000,  # nested past the parser's recursion
        b"not json",
        body(dict(SPAN, startTimeUnixNano="-1")),
        body(dict(SPAN, endTimeUnixNano=str(1 << 64))),
        body(dict(SPAN, attributes=[{"key": "n", "value": {"intValue": str(1 << 70)}}])),
        body(dict(SPAN, attributes=[{"key": "n", "value": {"intValue": "x"}}])),
        body(dict(SPAN, attributes=[{"key": "n", "value": {"intValue": 1e400}}])),
        body(dict(SPAN, status=[1])),
        body(dict(SPAN, traceId="4BF92F3577B34DA6A3CE929D0E0E4736")),
        body(dict(SPAN, spanId=7)),
        body(*[SPAN] * (relay.MAX_SPANS + 1)),
    ],
)
def test_what_is_not_spans_is_refused_whole(recorded, sent):
    with pytest.raises(relay.BadSpans):
        relay.relay(sent, "prod", "fn")
    assert recorded == []


def test_a_function_speaks_only_for_itself(recorded):
    claims = [
        {"key": "sless.function", "value": {"stringValue": "payments"}},
        {"key": "faas.name", "value": {"stringValue": "payments"}},
        {"key": "k" * 10_000, "value": {"stringValue": "v" * 10_000}},
        {"key": "odd", "value": "intValue"},  # not an AnyValue: left out
    ]
    sent = dict(SPAN, attributes=claims, status={"code": 2, "message": 123})
    assert relay.relay(body(sent), "prod", "fn") == 1
    ((args, kwargs),) = recorded
    attributes = args[4]
    assert attributes["sless.function"] == attributes["faas.name"] == "fn"
    assert kwargs["service"] == "prod/fn" and kwargs["error"] == "123"
    assert all(
        len(k) <= relay.MAX_KEY and len(str(v)) <= relay.MAX_VALUE for k, v in attributes.items()
    )


def test_without_export_the_relay_is_a_no_op():
    assert not telemetry.enabled()
    assert relay.relay(body(SPAN), "prod", "fn") == 1
