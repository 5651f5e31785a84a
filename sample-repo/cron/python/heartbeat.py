"""Cron + HTTP: returns the time of the beat and the event that caused it."""
from datetime import datetime, timezone


def handler(event, context=None):
    beat = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    # Echo the event, minus the request headers of a call made by hand.
    return {"beat": beat, "event": {k: v for k, v in event.items() if k != "_headers"}}
