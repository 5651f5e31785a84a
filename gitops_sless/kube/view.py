"""What one environment's namespace holds, kept by one informer per kind (LIST, then WATCH).

Every question the planner asks between two reads (is it deployed, with which
spec, is it healthy) is answered from here, never with a GET per function, and
a pass in which nothing changed makes no request at all (see ``informer``).
Writes made during the pass update the view with the object the API server
returned, so the next round of the same pass sees them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .client import AUTOSCALER, KubeClient
from .informer import Informer
from .policy import RoutePolicy
from .renderer import ENV_LABEL, FUNCTION_HASH, MANAGED_BY, OBJECT_COUNT
from .units import unit_of

__all__ = ["FUNCTION_KINDS", "View", "annotation", "label"]

T = TypeVar("T")

# the long-running objects of a function; Jobs are runs, listed too but never "the function"
FUNCTION_KINDS = ("Deployment", "Service", "HTTPRoute", "CronJob")
# what a function's route is made of: a change to one of these publishes it again
SERVING_KINDS = ("Deployment", "Service")
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

    def __init__(
        self,
        env: str,
        namespace: str,
        kinds: Iterable[str] = LISTED,
        client: KubeClient | None = None,
        namespaces: Informer | None = None,
        **informer_options: Any,
    ) -> None:
        """``client``: where the informers read (None: a view only written to, for tests);
        ``namespaces``: the managed namespaces (shared by the views), where a namespace this
        view writes is put; ``informer_options``: passed to each :class:`Informer`."""
        self.env = env
        self.namespace = namespace
        self.kinds = tuple(kinds)
        self.namespace_exists = False
        self.namespaces = namespaces
        self._by_function: dict[str, set[tuple[str, str]]] = {}  # function -> its keys
        # what a pass derives from a function's objects, kept until one of them changes:
        # a no-change pass at 10,000 functions looks up, it does not recompute
        self._versions: dict[str, int] = {}  # function -> bumped by every change to its objects
        self._memo: dict[tuple[str, str], tuple[int, Any]] = {}
        self.version = 0  # bumped by every change to any cached object
        self.pods: list[dict[str, Any]] | None = None  # read only when some rollout is unsettled
        # told, outside the view's lock, which functions' Deployments or Services changed (by
        # a watch event, or a write of this process): their routes follow at once
        self.on_serving_change: Callable[[set[str]], None] | None = None
        self._serving_changed: set[str] = set()
        self._lock = threading.RLock()  # the informers' too: the index moves with the objects
        selector = {MANAGED_BY: "gitops-sless", ENV_LABEL: env}
        self._informers = {
            kind: Informer(
                client,  # type: ignore[arg-type]
                kind,
                namespace,
                selector,
                on_change=self._changed,
                after_change=self._after_change if kind in SERVING_KINDS else None,
                transform=_compact,
                lock=self._lock,
                **informer_options,
            )
            for kind in self.kinds
        }

    def sync(self) -> None:
        """Ready for a pass: each kind's cache fresh (a LIST only where it is not)."""
        if self.namespaces is not None:
            self.namespaces.sync()
            self.namespace_exists = self.namespaces.get(self.namespace) is not None
        self.pods = None
        if self.namespace_exists:  # an environment not created yet holds nothing to watch
            for informer in self._informers.values():
                informer.sync()

    def stop(self) -> None:
        for informer in self._informers.values():
            informer.stop()

    def cached(self) -> int:
        """Objects held in memory, all kinds together."""
        return sum(len(informer) for informer in self._informers.values())

    def relists(self) -> int:
        """LISTs made so far, all kinds together (the first one of each included)."""
        return sum(informer.relists for informer in self._informers.values())

    def _changed(self, new: dict[str, Any] | None, old: dict[str, Any] | None) -> None:
        self.version += 1
        for obj, add in ((old, False), (new, True)):
            function = unit_of(obj) if obj else None  # a function, or one of its revisions
            if not obj or not function:
                continue
            self._versions[function] = self._versions.get(function, 0) + 1
            key = (obj["kind"], obj["metadata"]["name"])
            if key[0] in SERVING_KINDS:
                self._serving_changed.add(function)
            if add:
                self._by_function.setdefault(function, set()).add(key)
            else:
                self._by_function.get(function, set()).discard(key)

    def _after_change(self) -> None:
        with self._lock:
            changed, self._serving_changed = self._serving_changed, set()
        listener = self.on_serving_change
        if changed and listener is not None:
            listener(changed)

    def memo_all(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()``, remembered until any cached object changes."""
        version = self.version
        hit = self._memo.get((key, ""))
        if hit is not None and hit[0] == version:
            return hit[1]  # type: ignore[no-any-return]
        value = compute()
        self._memo[(key, "")] = (version, value)
        return value

    def memo(self, key: str, function: str, compute: Callable[[], T]) -> T:
        """``compute()``, remembered for ``function`` until one of its objects changes."""
        version = self._versions.get(function, 0)  # read first: a change meanwhile is seen
        hit = self._memo.get((key, function))
        if hit is not None and hit[0] == version:
            return hit[1]  # type: ignore[no-any-return]
        value = compute()
        self._memo[(key, function)] = (version, value)
        return value

    def _informer(self, kind: str) -> Informer | None:
        return self._informers.get(kind)

    def informer(self, kind: str) -> Informer:
        """The informer of ``kind`` (one this view lists), to wait on its changes."""
        return self._informers[kind]

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        informer = self._informer(kind)
        return informer.get(name) if informer else None

    def put(self, obj: dict[str, Any]) -> None:
        if obj.get("kind") == "Namespace" and self.namespaces is not None:
            self.namespaces.put(obj)
            return
        informer = self._informer(obj["kind"])
        if informer is not None:
            informer.put(obj)

    def drop(self, kind: str, name: str) -> None:
        if kind == "Namespace" and self.namespaces is not None:
            self.namespaces.drop(name)
            return
        informer = self._informer(kind)
        if informer is not None:
            informer.drop(name)

    def all(self, kind: str) -> list[dict[str, Any]]:
        informer = self._informer(kind)
        return informer.items() if informer else []

    def of_function(self, name: str, kinds: Iterable[str] = FUNCTION_KINDS) -> list[dict[str, Any]]:
        wanted = set(kinds)
        with self._lock:
            keys = sorted(self._by_function.get(name, ()))
            found = (self.get(kind, obj) for kind, obj in keys if kind in wanted)
            return [obj for obj in found if obj is not None]

    def functions(self) -> set[str]:
        """Functions with running objects (a ``Function`` resource alone is not one; nor is
        a revision kept beside its function, ``name@id``: see :meth:`revisions`)."""
        with self._lock:
            return {
                name
                for name, keys in self._by_function.items()
                if "@" not in name and any(kind in FUNCTION_KINDS for kind, _ in keys)
            }

    def revisions(self, name: str) -> set[str]:
        """The units (``name@id``) of ``name``'s revisions that have objects here."""
        prefix = f"{name}@"
        with self._lock:
            return {
                unit for unit, keys in self._by_function.items() if unit.startswith(prefix) and keys
            }

    def deployed(self) -> dict[str, str]:
        """function -> the spec hash its objects run; "" when they disagree or one is missing.

        An object edited by another field manager is drift: "" makes the
        planner apply the function again, which puts the object back. So is an
        image referenced by tag (written before images were pinned by digest).
        """
        return {
            name: self.memo("deployed", name, lambda name=name: self._deployed(name))
            for name in self.functions()
        }

    def _deployed(self, name: str) -> str:
        objects = self.of_function(name)
        primary = self.primary(name)
        count = annotation(primary, OBJECT_COUNT) if primary else None
        whole = count == str(len(objects))
        clean = not any(drifted(obj) or not pinned(obj) for obj in objects)
        return (annotation(primary, FUNCTION_HASH) or "") if primary and whole and clean else ""

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
                "fieldsV1": _spec_owned((e.get("fieldsV1") or {}).get("f:spec")),
            }
            for e in entries
        ]
    return obj


