"""The resources the fake API server serves (built in, and the ``Registry`` that adds those
of CustomResourceDefinitions), its errors as Kubernetes ``Status`` objects, and small
helpers (timestamps, fast copies of JSON data)."""

from __future__ import annotations

import datetime
import random
import re
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
    singular: str = ""
    list_kind: str = ""
    categories: tuple[str, ...] = ()

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
    Res("Pod", "pods", "", "v1", short=("po",), subresources=("status", "log", "proxy")),
    Res(
        "Deployment",
        "deployments",
        "apps",
        "v1",
        short=("deploy",),
        subresources=("status", "scale"),
    ),
    Res("Job", "jobs", "batch", "v1", subresources=("status",)),
    Res("CronJob", "cronjobs", "batch", "v1", short=("cj",), subresources=("status",)),
    Res("NetworkPolicy", "networkpolicies", "networking.k8s.io", "v1", short=("netpol",)),
    Res("Lease", "leases", "coordination.k8s.io", "v1"),
    Res(
        "CustomResourceDefinition",
        "customresourcedefinitions",
        "apiextensions.k8s.io",
        "v1",
        False,
        ("crd", "crds"),
        ("status",),
    ),
]
BY_KIND = {r.kind: r for r in RESOURCES}
BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}
# kinds whose metadata.generation the server maintains (bumped when .spec changes)
GENERATION_KINDS = {"Deployment", "Job", "CronJob", "NetworkPolicy", "CustomResourceDefinition"}
# kinds whose .status only the status subresource (or a controller) may change
STATUS_KINDS = {
    "Deployment",
    "Job",
    "CronJob",
    "Pod",
    "Service",
    "Namespace",
    "CustomResourceDefinition",
}


@dataclass(frozen=True)
class Custom:
    """A kind served because a CustomResourceDefinition (named ``crd``) is established."""

    crd: str
    kind: str
    storage: str  # the storage version; objects are stored with its apiVersion
    versions: dict[str, Res]  # every version of the CRD
    served: tuple[str, ...]
    schemas: dict[str, dict[str, Any]]  # version -> openAPIV3Schema
    status: bool  # the status subresource is enabled

    @property
    def res(self) -> Res:
        return self.versions[self.storage]


class Registry:
    """The kinds served: the built-in ones and those of established CRDs (by kind). Changed
    under the store's lock, copy-on-write, so readers need no lock."""

    def __init__(self) -> None:
        self.custom: dict[str, Custom] = {}
        self.paths = dict(BY_PATH)

    def put(self, custom: Custom) -> None:
        kinds = {k: c for k, c in self.custom.items() if c.crd != custom.crd}
        kinds[custom.kind] = custom
        self._set(kinds)

    def drop(self, crd: str) -> None:
        self._set({k: c for k, c in self.custom.items() if c.crd != crd})

    def _set(self, kinds: dict[str, Custom]) -> None:
        paths = dict(BY_PATH)
        for c in kinds.values():
            paths.update({(r.group, r.version, r.plural): r for r in self._served(c)})
        self.custom, self.paths = kinds, paths

    @staticmethod
    def _served(c: Custom) -> list[Res]:
        return [c.versions[v] for v in c.served]

    def res(self, kind: str) -> Res:
        return BY_KIND[kind] if kind in BY_KIND else self.custom[kind].res

    def resources(self) -> list[Res]:
        """Every served resource (a custom kind once per served version)."""
        return RESOURCES + [r for c in self.custom.values() for r in self._served(c)]

    def namespaced_kinds(self) -> list[str]:
        return list(dict.fromkeys(r.kind for r in self.resources() if r.namespaced))

    def groups(self) -> dict[str, list[str]]:
        """Group -> its served versions, the preferred one first."""
        out: dict[str, set[str]] = {}
        for r in self.resources():
            if r.group:
                out.setdefault(r.group, set()).add(r.version)
        return {g: sorted(vs, key=version_priority) for g, vs in sorted(out.items())}

    def has_status(self, kind: str) -> bool:
        """Only the status subresource (or a controller) changes ``kind``'s ``.status``."""
        return kind in STATUS_KINDS or (kind in self.custom and self.custom[kind].status)

    def generation_of(self, kind: str, obj: dict[str, Any]) -> Any:
        """What ``metadata.generation`` counts changes of (``NO_GENERATION`` if nothing)."""
        if kind in GENERATION_KINDS:
            return obj.get("spec")
        custom = self.custom.get(kind)
        if custom is None:
            return NO_GENERATION
        skip = ("apiVersion", "kind", "metadata") + (("status",) if custom.status else ())
        return {k: v for k, v in obj.items() if k not in skip}


NO_GENERATION = object()


def version_priority(version: str) -> tuple[Any, ...]:
    """Sort key of API versions as Kubernetes orders them: GA, beta, alpha, then others."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (3, version)
    rank = {None: 0, "beta": 1, "alpha": 2}[m[2]]
    return (rank, -int(m[1]), -int(m[3] or 0))


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
