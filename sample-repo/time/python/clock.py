"""Two entrypoints in one file: a job that takes the time, a function that shows it."""
import json
import os
from datetime import datetime, timezone


def _utc_now():
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def get_time(event, context=None):
    """Job: returns the current UTC time; the platform keeps it as the job's result."""
    return {"utc": _utc_now()}


def display(event, context=None):
    """HTTP: shows the time the job took (fixed at deploy time) next to the time now."""
    raw = os.environ.get("JOB_TIME")
    if not raw:
        return {"statusCode": 500, "headers": {"Content-Type": "application/json"},
                "body": json.dumps({"error": "JOB_TIME is not set"})}
    return {"time": json.loads(raw)["utc"], "now": _utc_now()}
