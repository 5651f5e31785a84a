"""What a replica that does not lead serves from: the ``Function`` resources, by watch.

Every replica answers the API and proxies ``/fn/``. The leader's status store
is written by its reconciler; the others copy the ``Function`` resources the
leader writes into their own store and routing table, through one LIST and
then a WATCH (never a request per call). A replica is ready once that first
LIST is in.

Every replica is an activator: an ``Idle`` function keeps its route here too,
with no upstream and its policy (``gitops-sless.dev/route`` on the Function
resource), so the proxy holds a call and asks for a replica (any replica may
scale a function); the upstream comes when the leader says ``Ready``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch as k8s_watch

from ..state.routes import Declared, Route, RouteTable
from ..state.store import Store
from ..timestamps import epoch
from .client import KubeClient
from .functions import async_policy
from .policy import RoutePolicy
from .renderer import ENV_LABEL, MANAGED_BY

__all__ = ["FunctionMirror"]

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "gitops-sless.dev", "v1alpha1", "functions"
WATCH_SEC = 30
# an autoscaled function keeps its route without upstream in these: Idle, then Pending while
# the replica a call asked for starts (Building: a new version, while the old one is at zero)
_WAKING = ("Idle", "Pending", "Building")


def _ready(status: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


class FunctionMirror:
    def __init__(
        self,
        client: KubeClient,
        store: Store,
        routes: RouteTable,
        route_for: Callable[[str, str, str, float], Route],
        leading: Callable[[], bool],
    ) -> None:
        self.client = client
        self.store = store
        self.routes = routes
        self.route_for = route_for
        self.leading = leading
        self.synced = threading.Event()
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}  # (env, name) -> Function
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sless-mirror", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        api = k8s.CustomObjectsApi(self.client.api)
        selector = f"{MANAGED_BY}=gitops-sless"
        version: str | None = None
        while not self._stop.is_set():
            if self.leading():  # the reconciler writes this replica's store and routes
                version = None
                self._stop.wait(1)
                continue
            try:
                if version is None:
                    listed = api.list_cluster_custom_object(
                        GROUP, VERSION, PLURAL, label_selector=selector
                    )
                    self._replace(listed.get("items") or [])
                    version = listed["metadata"]["resourceVersion"]
                    self.synced.set()
                stream = k8s_watch.Watch().stream(
                    api.list_cluster_custom_object,
                    GROUP,
                    VERSION,
                    PLURAL,
                    label_selector=selector,
                    resource_version=version,
                    timeout_seconds=WATCH_SEC,
                )
                for event in stream:
                    if self._stop.is_set() or self.leading():
                        break
                    obj = event["object"]
                    version = obj["metadata"].get("resourceVersion") or version
                    if event["type"] == "DELETED":
                        self._forget(obj)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self._apply(obj)
                    self._publish()
            except Exception as exc:  # a watch that ends badly is started again from a LIST
                log.debug("Function watch: %s", exc)
                version = None
                self._stop.wait(1)

    def _replace(self, items: list[dict[str, Any]]) -> None:
        seen = set()
        for obj in items:
            seen.add(self._apply(obj))
        for key in set(self._objects) - seen:
            self._forget(self._objects[key])
        self._publish()

    def _apply(self, obj: dict[str, Any]) -> tuple[str, str]:
        env = (obj["metadata"].get("labels") or {}).get(ENV_LABEL, "")
        name = obj["metadata"]["name"]
        self._objects[(env, name)] = obj
        status = obj.get("status") or {}
        if status.get("phase"):
            self.store.set_function(
                env,
                name,
                updated=epoch(status.get("updated")) or time.time(),
                phase=status["phase"],
                build_tag=status.get("buildTag"),
                revision=status.get("revision"),
                url=status.get("url"),
                message=status.get("message"),
                manifest=(obj.get("spec") or {}).get("manifest"),
                restarts=int(status.get("restarts") or 0),
                last_exit=status.get("lastExit"),
                serving_revision=status.get("servingRevision"),
                pinned=status.get("pinned"),
            )
        for run in status.get("jobs") or []:
            self.store.set_job_run(
                env,
                run["name"],
                int(run["runId"]),
                function=name,
                phase=run["phase"],
                result=run.get("result"),
                finished=epoch(run.get("finished")),
            )
        return env, name

    def _forget(self, obj: dict[str, Any]) -> None:
        env = (obj["metadata"].get("labels") or {}).get(ENV_LABEL, "")
        name = obj["metadata"]["name"]
        self._objects.pop((env, name), None)
        self.store.delete_function(env, name)
        self.routes.remove(env, name)

    def _route(self, env: str, name: str, obj: dict[str, Any]) -> bool:
        """Set the route of a Ready function, or of an Idle one (no upstream: a call waits
        for the replica it wakes); False: it has none."""
        spec, status = obj.get("spec") or {}, obj.get("status") or {}
        policy = RoutePolicy.decode(obj) or RoutePolicy()
        serving = status.get("phase") == "Ready" and _ready(status)
        if not serving and not (status.get("phase") in _WAKING and policy.scale is not None):
            return False
        timeout = float(spec.get("timeoutSec") or 30)
        said = (timeout, serving, policy)
        current = self.routes.get(env, name)
        if current is not None and _said(current) == said:
            return True  # the same route (a new object would be a new version to the proxy)
        made = self.route_for(env, name, obj["metadata"]["namespace"], timeout)
        self.routes.set(
            replace(
                made,
                upstreams=made.upstreams if serving else (),
                **policy.route_fields(),
            )
        )
        return True

    def _publish(self) -> None:
        by_env: dict[str, dict[str, Declared]] = {}
        for (env, name), obj in self._objects.items():
            spec, status = obj.get("spec") or {}, obj.get("status") or {}
            http = bool(spec.get("http")) or status.get("phase") == "Invalid"
            by_env.setdefault(env, {})[name] = Declared(
                status.get("phase") or "Pending",
                status.get("message"),
                http,
                async_policy(spec),
                tuple(spec.get("subjects") or ()),
            )
            if not (spec.get("http") and self._route(env, name, obj)):
                self.routes.remove(env, name)
        for env, declared in by_env.items():
            self.routes.declare(env, declared)


def _said(route: Route) -> tuple[Any, ...]:
    """What a route says that its Function resource decides (see ``_route``)."""
    return (route.timeout_sec, bool(route.upstreams), RoutePolicy.of(route))
