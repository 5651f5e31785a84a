"""The CronJob controller of the fake cluster, on demand only: ``fire`` creates a Job from
a CronJob's jobTemplate as the real controller does at a scheduled time; ``job_done`` keeps
the CronJob's status and its history limits."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .resources import BY_KIND, clone, not_found, now_iso
from .store import Obj

if TYPE_CHECKING:
    from .controllers import Controllers


def finished(job: Obj) -> str | None:
    """``Complete`` / ``Failed`` once a Job has finished, else None."""
    for c in (job.get("status") or {}).get("conditions") or ():
        if c["type"] in ("Complete", "Failed") and c["status"] == "True":
            return c["type"]
    return None


def fire(ctl: Controllers, namespace: str, name: str) -> Obj:
    """Create a Job from a CronJob's jobTemplate, as the CronJob controller does."""
    cj = ctl.store.get("CronJob", namespace, name)
    if cj is None:
        raise not_found(BY_KIND["CronJob"], name)
    tpl = cj["spec"].get("jobTemplate") or {}
    tmeta = tpl.get("metadata") or {}
    stamp = int(time.time() // 60)
    while ctl.store.peek("Job", namespace, f"{name}-{stamp}") is not None:
        stamp += 1
    when = now_iso()
    annotations = dict(
        tmeta.get("annotations") or {},
        **{"batch.kubernetes.io/cronjob-scheduled-timestamp": when},
    )
    job_meta: Obj = {
        "name": f"{name}-{stamp}",
        "namespace": namespace,
        "annotations": annotations,
    }
    if tmeta.get("labels"):
        job_meta["labels"] = dict(tmeta["labels"])
    job_meta["ownerReferences"] = [
        {
            "apiVersion": "batch/v1",
            "kind": "CronJob",
            "name": name,
            "uid": cj["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": job_meta,
        "spec": clone(tpl.get("spec") or {}),
    }
    job = ctl.api.create(BY_KIND["Job"], namespace, body, "kube-controller-manager")
    with ctl.store.lock:
        live = ctl.store.peek("CronJob", namespace, name)
        if live is not None:
            status = clone(live.get("status") or {})
            ref = {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": job["metadata"]["name"],
                "namespace": namespace,
                "uid": job["metadata"]["uid"],
                "resourceVersion": job["metadata"]["resourceVersion"],
            }
            status["active"] = [*(status.get("active") or []), ref]
            status["lastScheduleTime"] = when
            ctl.store.update(dict(live, status=status))
    ctl.process()
    return clone(job)


def job_done(ctl: Controllers, job: Obj, cronjob: str) -> None:
    """A Job of ``cronjob`` finished: its status, and the history limits."""
    ns = job["metadata"]["namespace"]
    cj = ctl.store.peek("CronJob", ns, cronjob)
    if cj is None:
        return
    status = clone(cj.get("status") or {})
    active = [r for r in status.get("active") or () if r.get("uid") != job["metadata"]["uid"]]
    if active:
        status["active"] = active
    else:
        status.pop("active", None)
    if finished(job) == "Complete":
        status["lastSuccessfulTime"] = job["status"].get("completionTime") or now_iso()
    if status != cj.get("status"):
        ctl.store.update(dict(cj, status=status))
    spec = cj["spec"]
    jobs = [j for j in ctl.store.owned_by(cj["metadata"]["uid"]) if j["kind"] == "Job"]
    for kind, limit in (
        ("Complete", spec.get("successfulJobsHistoryLimit", 3)),
        ("Failed", spec.get("failedJobsHistoryLimit", 1)),
    ):
        done = sorted((j for j in jobs if finished(j) == kind), key=lambda j: j["metadata"]["name"])
        for old in done[: max(0, len(done) - limit)]:
            ctl.api.remove("Job", ns, old["metadata"]["name"], "Background")
