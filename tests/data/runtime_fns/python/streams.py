"""Streamed responses (tests/test_runtime_streams.py), one per path; the node twin is
streams.js. ``?signal=FILE``: wait for FILE before the second value; ``?mark=FILE``:
write what happened to the iteration there when it ends."""

import asyncio
import os
import time


def _wait_for(path, seconds=20.0):
    end = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.02)


def _marked(query, what):
    if query.get("mark"):
        with open(query["mark"], "a") as out:
            out.write(what + "\n")


def _counting(query):
    """Yield "tick N" every 50 ms until closed; the mark says it was closed."""
    try:
        n = 0
        while n < 2000:
            yield f"tick {n}\n"
            n += 1
            time.sleep(0.05)
        _marked(query, "finished")
    except GeneratorExit:
        _marked(query, "closed")
        raise


async def _async_counting(query):
    try:
        for n in range(2000):
            yield f"tick {n}\n"
            await asyncio.sleep(0.05)
        _marked(query, "finished")
    finally:
        _marked(query, "ended")


def handler(event, context):
    path, query = event["_path"], event["_query"]
    if path == "/gen":

        def values():
            yield "first\n"
            if query.get("signal"):
                _wait_for(query["signal"])
            yield "second\n"

        return values()
    if path == "/async":

        async def values():
            yield b"first\n"
            if query.get("signal"):
                await asyncio.get_running_loop().run_in_executor(None, _wait_for, query["signal"])
            yield b"second\n"

        return values()
    if path == "/ndjson":
        return iter([{"n": 1}, {"n": 2}, [3]])
    if path == "/form":

        def values():
            yield ""  # sends nothing
            yield '{"a":1}'

        return {
            "statusCode": 201,
            "headers": {"Content-Type": "application/json", "X-Kind": "form"},
            "body": values(),
        }
    if path == "/sse":

        def values():
            yield context.sse({"n": 1}, event="tick", id="1")
            yield context.sse("two\nlines", retry=500)
            if query.get("quiet"):
                time.sleep(float(query["quiet"]))
                yield context.sse("after")

        return {
            "statusCode": 200,
            "headers": {"Content-Type": "text/event-stream"},
            "body": values(),
        }
    if path == "/boom":

        def values():
            yield "first\n"
            raise RuntimeError("broke mid-stream")

        return values()
    if path == "/boom-first":

        def values():
            raise RuntimeError("broke before the first value")
            yield "never"

        return values()
    if path == "/counting":
        return _counting(query)
    if path == "/async-counting":
        return _async_counting(query)
    if path == "/idle":

        def values():
            yield "first\n"
            time.sleep(float(query.get("sleep", "5")))
            yield "late\n"

        return values()
    if path == "/made-on-its-loop":

        async def make():
            # an async stream started on the handler's own loop (a client's connection,
            # a queue): it must go on on that loop
            queue = asyncio.Queue()
            for word in ("first\n", "second\n"):
                queue.put_nowait(word)

            async def words():
                while not queue.empty():
                    yield await queue.get()

            source = words()
            first = await source.__anext__()

            async def values():
                yield first
                async for word in source:
                    yield word

            return values()

        return make()
    if path == "/stuck":

        def values():
            yield "first\n"
            time.sleep(30)  # stuck: only a limit ends it
            yield "late\n"

        return values()
    if path == "/slow-first":

        def values():
            time.sleep(float(query.get("sleep", "3")))
            yield "first\n"

        return values()
    if path == "/empty":
        return iter(())
    return {"path": path}
