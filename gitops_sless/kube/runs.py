"""Kubernetes Jobs followed to their end: builds and job runs both wait on one this way.

A Job is polled (50 ms, doubling to ``poll_sec``) until a ``Complete`` or
``Failed`` condition; ``check`` looks at its pods while it has not ended, so a
pod that cannot start fails the wait with the kubelet's reason instead of
running into the deadline. Its log is the newest pod's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .client import KubeClient

__all__ = ["JobGone", "JobTimedOut", "conditions", "ended", "log", "wait"]


class JobGone(Exception):
    """The Job was deleted while it was waited for."""


class JobTimedOut(Exception):
    """No end within the time given."""


def conditions(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Job's conditions that hold, by type."""
    found = (job.get("status") or {}).get("conditions") or []
    return {c.get("type"): c for c in found if c.get("status") == "True"}


def ended(job: dict[str, Any]) -> bool:
    return bool({"Complete", "Failed"} & set(conditions(job)))


def wait(
    client: KubeClient,
    namespace: str,
    name: str,
    job: dict[str, Any],
    timeout_sec: float,
    poll_sec: float,
    check: Callable[[dict[str, Any], float], None],
) -> dict[str, Any]:
    """Poll until ``job`` ends; ``check(job, waited)`` may raise to give up earlier."""
    started = time.monotonic()
    delay = 0.05
    while not ended(job):
        check(job, time.monotonic() - started)
        if time.monotonic() - started > timeout_sec:
            raise JobTimedOut(name)
        time.sleep(delay)
        delay = min(delay * 2, poll_sec)
        job = client.get("Job", namespace, name) or {}
        if not job:
            raise JobGone(name)
    return job


def pods(client: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    return client.list("Pod", namespace, {"job-name": name})


def log(client: KubeClient, namespace: str, name: str, tail_lines: int | None = None) -> str:
    """The log of the Job's newest pod ("" when it has none left)."""
    found = pods(client, namespace, name)
    if not found:
        return ""
    newest = max(found, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    return client.pod_log(namespace, newest["metadata"]["name"], tail_lines)
