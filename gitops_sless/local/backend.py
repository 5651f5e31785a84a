"""The local backend: artifacts on disk, runtime processes on loopback, cron with APScheduler.

One command on a laptop serves a functions repository: no cluster, no images.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import logs
from ..errordetail import DEFAULT as DEFAULT_ERROR_DETAILS
from ..errordetail import ErrorDetails
from ..manifests import runtimes
from ..manifests.model import Function, Job, SecretRef, is_preview
from ..plan.backend import (
    ApplyFailed,
    Backend,
    CronRun,
    Deployment,
    EnvValue,
    Health,
    JobFailed,
    SecretUnavailable,
)
from ..source.snapshot import Snapshot
from ..state.routes import Canary, Route, RouteTable
from ..telemetry.tracecontext import child_traceparent
from . import builder as local_builder
from .processes import Supervisor
from .revisions import RevisionUnits
from .sandbox import Sandbox
from .scheduler import CronScheduler
from .secrets import SecretsDir
from .triggers import HttpTrigger, trigger
from .units import ProcessSpec, ReplicaEvent, UnitStatus

__all__ = ["CronRun", "LocalBackend"]

log = logging.getLogger(__name__)


class LocalBackend(RevisionUnits, Backend):
    rollouts = True

    def __init__(
        self,
        state_dir: Path,
        routes: RouteTable,
        secrets: SecretsDir,
        max_builds: int = 2,
        build_timeout_sec: float = 600,
        on_cron: Callable[[CronRun], None] | None = None,
        on_replica_event: ReplicaEvent | None = None,
        preview_secrets: SecretsDir | None = None,
        sandbox: Sandbox | None = None,
        error_details: ErrorDetails = DEFAULT_ERROR_DETAILS,
        adopt: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """``on_replica_event(env, function, kind, reason)``: kind "exited" when a replica
        ended on its own (reason "OOMKilled: ..." or "exited with code N"), "recovered"
        when restarts brought the function back to its replicas (reason None).

        ``secrets`` serve the tracked branch's environment, ``preview_secrets`` the
        previews (``pr-*``); without them a preview resolves no secret at all.

        ``adopt``: what :meth:`hand_over` returned before this process re-executed
        itself; those replicas serve on (see ``adoption``)."""
        self.routes = routes
        self.secrets = secrets
        self.error_details = error_details
        self.preview_secrets = preview_secrets or SecretsDir(None, previews=True)
        self.builder = local_builder.LocalBuilder(
            state_dir / "artifacts",
            max_concurrent=max_builds,
            timeout_sec=build_timeout_sec,
            sandbox=sandbox,
        )
        # what the route of each http function says besides its upstreams
        self._http: dict[tuple[str, str], HttpTrigger] = {}
        self._on_cron = on_cron
        self.supervisor = Supervisor(
            state_dir,
            self._upstreams_changed,
            on_replica_event=on_replica_event,
            sandbox=sandbox,
            adopt=adopt,
        )
        self.crons = CronScheduler()
        self._canaries: dict[tuple[str, str], Canary] = {}  # rollouts under way
        # (env, function) -> the units of its kept revisions and candidate (name@id): kept
        # here, so that a deploy never lists every unit; adopted ones from the start
        self._revision_units: dict[tuple[str, str], set[str]] = {}
        for env, unit in self.supervisor.unit_keys():
            if "@" in unit:
                self._revision_units.setdefault((env, unit.partition("@")[0]), set()).add(unit)
        self._health: dict[str, tuple[int, dict[str, Health]]] = {}

    # --- building ---------------------------------------------------------------------

    def for_untrusted(self) -> LocalBackend:
        return _Untrusted(self)

    def is_built(self, fn: Function) -> bool:
        return self.builder.is_built(fn.build_tag)

    def build(self, fn: Function, snapshot: Snapshot) -> str:
        return self.builder.build(fn, snapshot).log

    # --- running ------------------------------------------------------------------------

    def _process_spec(
        self, env: str, fn: Function, env_vars: Mapping[str, EnvValue]
    ) -> ProcessSpec:
        secrets = self.secrets_for(env)
        resolved = {
            name: secrets.resolve(value) if isinstance(value, SecretRef) else value
            for name, value in env_vars.items()
        }
        return ProcessSpec(
            env_name=env,
            function=fn.name,
            runtime=runtimes.get(fn.runtime),
            entrypoint=fn.entrypoint,
            artifact=self.builder.path(fn.build_tag),
            timeout_sec=fn.timeout_sec,
            env_vars={**resolved, **fn.runtime_env(), **self.error_details.runtime_env(env)},
            memory_mb=fn.memory_mb,
            max_processes=fn.max_processes,
            stop_grace_sec=float(fn.stop_grace_sec) if fn.drain_sec else None,
        )

    def _upstreams_changed(
        self,
        env: str,
        name: str,
        upstreams: tuple[tuple[str, int], ...],
        last_exit: str | None,
        replica_key: str,
    ) -> None:
        http = self._http.get((env, name))
        if http is None:
            self.routes.remove(env, name)
        else:
            self.routes.set(self._route(env, name, http, upstreams, last_exit, replica_key))

    def _route(
        self,
        env: str,
        name: str,
        http: HttpTrigger,
        upstreams: tuple[tuple[str, int], ...],
        last_exit: str | None,
        replica_key: str,
        starting: bool = False,
    ) -> Route:
        failed = self.supervisor.start_failure(env, name)
        return Route(
            env,
            name,
            http.timeout_sec,
            upstreams,
            last_exit=last_exit,
            same_origin=http.same_origin,
            proof=b"x-sless-replica: " + replica_key.encode("ascii") + b"\r\n",
            scale=http.scale,
            concurrency=http.concurrency,
            rate_limit=http.rate_limit,
            max_body_bytes=http.max_body_bytes,
            runtime=http.runtime,
            websocket=http.websocket,
            plain=http.plain,
            body_streamed=http.body_streamed,
            stream_idle_sec=http.stream_idle_sec,
            stream_max_sec=http.stream_max_sec,
            failed=failed[0] if failed else None,
            retry_at=failed[1] if failed else 0.0,
            starting=starting,
            canary=self._canaries.get((env, name)),
        )

    def tags_in_use(self) -> set[str]:
        """Build tags a deployed function or a running process uses: never collected."""
        return {path.name for path in self.supervisor.artifacts_in_use()}

    def deployed(self, env: str) -> dict[str, str]:
        # a kept revision's replicas (name@revision) are not a function of their own
        return {n: h for n, h in self.supervisor.deployed(env).items() if "@" not in n}

    def health(self, env: str) -> dict[str, Health]:
        version = self.supervisor.version
        cached = self._health.get(env)
        if cached is None or cached[0] != version:  # a pass asks twice, every poll
            cached = (
                version,
                {
                    n: _health(u, self._http.get((env, n)))
                    for n, u in self.supervisor.status(env).items()
                    if "@" not in n
                },
            )
            self._health[env] = cached
        return cached[1]

    def settling(self, env: str) -> bool:
        return False  # a replica is healthy before apply returns; one that ends says so

    def health_version(self, env: str) -> object:
        return self.supervisor.version

    def secrets_for(self, env: str) -> SecretsDir:
        """The scope ``env`` resolves from: a preview never reads production's secrets."""
        return self.preview_secrets if is_preview(env) else self.secrets

    def unavailable(self, env: str, env_vars: Mapping[str, EnvValue]) -> str | None:
        secrets = self.secrets_for(env)
        try:
            for value in env_vars.values():
                if isinstance(value, SecretRef):
                    secrets.resolve(value)
        except SecretUnavailable as exc:
            return str(exc)
        return None

    def apply(self, deployment: Deployment, revision: str | None = None) -> None:
        fn, env = deployment.function, deployment.env
        spec = self._process_spec(env, fn, deployment.env_vars)
        self._set_trigger(env, fn)
        replicas = self._initial_replicas(env, fn)
        try:
            self.supervisor.apply(spec, deployment.spec_hash, replicas)
        except ApplyFailed:
            route = self.routes.get(env, fn.name)
            if route is not None and route.starting:  # no start to wait for any more: 503
                key = self.supervisor.replica_key(env, fn.name)
                self._upstreams_changed(env, fn.name, (), None, key)
            raise
        self._schedule(spec, fn)

    def _initial_replicas(self, env: str, fn: Function) -> int:
        policy = fn.scale_in(env)
        if not (fn.enabled and fn.http):
            return 0
        if not policy.autoscaled:
            return policy.min
        # a new version starts as many as run now, and one at least (Knative's initial
        # scale): the deploy shows that it starts; idle, it goes to zero
        running = self.supervisor.status(env).get(fn.name)
        now = running.wanted if running else 0
        return min(max(now, policy.min, 1), policy.max)

    def adopt(self, deployment: Deployment) -> None:
        fn, env = deployment.function, deployment.env
        spec = self._process_spec(env, fn, deployment.env_vars)
        self._set_trigger(env, fn)
        if not self.supervisor.adopt_spec(spec, deployment.spec_hash):
            self.apply(deployment)  # gone meanwhile: started as usual
            return
        self._schedule(spec, fn)

    def restoring(self, deployment: Deployment) -> None:
        fn, env = deployment.function, deployment.env
        self._set_trigger(env, fn)
        http = self._http.get((env, fn.name))
        if http is None or not fn.enabled or self.routes.get(env, fn.name) is not None:
            return
        # calls wait for the start (apply publishes the route with its upstreams); they
        # carry the key the replicas about to start will ask for
        key = self.supervisor.replica_key(env, fn.name)
        self.routes.set(self._route(env, fn.name, http, (), None, key, starting=True))

    def _set_trigger(self, env: str, fn: Function) -> None:
        """What ``fn``'s route says besides its upstreams, from now on."""
        if not fn.http:
            self._http.pop((env, fn.name), None)
            return
        policy = fn.scale_in(env)
        self._http[(env, fn.name)] = trigger(
            fn, policy if policy.autoscaled and fn.enabled else None
        )

    def _schedule(self, spec: ProcessSpec, fn: Function) -> None:
        triggers = [(c.schedule, c.event) for c in fn.crons] if fn.enabled else []
        schedules = [schedule for schedule, _ in triggers]
        self.crons.set(spec.env_name, fn.name, triggers, self._cron_firing(spec, schedules))

    def _cron_firing(
        self, spec: ProcessSpec, schedules: list[str]
    ) -> Callable[[int, Mapping[str, Any]], None]:
        def fire(index: int, event: Mapping[str, Any]) -> None:
            started = time.monotonic()
            failed: str | None = None  # why, in the reconciler's words
            traceparent = child_traceparent(None)  # each run a trace of its own
            trace = {"SLESS_TRACEPARENT": traceparent, "SLESS_REQUEST_ID": traceparent[36:52]}
            try:
                output = self.supervisor.run_once(spec, event, spec.timeout_sec, trace)
            except JobFailed as exc:
                output, failed = str(exc), exc.summary
            ok = failed is None
            if not ok and self.supervisor.closing:
                return  # stopped by the shutdown, or never started: not a run of the trigger
            elapsed = (time.monotonic() - started) * 1000
            if not ok:  # what it printed goes to its log, read through the API
                self.supervisor.note(spec.env_name, spec.function, f"cron run failed: {output}")
            _log_cron(spec, schedules[index], elapsed, failed, traceparent[3:35])
            if self._on_cron:
                self._on_cron(CronRun(spec.env_name, spec.function, index, ok, elapsed, output))

        return fire

    def scale(self, env: str, name: str, replicas: int) -> None:
        self.supervisor.scale(env, name, replicas)

    def remove(self, env: str, name: str) -> None:
        self._http.pop((env, name), None)
        self._canaries.pop((env, name), None)
        self.routes.set_revisions(env, name, {})
        self.routes.remove(env, name)  # the route goes first: 404 at once, never 502
        self.crons.remove(env, name)
        self.supervisor.remove(env, name)
        self._drop_revisions(env, name)

    def remove_environment(self, env: str) -> None:
        self.supervisor.remove_environment(env)  # a job a teardown interrupts ends too
        self._revision_units = {k: v for k, v in self._revision_units.items() if k[0] != env}
        self._canaries = {k: v for k, v in self._canaries.items() if k[0] != env}

    def run_job(self, env: str, fn: Function, job: Job, env_vars: Mapping[str, EnvValue]) -> str:
        spec = self._process_spec(env, fn, env_vars)
        return self.supervisor.run_once(spec, job.event, fn.timeout_sec)

    def close(self) -> None:
        # installers first: a pip left running would write for minutes after the stop
        self.builder.close()
        self.crons.close()
        self.supervisor.close()

    def hand_over(self) -> list[dict[str, Any]]:
        """Builds, cron runs and jobs stop as in :meth:`close`; replicas serve on."""
        self.builder.close()
        self.crons.close()
        return self.supervisor.hand_over()


