"""Floors on a schedule: a ``warm`` entry holds ``min`` replicas from each time its
cron fires (UTC) for its ``for`` duration."""

from __future__ import annotations

from datetime import datetime, timedelta

from ..manifests import cron
from ..manifests.model import Scale

__all__ = ["floor"]


def floor(policy: Scale, now: datetime) -> int:
    """The fewest replicas ``policy`` allows at ``now`` (UTC): its ``min``, raised by every
    warm entry that fired less than its ``for`` ago (never above ``max``: the manifest
    refuses a floor that would be)."""
    lowest = policy.min
    for warm in policy.warm:
        if warm.min <= lowest:
            continue
        started = now - timedelta(seconds=warm.for_sec)
        # the first firing after the window opened; at or before now, it holds the floor
        if cron.parse(warm.cron).next_after(started) <= now:
            lowest = warm.min
    return min(lowest, policy.max)