def _spec_owned(spec: dict[str, Any] | None) -> dict[str, Any]:
    """An entry's ``f:spec``, cut to: none, replicas alone, or something."""
    if spec is None:
        return {}
    return {"f:spec": _REPLICAS if spec == _REPLICAS else {}}


_REPLICAS = {"f:replicas": {}}


def pinned(obj: dict[str, Any]) -> bool:
    """Every container of the object's pods names its image by digest (no pods: True)."""
    spec = obj.get("spec") or {}
    template = ((spec.get("jobTemplate") or {}).get("spec") or spec).get("template") or {}
    pod = template.get("spec") or {}
    containers = (pod.get("initContainers") or []) + (pod.get("containers") or [])
    return all("@sha256:" in str(c.get("image", "")) for c in containers)


_OURS = frozenset({"gitops-sless", AUTOSCALER})


def drifted(obj: dict[str, Any]) -> bool:
    """Another field manager changed the spec (``kubectl edit``, ``kubectl scale``).

    The replicas of an autoscaled Deployment are no apply's to put back (it leaves them
    out): whoever set them last, the autoscaler or ``kubectl scale``, is not drift."""
    autoscaled: bool | None = None
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        # status is the controllers'
        if entry.get("subresource") == "status" or entry.get("manager") in _OURS:
            continue
        spec = (entry.get("fieldsV1") or {}).get("f:spec")
        if spec is None:
            continue
        if spec == _REPLICAS:
            if autoscaled is None:
                policy = RoutePolicy.decode(obj)
                autoscaled = policy is not None and policy.scale is not None
            if autoscaled:
                continue
        return True
    return False
