"""Kubernetes Jobs followed to their end: builds and job runs both wait on one this way.

A Job is followed by watch, not polled: the wait reads the Job from an
informer (:mod:`informer`) and sleeps until the informer's cache changes, so a
Job's completion is an event and waiting costs no request. At most every
``tick`` seconds it also looks without an event: ``check`` looks at the pods
while the Job has not ended (a pod that cannot start fails the wait with the
kubelet's reason instead of running into the deadline), and a cache that a
watch error left stale is listed again (``Informer.sync``), so a Job that ended
while the watch was cut is seen by the resumed watch or by that LIST. Its log
is the newest pod's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import TransientError
from .client import KubeClient, KubeError
from .informer import Informer
from .renderer import JOB_LABEL

__all__ = ["JobGone", "JobTimedOut", "WaitStopped", "conditions", "ended", "log", "wait"]


class JobGone(Exception):
    """The Job was deleted while it was waited for."""


class JobTimedOut(Exception):
    """No end within the time given."""


class WaitStopped(TransientError):
    """The watch was stopped (the reconciler is closing) before the Job ended: not a
    failure; the next start waits for the same Job."""


def conditions(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Job's conditions that hold, by type."""
    found = (job.get("status") or {}).get("conditions") or []
    return {c.get("type"): c for c in found if c.get("status") == "True"}


def ended(job: dict[str, Any]) -> bool:
    return bool({"Complete", "Failed"} & set(conditions(job)))


def wait(
    jobs: Informer,
    name: str,
    timeout_sec: float,
    tick_sec: float,
    check: Callable[[dict[str, Any], float], None],
) -> dict[str, Any]:
    """Wait until the Job ``name`` of ``jobs`` ends; ``check(job, waited)`` may raise to give
    up earlier. The Job must be in the cache already (a create's answer is put there)."""
    started = time.monotonic()
    while True:
        seen = jobs.version()
        if jobs.stopped:
            raise WaitStopped(name)
        if not jobs.fresh:
            jobs.sync()  # a LIST: the watch was cut, what it missed is read again
        job = jobs.get(name)
        if job is None:
            raise JobGone(name)
        if ended(job):
            return job
        waited = time.monotonic() - started
        check(job, waited)
        if waited > timeout_sec:
            raise JobTimedOut(name)
        jobs.wait_change(seen, tick_sec)


def pods(client: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    return client.list("Pod", namespace, {"job-name": name})


def log(client: KubeClient, namespace: str, name: str, tail_lines: int | None = None) -> str:
    """The log of the Job's newest pod ("" when it has none left)."""
    found = pods(client, namespace, name)
    if not found:
        return ""
    newest = max(found, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    return client.pod_log(namespace, newest["metadata"]["name"], tail_lines)


def is_run_pod(pod: dict[str, Any]) -> bool:
    """Whether ``pod`` runs a job or a cron run (a Job's), not a replica."""
    labels = pod["metadata"].get("labels") or {}
    return "job-name" in labels or JOB_LABEL in labels


REPLICA_LOG_LINES = 5000  # of each pod: a function's log is read whole for a request's lines


def replica_logs(client: KubeClient, namespace: str, pods: list[dict[str, Any]]) -> str:
    """The logs of ``pods``' function containers, oldest pod first, each line marked
    ``[replica <pod>]`` (a pod whose log cannot be read says why, in a line of ours)."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
        name = pod["metadata"]["name"]
        try:
            text = client.pod_log(namespace, name, REPLICA_LOG_LINES, container="function")
        except KubeError as exc:  # not started, gone meanwhile, its node unreachable: said
            out.append(f"[replica {name}] [gitops-sless] its log cannot be read: {exc}\n")
            continue
        # lines end at "\n" only: what a caller gets printed cannot start one of its own
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()
        out += [f"[replica {name}] {line}\n" for line in lines]
    return "".join(out)
