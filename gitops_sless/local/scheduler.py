"""Cron triggers on the local backend, fired by APScheduler with our own cron semantics.

APScheduler's own CronTrigger numbers weekdays from Monday and ANDs
day-of-month with day-of-week; Kubernetes does neither. So the trigger here
asks ``gitops_sless.manifests.cron`` for the next time, the one parser both backends share.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.base import BaseTrigger

from ..manifests import cron

__all__ = ["CronScheduler", "ScheduleTrigger"]

log = logging.getLogger(__name__)


class ScheduleTrigger(BaseTrigger):
    """An APScheduler trigger for a five-field schedule, in UTC."""

    __slots__ = ("schedule",)

    def __init__(self, schedule: cron.Schedule) -> None:
        self.schedule = schedule

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime:
        after = (previous_fire_time or now).astimezone(UTC).replace(tzinfo=None)
        return self.schedule.next_after(after).replace(tzinfo=UTC)

    def __str__(self) -> str:
        return f"cron[{self.schedule.text}]"


class CronScheduler:
    """Cron jobs of every function, replaced whole when a function's deployment changes."""

    def __init__(self) -> None:
        self._scheduler = BackgroundScheduler(timezone=UTC)
        self._scheduler.start()
        self._ids: dict[tuple[str, str], list[str]] = {}

    def set(
        self,
        env: str,
        name: str,
        triggers: list[tuple[str, Mapping[str, Any]]],
        fire: Callable[[int, Mapping[str, Any]], None],
    ) -> None:
        """Schedule ``fire(index, event)`` for each (schedule, event); [] removes them all."""
        self.remove(env, name)
        ids = []
        for index, (text, event) in enumerate(triggers):
            job_id = f"{env}/{name}/{index}"
            self._scheduler.add_job(
                fire,
                ScheduleTrigger(cron.parse(text)),
                args=(index, event),
                id=job_id,
                max_instances=1,  # as Kubernetes' concurrencyPolicy: Forbid
                coalesce=True,
                misfire_grace_time=60,
            )
            ids.append(job_id)
        self._ids[(env, name)] = ids

    def remove(self, env: str, name: str) -> None:
        for job_id in self._ids.pop((env, name), []):
            if self._scheduler.get_job(job_id):
                self._scheduler.remove_job(job_id)

    def close(self) -> None:
        self._scheduler.shutdown(wait=False)