class _Untrusted(LocalBackend):
    """A :class:`LocalBackend` for environments running untrusted code (a fork's preview):
    the same builder, processes and routes, but its builds are recorded in a scope of their
    own, so one that fails never holds back a trusted environment's build of the same tag.
    (Artifacts stay shared: the same tag is the same files, installed the same way.)"""

    build_scope = "untrusted"

    def __init__(self, backend: LocalBackend) -> None:
        self.__dict__ = backend.__dict__  # one backend seen two ways


def _log_cron(
    spec: ProcessSpec, schedule: str, elapsed_ms: float, failed: str | None, trace_id: str
) -> None:
    """One line a person reads: which schedule ran, and how it went in words; ``failed``:
    why, as the reconciler saw it (never what the function printed or returned)."""
    ok = failed is None
    outcome = "succeeded" if ok else "failed"
    said = f'cron "{schedule}" {outcome} in {elapsed_ms:.0f} ms (trace {trace_id})'
    if failed is not None:
        where = f"/api/v1/environments/{spec.env_name}/functions/{spec.function}/logs"
        said += f": {failed}; what it printed is in the function's log (GET {where})"
    logs.event(
        log,
        f"cron.{outcome}",
        said,
        level=logging.INFO if ok else logging.WARNING,
        env=spec.env_name,
        function=spec.function,
    )


def _health(unit: UnitStatus, http: HttpTrigger | None) -> Health:
    """A function whose replicas keep ending with none healthy is Failed (CrashLoopBackOff),
    as on Kubernetes; an autoscaled one at zero replicas is Idle."""
    # no countdown in the message: it would change the record on every pass
    ended = f"a replica ended: {unit.last_exit}; restarting" if unit.last_exit else None
    if unit.wanted == 0 and http is not None and http.scale is not None:
        idle = f"no calls for {http.scale.idle_sec:g}s: no replica runs; a call starts one"
        return Health("Idle", idle, unit.last_exit, unit.restarts)
    degraded = unit.ready < unit.wanted
    if degraded and unit.ready == 0 and unit.failing:
        return Health("Failed", ended, unit.last_exit, unit.restarts)
    return Health("Ready", ended if degraded else None, unit.last_exit, unit.restarts)
