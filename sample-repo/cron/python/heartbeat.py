"""Cron + HTTP + queue: returns the time of the beat and the event that caused it.

Called asynchronously (Prefer: respond-async, /async/..., or an event on heartbeat.ping)
it says which invocation and attempt it is: the X-Invocation-Id and
X-Invocation-Attempt headers. Every attempt of one invocation has the same id, and an
attempt can run twice (at least once: a reconciler killed during it runs it again), so
a handler that changes something keys that change by the id (an INSERT ... ON CONFLICT
DO NOTHING on it, in the same transaction as the work); this one changes nothing, so
running it twice is harmless as it is.

{"fail": N} answers 503 to the first N attempts, to watch retries and dead letters.
"""
from datetime import datetime, timezone


def handler(event, context=None):
    headers = event.get("_headers") or {}
    attempt = int(headers.get("x-invocation-attempt") or 0)  # 0: a synchronous call
    if attempt and attempt <= int(event.get("fail") or 0):
        return {"statusCode": 503, "body": f"failing attempt {attempt} on purpose"}
    beat = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    # Echo the event, minus the request headers of a call made by hand.
    reply = {"beat": beat, "event": {k: v for k, v in event.items() if k != "_headers"}}
    if attempt:
        reply["invocation"] = {"id": headers.get("x-invocation-id"), "attempt": attempt}
    return reply
