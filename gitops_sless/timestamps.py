"""RFC 3339 times as the API and Kubernetes write them, to and from seconds since the epoch."""

from __future__ import annotations

import time
from datetime import datetime

__all__ = ["epoch", "rfc3339"]


def rfc3339(seconds: float | None) -> str | None:
    """Seconds since the epoch as ``2026-12-01T10:00:00.123Z`` (UTC, milliseconds)."""
    if seconds is None:
        return None
    whole, millis = divmod(round(seconds * 1000), 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def epoch(stamp: str | None) -> float | None:
    """``2026-12-01T10:00:00Z`` (any RFC 3339 form) as seconds since the epoch."""
    if not stamp:
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
