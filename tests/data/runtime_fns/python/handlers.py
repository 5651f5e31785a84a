"""Handlers for tests/test_runtimes.py (python3.11 runtime); node/handlers.js mirrors them."""

import asyncio
import os
import time

import helper  # a sibling module of the function folder

print("handlers module loaded")  # at import time: must not reach the runner's stdout

CALLS = {"count": 0}


class Opaque:
    """Not JSON serialisable."""


def main(event, context):
    """The HTTP handler: dispatches on the sub-path."""
    CALLS["count"] += 1
    path = event["_path"]
    if path == "/add":
        return {"sum": helper.add(event["a"], event["b"])}
    if path == "/text":
        return {"statusCode": 201, "headers": {"X-Custom": "yes"}, "body": "created"}
    if path == "/json-status":
        return {"statusCode": 202, "headers": {"X-Kind": "json"}, "body": {"accepted": True}}
    if path == "/none":
        return None
    if path == "/list":
        return [1, 2, 3]
    if path == "/boom":
        raise TypeError("kaboom")
    if path == "/unserialisable":
        return {"value": Opaque()}
    if path == "/slow":
        return slow(event)
    if path == "/async":
        return later({"async": True})
    if path == "/calls":
        return {"calls": CALLS["count"]}
    if path == "/context":
        return {
            "function_name": context.function_name,
            "environment": context.environment,
            "request_id": context.request_id,
            "remaining_ms": context.remaining_time_ms(),
        }
    if path == "/trace":
        return {
            "trace_id": context.trace_id,
            "traceparent": context.traceparent,
            "outgoing": context.trace_headers(),
        }
    if path == "/env-keys":
        import os

        return sorted(k for k in os.environ if k.startswith("SLESS_"))
    if path == "/dep":
        import fakedep  # from .sless-deps, created by the test

        return {"dep": fakedep.NAME}
    return event


async def later(value):
    await asyncio.sleep(0.01)
    return value


def add(event):
    """Runner: prints on stdout itself, returns the sum."""
    print("noise from the handler")
    return {"sum": event["a"] + event["b"]}


def boom(event):
    raise TypeError("kaboom")


def slow(event):
    """Three seconds, then a mark in SLOW_MARK (if set): a test can see that its answer
    came before the handler finished, by order rather than by a stopwatch."""
    time.sleep(3)
    if os.environ.get("SLOW_MARK"):
        with open(os.environ["SLOW_MARK"], "a") as mark:
            mark.write("finished\n")
    return {"late": True}


def nothing(event):
    return None


def whoami(event, context):
    return {
        "function_name": context.function_name,
        "environment": context.environment,
        "remaining_ms": context.remaining_time_ms(),
    }
