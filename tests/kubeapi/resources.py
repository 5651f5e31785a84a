"""The resources the fake API server serves, its errors as Kubernetes ``Status`` objects,
and small helpers (timestamps, fast copies of JSON data, discovery documents)."""

from __future__ import annotations

import datetime
import random
from dataclasses import dataclass
from typing import Any

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class Res:
    """One REST resource: ``kind`` served as ``plural`` in ``group/version``."""

    kind: str
    plural: str
    group: str
    version: str
    namespaced: bool = True
    short: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``deployments.apps`` / ``pods``: how the real server names it in messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def kind_group(self) -> str:
        """``Deployment.apps`` / ``Service``: the name used in Invalid messages."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


RESOURCES = [
    Res("Namespace", "namespaces", "", "v1", False, ("ns",), ("status", "finalize")),
    Res("Secret", "secrets", "", "v1"),
    Res("ConfigMap", "configmaps", "", "v1", short=("cm",)),
    Res("ServiceAccount", "serviceaccounts", "", "v1", short=("sa",)),
    Res("Service", "services", "", "v1", short=("svc",), subresources=("status", "proxy")),
    Res("Pod", "pods", "", "v1", short=("po",), subresources=("status", "log")),
    Res("Deployment", "deployments", "apps", "v1", short=("deploy",), subresources=("status",)),
    Res("Job", "jobs", "batch", "v1", subresources=("status",)),
    Res("CronJob", "cronjobs", "batch", "v1", short=("cj",), subresources=("status",)),
    Res("NetworkPolicy", "networkpolicies", "networking.k8s.io", "v1", short=("netpol",)),
    Res("Lease", "leases", "coordination.k8s.io", "v1"),
]
BY_KIND = {r.kind: r for r in RESOURCES}
BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}
GROUPS = sorted({r.group for r in RESOURCES if r.group})
# kinds whose metadata.generation the server maintains (bumped when .spec changes)
GENERATION_KINDS = {"Deployment", "Job", "CronJob", "NetworkPolicy"}
# kinds whose .status only the status subresource (or a controller) may change
STATUS_KINDS = {"Deployment", "Job", "CronJob", "Pod", "Service", "Namespace"}


class ApiError(Exception):
    """An error answer: becomes a ``Status`` object with ``code``."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details is not None:
            out["details"] = self.details
        out["code"] = self.code
        return out


def _details(res: Res, name: str) -> dict[str, Any]:
    out = {"name": name, "kind": res.plural}
    if res.group:
        out["group"] = res.group
    return out


def not_found(res: Res, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{res.qualified} "{name}" not found', _details(res, name))


def already_exists(res: Res, name: str) -> ApiError:
    msg = f'{res.qualified} "{name}" already exists'
    return ApiError(409, "AlreadyExists", msg, _details(res, name))


def stale(res: Res, name: str) -> ApiError:
    msg = (
        f'Operation cannot be fulfilled on {res.qualified} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again"
    )
    return ApiError(409, "Conflict", msg, _details(res, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(res: Res, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """422 Invalid; ``causes`` are (field, message, reason) like the real server's."""
    parts = [f"{field}: {msg}" if field else msg for field, msg, _ in causes]
    text = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    details: dict[str, Any] = {"name": name, "kind": res.kind}
    if res.group:
        details["group"] = res.group
    details["causes"] = [
        {"reason": reason, "message": msg, "field": field} for field, msg, reason in causes
    ]
    return ApiError(422, "Invalid", f'{res.kind_group} "{name}" is invalid: {text}', details)


def now_iso() -> str:
    """RFC 3339 in UTC with seconds, as the API server writes timestamps."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clone(value: Any) -> Any:
    """A deep copy of JSON data (much cheaper than ``copy.deepcopy``)."""
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone(v) for v in value]
    return value


_ALNUM = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet of Kubernetes' random name suffixes


def suffix(n: int = 5) -> str:
    return "".join(random.choice(_ALNUM) for _ in range(n))


def discovery_resources(group: str, version: str) -> dict[str, Any] | None:
    """The ``APIResourceList`` for ``/api/v1`` or ``/apis/{group}/{version}``."""
    items = [r for r in RESOURCES if r.group == group and r.version == version]
    if not items:
        return None
    resources: list[dict[str, Any]] = []
    for r in items:
        verbs = [v for v in VERBS if not (r.kind == "Namespace" and v == "deletecollection")]
        entry: dict[str, Any] = {
            "name": r.plural,
            "singularName": r.kind.lower(),
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": verbs,
        }
        if r.short:
            entry["shortNames"] = list(r.short)
        resources.append(entry)
        for sub in r.subresources:
            sub_verbs = {"status": ["get", "patch", "update"], "log": ["get"]}.get(
                sub, ["create", "delete", "get", "patch", "update"]
            )
            sub_kind = "Pod" if sub == "log" else r.kind
            resources.append(
                {
                    "name": f"{r.plural}/{sub}",
                    "singularName": "",
                    "namespaced": r.namespaced,
                    "kind": sub_kind,
                    "verbs": sub_verbs,
                }
            )
    gv = f"{group}/{version}" if group else version
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": gv,
        "resources": resources,
    }


def discovery_groups() -> dict[str, Any]:
    groups = []
    for group in GROUPS:
        gv = {"groupVersion": f"{group}/v1", "version": "v1"}
        groups.append({"name": group, "versions": [gv], "preferredVersion": gv})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def discovery_versions(address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
    }


VERSION_INFO = {
    "major": "1",
    "minor": "30",
    "gitVersion": "v1.30.0-fake",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2024-04-17T00:00:00Z",
    "goVersion": "go1.22.2",
    "compiler": "gc",
    "platform": "linux/amd64",
}
