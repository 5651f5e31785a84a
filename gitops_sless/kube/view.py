"""What one environment's namespace holds, read with one LIST per kind per pass.

Every question the planner asks between two reads (is it deployed, with which
spec, is it healthy) is answered from here, never with a GET per function.
Writes made during the pass update the view with the object the API server
returned, so the next round of the same pass sees them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ..renderer import ENV_LABEL, FUNCTION_HASH, FUNCTION_LABEL, MANAGED_BY, OBJECT_COUNT
from .client import KubeClient

__all__ = ["FUNCTION_KINDS", "View", "annotation", "label"]

# the long-running objects of a function; Jobs are runs, listed too but never "the function"
FUNCTION_KINDS = ("Deployment", "Service", "HTTPRoute", "CronJob")
# HTTPRoutes are listed with --gateway only: without, a cluster need not know the kind
LISTED = ("Deployment", "Service", "CronJob", "Job", "NetworkPolicy", "Function")


def label(obj: dict[str, Any], key: str) -> str | None:
    value = ((obj.get("metadata") or {}).get("labels") or {}).get(key)
    return str(value) if value is not None else None


def annotation(obj: dict[str, Any], key: str) -> str | None:
    value = ((obj.get("metadata") or {}).get("annotations") or {}).get(key)
    return str(value) if value is not None else None


class View:
    """The managed objects of one environment's namespace."""

    def __init__(self, env: str, namespace: str, kinds: Iterable[str] = LISTED) -> None:
        self.env = env
        self.namespace = namespace
        self.kinds = tuple(kinds)
        self.namespace_exists = False
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}  # (kind, name) -> object
        self._by_function: dict[str, set[tuple[str, str]]] = {}  # function -> its keys
        self.pods: list[dict[str, Any]] | None = None  # read only when some rollout is unsettled
        self._lock = threading.Lock()

    def read(self, client: KubeClient, namespaces: Iterable[str]) -> None:
        self.namespace_exists = self.namespace in namespaces
        with self._lock:  # the old read goes first: two copies of a big namespace is the peak
            self._objects, self._by_function = {}, {}
            self.pods = None
        if not self.namespace_exists:
            return
        selector = {MANAGED_BY: "gitops-sless", ENV_LABEL: self.env}
        for kind in self.kinds:
            objects = client.list(kind, self.namespace, selector)
            with self._lock:
                for obj in objects:
                    self._add(_compact(obj))

    def _add(self, obj: dict[str, Any]) -> None:
        key = (obj["kind"], obj["metadata"]["name"])
        self._objects[key] = obj
        function = label(obj, FUNCTION_LABEL)
        if function:
            self._by_function.setdefault(function, set()).add(key)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return self._objects.get((kind, name))

    def put(self, obj: dict[str, Any]) -> None:
        with self._lock:
            self._add(obj)

    def drop(self, kind: str, name: str) -> None:
        with self._lock:
            obj = self._objects.pop((kind, name), None)
            function = label(obj, FUNCTION_LABEL) if obj else None
            if function:
                self._by_function.get(function, set()).discard((kind, name))

    def all(self, kind: str) -> list[dict[str, Any]]:
        with self._lock:
            return [obj for (k, _), obj in self._objects.items() if k == kind]

    def of_function(self, name: str, kinds: Iterable[str] = FUNCTION_KINDS) -> list[dict[str, Any]]:
        wanted = set(kinds)
        with self._lock:
            keys = sorted(self._by_function.get(name, ()))
            return [self._objects[key] for key in keys if key[0] in wanted]

    def functions(self) -> set[str]:
        """Functions with running objects (a ``Function`` resource alone is not one)."""
        with self._lock:
            return {
                name
                for name, keys in self._by_function.items()
                if any(kind in FUNCTION_KINDS for kind, _ in keys)
            }

    def deployed(self) -> dict[str, str]:
        """function -> the spec hash its objects run; "" when they disagree or one is missing.

        An object edited by another field manager is drift: "" makes the
        planner apply the function again, which puts the object back. So is an
        image referenced by tag (written before images were pinned by digest).
        """
        out: dict[str, str] = {}
        for name in self.functions():
            objects = self.of_function(name)
            primary = self.primary(name)
            count = annotation(primary, OBJECT_COUNT) if primary else None
            whole = count == str(len(objects))
            clean = not any(drifted(obj) or not pinned(obj) for obj in objects)
            out[name] = (
                (annotation(primary, FUNCTION_HASH) or "") if primary and whole and clean else ""
            )
        return out

    def primary(self, name: str) -> dict[str, Any] | None:
        """The object that carries the function's spec hash and revision."""
        carriers = [o for o in self.of_function(name) if annotation(o, FUNCTION_HASH)]
        return carriers[0] if len(carriers) == 1 else None


def _compact(obj: dict[str, Any]) -> dict[str, Any]:
    """``managedFields`` cut to what :func:`drifted` reads: most of a listed object's size."""
    entries = (obj.get("metadata") or {}).get("managedFields")
    if entries:
        obj["metadata"]["managedFields"] = [
            {
                "manager": e.get("manager"),
                "subresource": e.get("subresource"),
                "fieldsV1": {"f:spec": {}} if "f:spec" in (e.get("fieldsV1") or {}) else {},
            }
            for e in entries
        ]
    return obj


def pinned(obj: dict[str, Any]) -> bool:
    """Every container of the object's pods names its image by digest (no pods: True)."""
    spec = obj.get("spec") or {}
    template = ((spec.get("jobTemplate") or {}).get("spec") or spec).get("template") or {}
    pod = template.get("spec") or {}
    containers = (pod.get("initContainers") or []) + (pod.get("containers") or [])
    return all("@sha256:" in str(c.get("image", "")) for c in containers)


def drifted(obj: dict[str, Any]) -> bool:
    """Another field manager changed the spec (``kubectl edit``, ``kubectl scale``)."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        # status is the controllers'; a scale subresource write is drift like any other
        if entry.get("subresource") == "status" or entry.get("manager") == "gitops-sless":
            continue
        if "f:spec" in (entry.get("fieldsV1") or {}):
            return True
    return False
