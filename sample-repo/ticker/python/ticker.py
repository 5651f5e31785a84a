"""Server-sent events: `?n=5` -> five `tick` events, one a second, each sent as it is made.

A browser reads them with `new EventSource("/fn/prod/ticker-py/?n=5")`; curl with `-N`.
"""
import time


def handler(event, context):
    count = min(int((event.get("_query") or {}).get("n") or 5), 60)

    def events():
        for n in range(1, count + 1):
            yield context.sse({"n": n, "of": count}, event="tick", id=str(n))
            if n < count:
                time.sleep(1)
        yield context.sse("done", event="end")

    return {"statusCode": 200, "headers": {"Content-Type": "text/event-stream"}, "body": events()}
