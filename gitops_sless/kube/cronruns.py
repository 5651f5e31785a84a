"""CronJob runs recorded as invocations, once each, whenever the reconciler sees them end.

A run is a Job the CronJob made. When the reconciler sees it finished it
reports it and writes ``gitops-sless.dev/recorded`` onto it: the cluster, not
this process, remembers which runs are recorded. So the runs that ended while
no reconciler ran (the Jobs the CronJob kept, its ``successfulJobsHistoryLimit``
and ``failedJobsHistoryLimit``) are recorded when one starts, with the time they
ended, and a second start records none of them again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import SlessError
from ..plan.backend import CronRun
from ..timestamps import epoch
from .client import KubeClient, NotFound
from .renderer import FUNCTION_LABEL
from .view import View, annotation, label

__all__ = ["RECORDED", "CronRuns"]

log = logging.getLogger(__name__)

RECORDED = "gitops-sless.dev/recorded"


class CronRuns:
    def __init__(self, client: KubeClient, on_cron: Callable[[CronRun], None] | None) -> None:
        self.client = client
        self.on_cron = on_cron
        self._reported: set[str] = set()  # uids: a mark that failed to write is no second run

    def report(self, view: View) -> None:
        """Report every finished run of ``view`` not marked yet, then mark it."""
        if self.on_cron is None:
            return
        for job in view.all("Job"):
            uid = job["metadata"].get("uid") or ""
            if not _finished_cron_run(job) or annotation(job, RECORDED) or uid in self._reported:
                continue
            self._reported.add(uid)
            self.on_cron(_cron_run(view.env, job))
            self._mark(view, job)

    def _mark(self, view: View, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        patch = {"metadata": {"annotations": {RECORDED: "true"}}}
        try:
            view.put(self.client.patch("Job", view.namespace, name, patch))
        except NotFound:
            pass  # collected by its CronJob meanwhile: nothing left to record it again
        except SlessError as exc:  # recorded once in this process all the same
            log.warning("cron run %s/%s: cannot mark it recorded: %s", view.namespace, name, exc)


def _finished_cron_run(job: dict[str, Any]) -> bool:
    owners = job["metadata"].get("ownerReferences") or []
    status = job.get("status") or {}
    return any(o.get("kind") == "CronJob" for o in owners) and bool(
        status.get("succeeded") or status.get("failed")
    )


def _cron_run(env: str, job: dict[str, Any]) -> CronRun:
    status = job.get("status") or {}
    started = epoch(status.get("startTime"))
    done = epoch(status.get("completionTime")) or _failed_at(job) or started
    owner = next(
        o["name"] for o in job["metadata"]["ownerReferences"] if o.get("kind") == "CronJob"
    )
    index = owner.rsplit("-", 1)[-1]  # CronJobs are named <function>-cron-<index>
    return CronRun(
        env,
        label(job, FUNCTION_LABEL) or owner,
        int(index) if index.isdigit() else 0,
        bool(status.get("succeeded")),
        (done - started) * 1000 if started and done else 0.0,
        "",
        at=done or None,
    )


def _failed_at(job: dict[str, Any]) -> float:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            return epoch(cond.get("lastTransitionTime")) or 0.0
    return 0.0
