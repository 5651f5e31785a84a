"""A valid manifest's blocks as typed values, with the schema's defaults filled in:
``scale``, ``rateLimit``, ``async``, ``rollout`` and ``stream``."""

from __future__ import annotations

import math
from typing import Any

from . import durations
from .model import AsyncPolicy, RateLimit, Rollout, Scale, StreamPolicy, Warm

__all__ = ["async_policy", "rate_limit", "rollout", "scale", "stream"]


def scale(block: dict[str, Any] | None) -> Scale | None:
    """A valid scale block with the schema's defaults filled in, as a Scale."""
    if block is None:
        return None
    warm = tuple(Warm(w["cron"], float(durations.parse(w["for"])), w["min"]) for w in block["warm"])
    idle = float(durations.parse(block["idle"]))
    return Scale(block["min"], block["max"], block["target"], idle, warm)


def rate_limit(block: dict[str, Any] | None) -> RateLimit | None:
    if block is None:
        return None
    return RateLimit(float(block["rps"]), block.get("burst", math.ceil(block["rps"])))


def async_policy(block: dict[str, Any]) -> AsyncPolicy:
    return AsyncPolicy(
        retries=block["retries"],
        backoff_sec=float(durations.parse(block["backoff"])),
        max_backoff_sec=float(durations.parse(block["maxBackoff"])),
        max_age_sec=float(durations.parse(block["maxAge"])),
        concurrency=block["concurrency"],
    )


def rollout(block: dict[str, Any] | None) -> Rollout | None:
    if block is None:
        return None
    return Rollout(
        steps=tuple(block["steps"]),
        interval_sec=float(durations.parse(block["interval"])),
        min_requests=block["minRequests"],
        max_error_rate=float(block["maxErrorRate"]),
    )


def stream(block: dict[str, Any] | None) -> StreamPolicy | None:
    if block is None:
        return None
    return StreamPolicy(block["idleSec"], block["maxSec"], block["drainSec"], block["request"])
