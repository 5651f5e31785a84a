"""The Kubernetes backend: images built by kaniko, objects kept true by server-side apply.

Each environment is a namespace (``<prefix><env>``), kept in memory by one
informer per kind (:class:`View`: a LIST, then a WATCH); what is built,
deployed and finished is answered from it and from records in the cluster, so
the reconciler's state folder is only a cache here. Before every plan the
view is made fresh, which costs no request unless a watch failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import SlessError
from ..manifests.model import Function, Job
from ..plan.backend import ApplyFailed, Backend, CronRun, Deployment, EnvValue, Health, JobRecord
from ..source.snapshot import Snapshot
from ..state.routes import Route, RouteTable
from .activator import RouteSwitch
from .apply import Applier
from .builds import Builds
from .client import KubeClient, NotFound
from .cronruns import CronRuns
from .functions import FunctionWriter
from .gateway import gateway_url
from .informer import Informer
from .jobs import JobRunner, finished_runs
from .policy import RoutePolicy, initial_replicas, route_policy
from .renderer import ENV_LABEL, MANAGED_BY, RenderConfig, render_function
from .revisions import RevisionUnits
from .runs import is_run_pod, replica_logs
from .runtimeload import RuntimeLoad
from .starts import Starts
from .status import available_replicas, health, rolled_out
from .units import REVISION_OF, object_name, pod_selector, unit_of
from .view import FUNCTION_KINDS, LISTED, View

__all__ = ["KubeBackend"]

log = logging.getLogger(__name__)


class KubeBackend(RevisionUnits, Backend):
    publishes = True  # the Function resources
    rollouts = True  # a candidate's Deployment beside the function's (:mod:`.revisions`)
    trusted = True  # runs only what trusted builds pushed
    gateway_read_sec = 60.0  # how often the Gateway's address is read again (--gateway)
    informer_options: Mapping[str, Any] = {}  # Informer's watch and resync times (tests)
    # (env, name, "scaled", None) when a function goes between zero and a replica that serves
    # (serve wires it to the reconciler's follow-up pass, as the local backend's replicas do)
    on_replica_event: Callable[[str, str, str, str | None], None] | None = None

    def __init__(
        self,
        client: KubeClient,
        builds: Builds,
        config: RenderConfig,
        routes: RouteTable,
        route_for: Callable[[str, str, str, float], Route],
        on_cron: Callable[[CronRun], None] | None = None,
    ) -> None:
        """``route_for(env, name, namespace, timeout)``: the route the proxy takes to a
        function's Service (in the cluster: its DNS name; outside: the API server's proxy)."""
        self.client = client
        self.builds = builds
        self.config = config
        self.routes = routes
        self.route_for = route_for
        self.applier = Applier(client, config)
        self.jobs = JobRunner(client, config)
        self.functions = FunctionWriter(client, config)
        self.switch = RouteSwitch(client, config)  # --gateway: an idle function's route
        self.runtime_load = RuntimeLoad(client)  # what the runtimes report: busy()
        self._crd_missing = False
        self._namespaces: Informer | None = None
        self._views: dict[str, View] = {}
        self._job_only: dict[tuple[str, str], str] = {}  # functions with no objects -> hash
        self._published: dict[str, int] = {}  # env -> the view's version its routes are from
        self._cron_runs = CronRuns(client, on_cron)
        self._gateway_url: str | None = None
        self._gateway_read_at: float | None = None
        # (env, name) -> (replicas, resourceVersion) of a scale write the watch has not
        # brought back yet: a second identical write is not made meanwhile
        self._scaled: dict[tuple[str, str], tuple[int, int]] = {}
        self._zeroing: set[tuple[str, str]] = set()  # scaled to zero: no upstream any more
        self._awake: dict[tuple[str, str], tuple[bool, bool]] = {}  # see _scaled_event
        self.starts = Starts(
            client, self._republish, self._replicas, limit_sec=config.progress_deadline_sec
        )
        self._publishing = threading.Lock()  # one route computed and set at a time
        self._lock = threading.Lock()
        self._revisions_init()

    # --- reading -------------------------------------------------------------------------

    def view(self, env: str) -> View:
        with self._lock:
            if self._namespaces is None:
                self._namespaces = Informer(
                    self.client,
                    "Namespace",
                    None,
                    {MANAGED_BY: "gitops-sless"},
                    **self.informer_options,
                )
            if env not in self._views:
                kinds = (*LISTED, "HTTPRoute") if self.config.gateway else LISTED
                view = View(
                    env,
                    self.config.namespace(env),
                    kinds,
                    self.client,
                    self._namespaces,
                    **self.informer_options,
                )
                view.on_serving_change = lambda names, v=view: self._serving_changed(v, names)
                self._views[env] = view
            return self._views[env]

    def cached(self) -> int:
        """Objects the watches hold in memory (for the benchmark's per-object cost)."""
        with self._lock:
            views = list(self._views.values())
            namespaces = len(self._namespaces) if self._namespaces is not None else 0
        return namespaces + sum(view.cached() for view in views) + self.builds.cached()

    def refresh(self, env: str) -> None:
        """The view of ``env`` made fresh: no request when its watches are sound."""
        view = self.view(env)
        view.sync()
        if _needs_pods(view):
            view.pods = self.client.list(
                "Pod", view.namespace, {MANAGED_BY: "gitops-sless", ENV_LABEL: env}
            )
        self.applier.forget(env)
        self.builds.sync()
        self._publish_routes(view)
        self._end_bridges(view)
        self._cron_runs.report(view)
        self._read_gateway()

    def public_url(self) -> str | None:
        return self._gateway_url

    def _read_gateway(self) -> None:
        """The Gateway's address, read at most every ``gateway_read_sec``: it changes only
        when its load balancer does."""
        if not self.config.gateway:
            return
        now = time.monotonic()
        if (
            self._gateway_read_at is not None
            and now - self._gateway_read_at < self.gateway_read_sec
        ):
            return
        self._gateway_read_at = now
        namespace, name = self.config.gateway
        try:
            gateway = self.client.get("Gateway", namespace, name)
        except SlessError as exc:
            log.warning("Gateway %s/%s cannot be read: %s", namespace, name, exc)
            return
        url = gateway_url(gateway) if gateway else None
        if url != self._gateway_url:
            log.info("Gateway %s/%s: functions are public at %s", namespace, name, url or "-")
        if gateway is None:
            log.warning(
                "Gateway %s/%s does not exist: its HTTPRoutes attach to nothing", namespace, name
            )
        self._gateway_url = url

    def _publish_routes(self, view: View) -> None:
        """A route for every function with an available replica, or autoscaled (at zero:
        calls wait for a replica); 503 with its phase otherwise. Between passes a function's
        route follows its Deployment and Service as the watches report them
        (:meth:`_serving_changed`)."""
        if self._published.get(view.env) == view.version:
            return  # no Deployment or Service changed since: neither did a route
        names = {unit_of(d) for d in view.all("Deployment")}  # functions, revisions
        with self._publishing:
            serving = {name for name in names if name and self._publish(view, name)}
            for name in self.routes.names(view.env):
                if name not in serving:
                    self.routes.remove(view.env, name)
        for name in sorted(n for n in names if n):
            self._switch(view, name)
        self._published[view.env] = view.version

    def _serving_changed(self, view: View, names: set[str]) -> None:
        """Deployments or Services changed (a watch event, a write): their routes now, not
        at the next pass (a replica started for a waiting call serves it at once)."""
        if view.env not in self._published:
            return  # the first pass publishes every route
        with self._publishing:
            for name in names:
                if not self._publish(view, name):
                    self.routes.remove(view.env, name)
        for name in names:
            self._switch(view, name)
            self._scaled_event(view, name)

    def _switch(self, view: View, name: str) -> None:
        """With --gateway, the function's HTTPRoute to the reconciler while no replica
        serves, back to its Service once one does (:mod:`.activator`)."""
        if "@" in name:  # a revision's: its own route while it is warm
            self._revision_route(view, name)
            return
        with self._lock:
            zeroing = (view.env, name) in self._zeroing
        self.switch.follow(view, name, zeroing)

    def _scaled_event(self, view: View, name: str) -> None:
        """Tell the reconciler (the leader's) when the function's Deployment starts or stops
        asking for replicas, or gets or loses one that serves: Idle and Ready follow in the
        status store at once, not at the next pass."""
        live = view.get("Deployment", name)
        if live is None or self.on_replica_event is None:
            return
        now = (int((live.get("spec") or {}).get("replicas", 1)) > 0, available_replicas(live) > 0)
        with self._lock:
            before = self._awake.get((view.env, name))
            self._awake[(view.env, name)] = now
        if before != now and self.client.may_write():
            self.on_replica_event(view.env, name, "scaled", None)

    def _republish(self, view: View, name: str) -> None:
        self._serving_changed(view, {name})

    def _publish(self, view: View, name: str) -> bool:
        """The route of ``name`` as its objects say, set when it changed; False: none."""
        serving = view.memo("route", name, lambda: _serves(view, name))
        if serving is None:
            return False
        if (view.env, name) in self._zeroing and serving.available:
            serving = replace(serving, available=0)
        policy = serving.policy or RoutePolicy()
        failed, retry_at = (None, 0.0) if serving.available else self.starts.failure(view.env, name)
        said = (
            serving.timeout,
            serving.available,
            serving.available > 0,
            policy,
            failed,
            retry_at,
        )
        with self._lock:
            canary = self._canaries.get((view.env, name))
        said = (*said, canary)
        current = self.routes.get(view.env, name)
        if current is not None and _said(current) == said:
            return True  # the same route (a new object would be a new version to the proxy)
        made = self.route_for(view.env, object_name(name), view.namespace, serving.timeout)
        self.routes.set(
            replace(
                made,
                name=name,
                canary=canary,
                upstreams=made.upstreams if serving.available else (),
                available=serving.available,
                **policy.route_fields(),
                failed=failed,
                retry_at=retry_at,
            )
        )
        return True

    def health(self, env: str) -> Mapping[str, Health]:
        job_only = {name for (e, name) in self._job_only if e == env}
        return _Health(self.view(env), job_only)

    def report(
        self,
        env: str,
        records: list[dict[str, Any]],
        functions: Mapping[str, Function],
        runs: Callable[[], list[dict[str, Any]]],
    ) -> None:
        view = self.view(env)
        if self._crd_missing or not view.namespace_exists:
            return
        try:
            images = self.builds.images(self.trusted)
            with self._lock:
                shares = {n: s for (e, n), s in self._shares.items() if e == env}
            self.functions.write(view, records, functions, runs(), images, shares)
        except NotFound:
            self._crd_missing = True
            log.warning(
                "the Function CRD is not installed (kubectl apply -f deploy/crd-functions.yaml): "
                "no Function resources are written"
            )

    def job_runs(self, env: str) -> list[JobRecord]:
        return finished_runs(self.view(env))

    def function_log(self, env: str, name: str) -> str:
        namespace = self.config.namespace(env)
        kept = {MANAGED_BY: "gitops-sless", ENV_LABEL: env, REVISION_OF: name}  # a candidate too
        found = [*self.client.list("Pod", namespace, pod_selector(env, name))]
        found += self.client.list("Pod", namespace, kept)
        # job and cron runs carry the function's labels too: their output is the run's
        return replica_logs(self.client, namespace, [p for p in found if not is_run_pod(p)])

    # --- building ------------------------------------------------------------------------

    def is_built(self, fn: Function) -> bool:
        return self.builds.is_built(fn.build_tag, self.trusted)

    def build(self, fn: Function, snapshot: Snapshot) -> str:
        return self.builds.build(fn, snapshot, self.trusted)

    def image(self, fn: Function) -> str | None:
        return self.builds.image(fn.build_tag, self.trusted)

    def for_untrusted(self) -> KubeBackend:
        return _Untrusted(self)

    def _image(self, fn: Function) -> str:
        """The pinned image ``fn`` runs here; never a tag, which anyone may push again."""
        image = self.builds.image(fn.build_tag, self.trusted)
        if image is None:
            raise ApplyFailed(f"{fn.name}: no image of {fn.build_tag} is recorded yet")
        return image

    # --- running -------------------------------------------------------------------------

    def deployed(self, env: str) -> dict[str, str]:
        out = self.view(env).deployed()
        for (e, name), spec_hash in self._job_only.items():
            if e == env:
                out[name] = spec_hash
        return out

    def apply(self, deployment: Deployment, revision: str | None = None) -> None:
        view = self.view(deployment.env)
        self.applier.ensure_environment(view)
        image = self._image(deployment.function)
        objects = render_function(deployment, self.config, revision, image)
        before = view.get("Deployment", deployment.name)
        self.starts.forget(deployment.env, deployment.name)  # a new spec: a new try
        with self._lock:
            self._zeroing.discard((deployment.env, deployment.name))
        self.applier.apply(view, self.switch.moded(view, objects, False))
        self._initial_scale(deployment, before)
        self._switch(view, deployment.name)  # its replicas changed while it was written
        wanted = {(o["kind"], o["metadata"]["name"]) for o in objects}
        stale = [
            o
            for o in view.of_function(deployment.name)
            if (o["kind"], o["metadata"]["name"]) not in wanted
        ]
        self.applier.delete(view, stale)
        key = (deployment.env, deployment.name)
        with self._lock:
            if objects:
                self._job_only.pop(key, None)
            else:
                self._job_only[key] = deployment.spec_hash
        if view.pods is None and not all(rolled_out(d) for d in view.all("Deployment")):
            view.pods = []  # read on the next refresh; a fresh rollout has no pod problem yet

    def _initial_scale(self, deployment: Deployment, before: dict[str, Any] | None) -> None:
        """A Deployment that starts being autoscaled (new, or a fixed count before) runs
        :func:`initial_replicas` of it; one that was autoscaled keeps what the autoscaler
        set (a new version starts as many replicas as ran)."""
        fn = deployment.function
        policy = route_policy(fn, deployment.env).scale
        if policy is None or not fn.http:
            return
        was = RoutePolicy.decode(before) if before is not None else None
        if was is not None and was.scale is not None:
            return
        running = int((before.get("spec") or {}).get("replicas", 1)) if before else 0
        self.scale(deployment.env, deployment.name, initial_replicas(policy, running))

    def scale(self, env: str, name: str, replicas: int) -> None:
        """``replicas`` of the function's Deployment, through its scale subresource; no
        request when the Deployment has that many already."""
        view = self.view(env)
        self._stopping(view, name, replicas == 0)
        if self._replicas(view, name) != replicas:
            answer = self.client.scale("Deployment", view.namespace, object_name(name), replicas)
            with self._lock:
                self._scaled[(env, name)] = (replicas, _version(answer))
        live = view.get("Deployment", object_name(name))
        if replicas and live is not None and not available_replicas(live):
            self.starts.follow(view, name)  # a replica for a waiting call: does it start?

    def _stopping(self, view: View, name: str, stopping: bool) -> None:
        """Going to zero, the route loses its upstream before the replicas go (Knative puts
        its activator in the path first): a call that comes meanwhile waits for a new
        replica rather than reach one that is stopping."""
        key = (view.env, name)
        with self._lock:
            if (key in self._zeroing) == stopping:
                return
            if stopping:
                self._zeroing.add(key)
            else:
                self._zeroing.discard(key)
        self._republish(view, name)

    def _replicas(self, view: View, name: str) -> int:
        """The replicas the function's Deployment asks for: from the watch-fed view, else
        (not watched here: a replica that does not lead) read from its scale subresource."""
        known = object_name(name)
        if not view.informer("Deployment").fresh:
            found = self.client.read_scale("Deployment", view.namespace, known)
            if found is None:
                raise ApplyFailed(f"{name}: no Deployment {view.namespace}/{known} to scale")
            return int((found.get("spec") or {}).get("replicas") or 0)
        live = view.get("Deployment", known)
        if live is None:
            raise ApplyFailed(f"{name}: no Deployment {view.namespace}/{known} to scale")
        key = (view.env, name)
        with self._lock:
            written = self._scaled.get(key)
            if written is not None and _version(live) < written[1]:
                return written[0]  # the watch has not brought the write back yet
            self._scaled.pop(key, None)
        return int((live.get("spec") or {}).get("replicas", 1))

    def busy(self, env: str, name: str) -> float | None:
        """Call-seconds the function's pods report having served so far, summed, never going
        down (a pod restarted, deleted or replaced keeps what it had counted); None: no ready
        pod, or none answered (see :mod:`.runtimeload`)."""
        return self.runtime_load.busy(self.config.namespace(env), env, name)

    def remove(self, env: str, name: str) -> None:
        self.routes.remove(env, name)  # 404 at once, before the objects go
        view = self.view(env)
        self._drop_revisions(view, name)
        self.applier.delete(view, view.of_function(name, (*FUNCTION_KINDS, "Job")))
        with self._lock:
            self._job_only.pop((env, name), None)

    def remove_environment(self, env: str) -> None:
        """The namespace goes, with anything left in it (Jobs, Function resources)."""
        view = self.view(env)
        self.client.delete("Namespace", None, view.namespace)
        if self.config.gateway:
            self.switch.grants.remove(env)
        view.drop("Namespace", view.namespace)
        view.stop()
        with self._lock:
            self._views.pop(env, None)
            self._published.pop(env, None)
            self._job_only = {k: v for k, v in self._job_only.items() if k[0] != env}

    def close(self) -> None:
        """Stop every watch."""
        self.starts.close()
        self.runtime_load.close()
        with self._lock:
            views, self._views = list(self._views.values()), {}
            if self._namespaces is not None:
                self._namespaces.stop()
        for view in views:
            view.stop()
        self.builds.close()

    def run_job(self, env: str, fn: Function, job: Job, env_vars: Mapping[str, EnvValue]) -> str:
        view = self.view(env)
        self.applier.ensure_environment(view)
        return self.jobs.run(view, fn, job, env_vars, self._image(fn))


class _Untrusted(KubeBackend):
    """A :class:`KubeBackend` for environments running untrusted code: the same state (one
    view of the cluster), but its builds run apart, and it may run what they built."""

    trusted = False
    build_scope = "untrusted"

    def __init__(self, backend: KubeBackend) -> None:
        self.__dict__ = backend.__dict__  # views, routes, locks: one backend seen two ways


_NOTHING_TO_RUN = Health("Ready")


class _Health(Mapping[str, Health]):
    """Each function's health, worked out when asked: one lookup costs one function."""

    def __init__(self, view: View, job_only: set[str]) -> None:
        self.view = view
        # applied functions with no object of their own (jobs only): nothing starts, so
        # they are Ready once applied, as on the local backend; their runs say the rest
        self._job_only = job_only - view.functions()
        self._names = view.functions() | self._job_only

    def __getitem__(self, name: str) -> Health:
        found = self._health(name) if name in self._names else None
        if found is None:
            raise KeyError(name)
        return found

    def get(self, name: str, default: Any = None) -> Any:  # no KeyError per unknown name
        found = self._health(name) if name in self._names else None
        return default if found is None else found

    def _health(self, name: str) -> Health | None:
        if name in self._job_only:
            return _NOTHING_TO_RUN
        if self.view.pods is not None:  # a rollout under way: what the pods say now
            return health(self.view, name)
        return self.view.memo("health", name, lambda: health(self.view, name))

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def __len__(self) -> int:
        return len(self._names)


def _needs_pods(view: View) -> bool:
    """Some rollout is not done (``status.needs_pods``), answered again after a change."""
    return bool(_unsettled(view))


def _unsettled(view: View) -> list[str]:
    """The functions whose Deployment has not rolled out."""

    def find() -> list[str]:
        return [
            unit_of(d) or d["metadata"]["name"] for d in view.all("Deployment") if not rolled_out(d)
        ]

    return view.memo_all("unsettled", find)


@dataclass(frozen=True)
class _Serving:
    """What a function's route is made of, from its Deployment."""

    available: int
    timeout: float
    policy: RoutePolicy | None


def _serves(view: View, name: str) -> _Serving | None:
    """How a function serves; None without its Service, or without an available replica
    unless it is autoscaled (at zero, calls wait for one)."""
    deployment = view.get("Deployment", object_name(name))
    if deployment is None or view.get("Service", object_name(name)) is None:
        return None
    policy = RoutePolicy.decode(deployment)
    available = available_replicas(deployment)
    if not available and (policy is None or policy.scale is None):
        return None
    return _Serving(available, _timeout(deployment), policy)


def _said(route: Route) -> tuple[Any, ...]:
    """What a route says that its function's objects decide (see ``_publish``)."""
    return (
        route.timeout_sec,
        route.available,
        bool(route.upstreams),
        RoutePolicy.of(route),
        route.failed,
        route.retry_at,
        route.canary,
    )


def _version(obj: dict[str, Any]) -> int:
    text = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    return int(text) if text.isdigit() else -1


def _timeout(deployment: dict[str, Any]) -> float:
    containers = deployment["spec"]["template"]["spec"].get("containers") or [{}]
    for var in containers[0].get("env") or []:
        if var.get("name") == "SLESS_TIMEOUT_SEC":
            try:
                return float(var.get("value") or 30)
            except ValueError:
                break
    return 30.0
