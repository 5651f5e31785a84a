"""With ``--gateway``, an idle function's HTTPRoute sends its calls to the reconciler.

Knative's serverless service has two modes: *proxy*, where the activator sits in the
path of a revision at zero and holds a call while a replica starts, and *serve*, where
the gateway sends calls straight to the replicas. Here the HTTPRoute of an autoscaled
function with no available replica sends ``/fn/{env}/{name}/...`` unchanged to the
reconciler's Service (whose proxy holds the call and wakes the function); once a
replica serves, the route is the one the template renders, straight to the function's
Service. Going to zero, the route changes before the replicas go.

Both modes carry the spec hash of the serving route and are written by the same field
manager, so the applier sees an unchanged route in either and a pass with no change
writes nothing; the switch is made by the leader, from the watch of the Deployments.

A route may name a Service of another namespace only where a ReferenceGrant there
allows it: the reconciler keeps one per environment in its own namespace (a grant's
``from`` holds at most 16 entries, and previews come and go).
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

from ..errors import SlessError
from .client import KubeClient
from .policy import RoutePolicy
from .renderer import ENV_LABEL, MANAGED_BY, SPEC_HASH, RenderConfig, render_http_route
from .status import available_replicas
from .view import View, annotation

__all__ = [
    "Grants",
    "RouteSwitch",
    "activator_route",
    "reference_grant",
    "rendered_timeout",
    "to_activator",
]

log = logging.getLogger(__name__)

GROUP = "gateway.networking.k8s.io"
RECONCILER_PORT = 80  # deploy/service.yaml


def to_activator(route: dict[str, Any], config: RenderConfig) -> bool:
    """Does ``route`` send its calls to the reconciler's Service?"""
    wanted = (config.controller_namespace, config.reconciler_service)
    return any(
        (ref.get("namespace"), ref.get("name")) == wanted
        for rule in (route.get("spec") or {}).get("rules") or []
        for ref in rule.get("backendRefs") or []
    )


def activator_route(route: dict[str, Any], config: RenderConfig) -> dict[str, Any]:
    """``route`` (as rendered) sending its calls to the reconciler's Service, the path as
    the client sent it (the reconciler serves ``/fn/{env}/{name}/...`` itself and sets
    its own X-Forwarded-Prefix): no filters; the spec hash annotation is kept."""
    switched = copy.deepcopy(route)
    backend = {
        "kind": "Service",
        "namespace": config.controller_namespace,
        "name": config.reconciler_service,
        "port": RECONCILER_PORT,
    }
    for rule in switched["spec"]["rules"]:
        rule.pop("filters", None)
        rule["backendRefs"] = [dict(backend)]
    return switched


def reference_grant(env: str, config: RenderConfig) -> dict[str, Any]:
    """The grant letting the HTTPRoutes of ``env`` name the reconciler's Service."""
    return {
        "apiVersion": f"{GROUP}/v1beta1",
        "kind": "ReferenceGrant",
        "metadata": {
            "name": config.namespace(env),
            "namespace": config.controller_namespace,
            "labels": {MANAGED_BY: "gitops-sless", ENV_LABEL: env},
        },
        "spec": {
            "from": [{"group": GROUP, "kind": "HTTPRoute", "namespace": config.namespace(env)}],
            "to": [{"group": "", "kind": "Service", "name": config.reconciler_service}],
        },
    }


