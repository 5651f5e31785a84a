"""A WebSocket echo: every message comes back; `who` lists the sockets open on this replica.

Try it with the `websockets` package: python3 -m websockets ws://127.0.0.1:8080/fn/prod/echo-py/
"""

import threading

_open: dict[str, object] = {}  # connection id -> its context, on this replica
_lock = threading.Lock()


def connect(event, context):
    if "deny" in event["_query"]:  # refused with a status: no socket is opened
        return {"statusCode": 403, "body": {"error": "not today"}}
    with _lock:
        _open[context.connection_id] = context


def handler(message, context):
    if message == "who":
        with _lock:
            return {"open": sorted(_open)}
    if message == "hello all":
        with _lock:
            others = [c for cid, c in _open.items() if cid != context.connection_id]
        for other in others:  # a push to another socket, from this one's call
            try:
                other.send(f"{context.connection_id} says hello")
            except ConnectionError:
                pass  # it closed meanwhile
        return f"said hello to {len(others)}"
    return message  # text stays text, bytes stay bytes


def disconnect(event, context):
    with _lock:
        _open.pop(context.connection_id, None)
    print(f"closed with {event['code']}")
