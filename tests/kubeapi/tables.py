"""Server-side printing: the ``Table`` a ``GET`` answers when asked ``Accept: ...;as=Table``.

``kubectl get`` asks for it and prints its columns as they come; without it, it falls back
to NAME and AGE. Columns follow the real server's for the kinds a user of gitops-sless looks
at (namespaces, deployments, pods, jobs, cronjobs, services), a custom resource's come from
its CRD's ``additionalPrinterColumns`` (simple ``.a.b`` paths only), any other kind gets the
default Name and Created At. Priority-1 (``-o wide``) columns are left out.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from .resources import Res
from .store import Store

Obj = dict[str, Any]
Column = tuple[str, str, Callable[[Obj], Any]]  # name, type, cell


def wants_table(accept: str | None) -> bool:
    return any("as=Table" in part for part in (accept or "").split(","))


def table(store: Store, res: Res, body: Obj, include: str | None) -> Obj:
    """``body`` (one object or a list of them) as a ``meta.k8s.io/v1`` Table."""
    columns = _columns(store, res)
    items = body.get("items", []) if body.get("kind", "").endswith("List") else [body]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": (body.get("metadata") or {}).get("resourceVersion", "")},
        "columnDefinitions": [
            {
                "name": name,
                "type": kind,
                "format": "name" if i == 0 else "",
                "description": "",
                "priority": 0,
            }
            for i, (name, kind, _) in enumerate(columns)
        ],
        "rows": [
            {"cells": [cell(obj) for _, _, cell in columns], "object": _row_object(obj, include)}
            for obj in items
        ],
    }


def _row_object(obj: Obj, include: str | None) -> Obj | None:
    """What ``includeObject`` asks for; kubectl reads a row's namespace and labels from it."""
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj.get("metadata") or {},
    }


def age(timestamp: str | None, now: dt.datetime | None = None) -> str:
    """``duration.HumanDuration`` of the time since ``timestamp``, as kubectl shows an age."""
    if not timestamp:
        return "<unknown>"
    then = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return human_duration(((now or dt.datetime.now(dt.UTC)) - then).total_seconds())


def human_duration(seconds: float) -> str:
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 120:
        return f"{max(s, 0)}s"
    minutes, hours, days = s // 60, s // 3600, s // 86400
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 192:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 730:
        return f"{days}d"
    years = days // 365
    if years < 8:
        return f"{years}y{days % 365}d" if days % 365 else f"{years}y"
    return f"{years}y"


def _get(obj: Any, path: str) -> Any:
    for key in path.strip(".").split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _name(obj: Obj) -> Any:
    return obj["metadata"]["name"]


def _age(obj: Obj) -> str:
    return age(obj["metadata"].get("creationTimestamp"))


def _pod_ready(pod: Obj) -> str:
    statuses = _get(pod, "status.containerStatuses") or []
    ready = sum(1 for s in statuses if s.get("ready"))
    return f"{ready}/{len(_get(pod, 'spec.containers') or [])}"


def _pod_status(pod: Obj) -> str:
    """The first waiting or terminated reason of a container (CrashLoopBackOff...), else the
    phase, as ``kubectl get pods`` shows it."""
    for status in _get(pod, "status.containerStatuses") or []:
        for state in ("waiting", "terminated"):
            reason = _get(status, f"state.{state}.reason")
            if reason:
                return str(reason)
    return str(_get(pod, "status.phase") or "Pending")


def _restarts(pod: Obj) -> int:
    return sum(int(s.get("restartCount") or 0) for s in _get(pod, "status.containerStatuses") or [])


def _job_status(job: Obj) -> str:
    for cond in _get(job, "status.conditions") or []:
        if cond.get("status") == "True" and cond.get("type") in ("Complete", "Failed"):
            return str(cond["type"])
    return "Running"


def _ports(svc: Obj) -> str:
    ports = _get(svc, "spec.ports") or []
    return ",".join(f"{p.get('port')}/{p.get('protocol') or 'TCP'}" for p in ports) or "<none>"


BUILT_IN: dict[str, list[Column]] = {
    "Namespace": [("Status", "string", lambda o: _get(o, "status.phase") or "Active")],
    "Deployment": [
        (
            "Ready",
            "string",
            lambda o: f"{_get(o, 'status.readyReplicas') or 0}/{_get(o, 'spec.replicas') or 0}",
        ),
        ("Up-to-date", "integer", lambda o: _get(o, "status.updatedReplicas") or 0),
        ("Available", "integer", lambda o: _get(o, "status.availableReplicas") or 0),
    ],
    "Pod": [
        ("Ready", "string", _pod_ready),
        ("Status", "string", _pod_status),
        ("Restarts", "string", lambda o: str(_restarts(o))),
    ],
    "Job": [
        ("Status", "string", _job_status),
        (
            "Completions",
            "string",
            lambda o: f"{_get(o, 'status.succeeded') or 0}/{_get(o, 'spec.completions') or 1}",
        ),
    ],
    "CronJob": [
        ("Schedule", "string", lambda o: _get(o, "spec.schedule")),
        ("Suspend", "boolean", lambda o: bool(_get(o, "spec.suspend"))),
        ("Active", "integer", lambda o: len(_get(o, "status.active") or [])),
        (
            "Last Schedule",
            "string",
            lambda o: age(t) if (t := _get(o, "status.lastScheduleTime")) else "<none>",
        ),
    ],
    "Service": [
        ("Type", "string", lambda o: _get(o, "spec.type") or "ClusterIP"),
        ("Cluster-IP", "string", lambda o: _get(o, "spec.clusterIP") or "<none>"),
        ("Port(s)", "string", _ports),
    ],
}


def _columns(store: Store, res: Res) -> list[Column]:
    name: Column = ("Name", "string", _name)
    if res.kind in BUILT_IN:
        return [name, *BUILT_IN[res.kind], ("Age", "string", _age)]
    custom = store.kinds.custom.get(res.kind)
    if custom is None:
        created = ("Created At", "date", lambda o: o["metadata"].get("creationTimestamp"))
        return [name, created]
    crd = store.peek("CustomResourceDefinition", "", custom.crd) or {}
    version = next(
        (v for v in _get(crd, "spec.versions") or [] if v.get("name") == res.version), {}
    )
    printer = version.get("additionalPrinterColumns")
    if printer is None:  # a CRD without columns shows its age, as the real server does
        return [name, ("Age", "date", _age)]
    return [name, *(_printer_column(c) for c in printer if not c.get("priority"))]


def _printer_column(column: Obj) -> Column:
    path, kind = str(column.get("jsonPath") or ""), str(column.get("type") or "string")

    def cell(obj: Obj) -> Any:
        value = _get(obj, path)
        return age(value) if kind == "date" and isinstance(value, str) else value

    return str(column.get("name")), kind, cell
