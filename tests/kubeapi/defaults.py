"""Defaulting, as the real API server does it before validation and storage (the subset
that matters to clients: the fields a client reads back, and those that make a live object
differ from what was sent)."""

from __future__ import annotations

import base64
import itertools
from typing import Any

_cluster_ips = itertools.count(10)


def _pod_spec(spec: dict[str, Any], restart: str | None = "Always") -> None:
    if restart:
        spec.setdefault("restartPolicy", restart)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    spec.setdefault("terminationGracePeriodSeconds", 30)
    for group in ("initContainers", "containers"):
        for c in spec.get(group) or ():
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            image = str(c.get("image", ""))
            tag = image.rsplit("/", 1)[-1]
            latest = "@" not in tag and (":" not in tag or tag.endswith(":latest"))
            c.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
            c.setdefault("resources", {})
            for port in c.get("ports") or ():
                port.setdefault("protocol", "TCP")
    for vol in spec.get("volumes") or ():
        if isinstance(vol.get("secret"), dict):
            vol["secret"].setdefault("defaultMode", 420)
        if isinstance(vol.get("configMap"), dict):
            vol["configMap"].setdefault("defaultMode", 420)


def _template(tpl: dict[str, Any] | None, restart: str | None) -> None:
    if isinstance(tpl, dict):
        tpl.setdefault("metadata", {})
        if isinstance(tpl.get("spec"), dict):
            _pod_spec(tpl["spec"], restart)


def apply_defaults(obj: dict[str, Any], old: dict[str, Any] | None) -> None:
    """Fill in defaulted fields of ``obj`` in place (``old``: the live object, if any)."""
    kind = obj["kind"]
    meta = obj.setdefault("metadata", {})
    spec = obj.get("spec")
    if kind == "Namespace":
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
        obj["spec"] = {"finalizers": ["kubernetes"]}
    elif kind == "Secret":
        obj.setdefault("type", "Opaque")
        string_data = obj.pop("stringData", None) or {}
        data = obj.setdefault("data", {}) if string_data else obj.get("data")
        for k, v in string_data.items():
            data[k] = base64.b64encode(str(v).encode()).decode()
    elif kind == "Deployment" and isinstance(spec, dict):
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        strategy = spec.setdefault("strategy", {})
        strategy.setdefault("type", "RollingUpdate")
        if strategy["type"] == "RollingUpdate":
            rolling = strategy.setdefault("rollingUpdate", {})
            rolling.setdefault("maxSurge", "25%")
            rolling.setdefault("maxUnavailable", "25%")
        _template(spec.get("template"), "Always")
    elif kind == "Job" and isinstance(spec, dict):
        _job(obj, spec)
    elif kind == "CronJob" and isinstance(spec, dict):
        spec.setdefault("concurrencyPolicy", "Allow")
        spec.setdefault("suspend", False)
        spec.setdefault("successfulJobsHistoryLimit", 3)
        spec.setdefault("failedJobsHistoryLimit", 1)
        job = (spec.get("jobTemplate") or {}).get("spec")
        if isinstance(job, dict):
            _template(job.get("template"), None)
    elif kind == "Pod" and isinstance(spec, dict):
        _pod_spec(spec)
        spec.setdefault("serviceAccountName", "default")
        obj.setdefault("status", {"phase": "Pending", "qosClass": "BestEffort"})
    elif kind == "Service" and isinstance(spec, dict):
        _service(spec, (old or {}).get("spec") or {})
    elif kind == "NetworkPolicy" and isinstance(spec, dict):
        types = ["Ingress"] + (["Egress"] if spec.get("egress") else [])
        spec.setdefault("policyTypes", types)
        for rule in (spec.get("ingress") or []) + (spec.get("egress") or []):
            for port in rule.get("ports") or ():
                port.setdefault("protocol", "TCP")


def _job(obj: dict[str, Any], spec: dict[str, Any]) -> None:
    meta = obj["metadata"]
    tpl = spec.get("template")
    if not isinstance(tpl, dict):
        return
    tpl_labels = (tpl.get("metadata") or {}).get("labels")
    if tpl_labels and not meta.get("labels"):
        meta["labels"] = dict(tpl_labels)
    spec.setdefault("parallelism", 1)
    spec.setdefault("completions", 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
    _template(tpl, None)
    uid, name = meta.get("uid"), meta.get("name")
    if uid and not spec.get("manualSelector"):
        spec.setdefault("selector", {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}})
        labels = tpl["metadata"].setdefault("labels", {})
        labels.update(
            {
                "batch.kubernetes.io/controller-uid": uid,
                "batch.kubernetes.io/job-name": name,
                "controller-uid": uid,
                "job-name": name,
            }
        )


def _service(spec: dict[str, Any], old: dict[str, Any]) -> None:
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec["type"] != "ExternalName":
        if not spec.get("clusterIP"):
            n = next(_cluster_ips)
            spec["clusterIP"] = old.get("clusterIP") or f"10.96.{n // 250}.{n % 250 + 1}"
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or ():
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