class Grants:
    """The ReferenceGrants of the environments: listed once, then written only when one
    is missing or differs, deleted with its environment."""

    def __init__(self, client: KubeClient, config: RenderConfig) -> None:
        self.client = client
        self.config = config
        self._live: dict[str, dict[str, Any]] | None = None  # name -> spec
        self._lock = threading.Lock()

    def ensure(self, env: str) -> None:
        grant = reference_grant(env, self.config)
        name = grant["metadata"]["name"]
        with self._lock:
            live = self._read()
            if live.get(name) == grant["spec"]:
                return
            self.client.apply(grant)
            live[name] = grant["spec"]

    def remove(self, env: str) -> None:
        name = self.config.namespace(env)
        with self._lock:
            live = self._read()
            if name in live:
                self.client.delete("ReferenceGrant", self.config.controller_namespace, name)
                live.pop(name)

    def _read(self) -> dict[str, dict[str, Any]]:
        if self._live is None:
            found = self.client.list(
                "ReferenceGrant", self.config.controller_namespace, {MANAGED_BY: "gitops-sless"}
            )
            self._live = {g["metadata"]["name"]: g.get("spec") or {} for g in found}
        return self._live


class RouteSwitch:
    """Puts an autoscaled function's HTTPRoute in the mode its replicas call for."""

    def __init__(self, client: KubeClient, config: RenderConfig) -> None:
        self.client = client
        self.config = config
        self.grants = Grants(client, config)
        self._lock = threading.Lock()  # one route computed and written at a time

    def moded(
        self, view: View, objects: list[dict[str, Any]], zeroing: bool
    ) -> list[dict[str, Any]]:
        """A function's rendered objects, its HTTPRoute in the mode it is applied in: to
        the reconciler when autoscaled (the rendered Deployment) with no replica serving
        (the live one)."""
        if not self.config.gateway:
            return objects
        rendered = next((o for o in objects if o["kind"] == "Deployment"), None)
        if rendered is None:
            return objects
        live = view.get("Deployment", rendered["metadata"]["name"])
        idle = _idle(rendered, live, zeroing)
        if idle:
            self.grants.ensure(view.env)
        return [
            activator_route(o, self.config) if o["kind"] == "HTTPRoute" and idle else o
            for o in objects
        ]

    def follow(self, view: View, name: str, zeroing: bool) -> None:
        """The route of ``name`` switched when its replicas say so (the leader's only)."""
        if not self.config.gateway or not self.client.may_write():
            return
        try:
            with self._lock:
                self._follow(view, name, zeroing)
        except SlessError as exc:
            log.warning("HTTPRoute %s/%s: not switched: %s", view.namespace, name, exc)

    def _follow(self, view: View, name: str, zeroing: bool) -> None:
        route, deployment = view.get("HTTPRoute", name), view.get("Deployment", name)
        if route is None or deployment is None:
            return  # the apply writes it, in its mode
        idle = _idle(deployment, deployment, zeroing)
        if to_activator(route, self.config) == idle:
            return
        wanted = render_http_route(view.env, name, rendered_timeout(deployment), self.config)
        if annotation(route, SPEC_HASH) != annotation(wanted, SPEC_HASH):
            return  # a new spec on its way: its apply writes the route in its mode
        if idle:
            self.grants.ensure(view.env)
            wanted = activator_route(wanted, self.config)
        log.info("HTTPRoute %s/%s: to the %s", view.namespace, name, _mode(idle))
        view.put(self.client.apply(wanted))


def _idle(rendered: dict[str, Any], live: dict[str, Any] | None, zeroing: bool) -> bool:
    policy = RoutePolicy.decode(rendered)
    if policy is None or policy.scale is None:
        return False
    return zeroing or live is None or available_replicas(live) == 0


def _mode(idle: bool) -> str:
    return "reconciler (no replica serves)" if idle else "function's Service"


def rendered_timeout(deployment: dict[str, Any]) -> str:
    """The HTTPRoute request timeout the Deployment was rendered with (the renderer's
    ``route_timeout``): its function's timeout, and its stream's maxSec if it names one."""
    containers = deployment["spec"]["template"]["spec"].get("containers") or [{}]
    given = {var.get("name"): var.get("value") for var in containers[0].get("env") or []}
    timeout = str(given.get("SLESS_TIMEOUT_SEC") or "30")
    stream = given.get("SLESS_STREAM_MAX_SEC")
    if stream and timeout.isdigit() and str(stream).isdigit():
        return str(int(timeout) + int(stream))
    return timeout
