"""WebSocket handlers (tests/test_runtime_websockets.py): entrypoint ``sockets.handler``,
SLESS_WS_ON_CONNECT=connect, SLESS_WS_ON_DISCONNECT=disconnect. The node twin is
sockets.js; both behave the same."""

import time


def connect(event, ctx):
    query = event["_query"]
    if "refuse" in query:
        return {"statusCode": 403, "body": {"error": "refused"}}
    if "boom" in query:
        raise RuntimeError("connect failed")
    if "protocol" in query:
        return {"protocol": query["protocol"]}
    return None


def handler(message, ctx):
    if isinstance(message, bytes):
        return message
    if message.startswith("push:"):
        count = int(message[5:])
        for i in range(1, count + 1):
            ctx.send(f"push {i}")
        return f"pushed {count}"
    if message.startswith("close:"):
        _, code, reason = message.split(":", 2)
        ctx.close(int(code), reason)
        return None
    if message == "json":
        return {"kind": "json", "ok": True}
    if message.startswith("sleep:"):
        time.sleep(float(message[6:]))
        return "slept"
    if message == "boom":
        raise RuntimeError("message failed")
    if message == "none":
        return None
    if message == "id":
        return ctx.connection_id
    if message.startswith("print:"):
        print(message[6:])
        return "printed"
    return message


def disconnect(event, ctx):
    log = event["_query"].get("log")
    if log:
        with open(log, "a") as out:
            out.write(f"disconnect {event['code']} {ctx.connection_id}\n")
