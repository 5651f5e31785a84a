"""A reconcile pass, and the loop that runs one pass at a time.

A pass is an ordered list of steps: fetch, load, plan, build, run jobs,
apply, prune, report. Each step writes what it did to the status store as it
goes, so a crash leaves a truthful record. A step that fails stops only what
depends on it: a fetch that fails changes nothing; a bad manifest keeps the
last good version of its functions; a failed build keeps the old version
serving; a crash mid-pass leaves everything that ran running.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from . import logs, manifest
from .backend import Backend, BuildFailed, Deployment, Health, deployment_for
from .diff import job_errors, job_results
from .errors import SlessError
from .manifest import DesiredState, Function, Job
from .metrics import METRICS
from .planner import Observed, Plan, plan
from .routes import Declared, RouteTable
from .source import Snapshot
from .store import FUNCTION_PHASES, Store

__all__ = ["Reconciler", "Source"]

log = logging.getLogger(__name__)

FINISHED = ("Succeeded", "Failed", "Skipped")
MAX_ROUNDS = 5  # plan again after jobs finish, so their dependents deploy in the same pass
# a run interrupted by a reconciler crash runs again, as Kubernetes reruns a Job whose pod
# vanished (at-least-once), up to this many attempts in all
MAX_JOB_ATTEMPTS = 3
# passes nobody asked for in person: logged at debug level unless they change something
QUIET_TRIGGERS = ("poll", "settle", "preview")
SETTLE_SEC = 1.0  # a backend reporting a rollout in progress is looked at again this soon


class Source(Protocol):
    """Where snapshots come from: a mirror of a remote, or a fixed snapshot in tests."""

    def fetch(self) -> Any: ...

    def snapshot(self, commit: str | None = None) -> Snapshot: ...


@dataclass(frozen=True)
class PassResult:
    revision: str | None
    plan: Plan | None
    error: str | None


@dataclass
class _Pass:
    """One pass while it runs: its history row is written only once it changes something."""

    trigger: str
    started: float
    sync_id: int | None = None
    revision: str | None = None
    builds: int = 0
    applies: int = 0
    prunes: int = 0
    jobs: int = 0

    @property
    def changed(self) -> bool:
        return self.sync_id is not None

    @property
    def quiet(self) -> bool:
        """A poll at a known commit that did nothing: not worth an info line."""
        return self.trigger in QUIET_TRIGGERS and not self.changed


class Reconciler:
    def __init__(
        self,
        source: Source,
        backend: Backend,
        store: Store,
        env: str = "prod",
        public_url: str = "http://127.0.0.1:8080",
        build_retry_sec: float = 300.0,
        workers: int = 4,
        routes: RouteTable | None = None,
        allow_empty: bool = False,
        leading: Callable[[], bool] | None = None,
        after_pass: Callable[[], None] | None = None,
    ) -> None:
        """``leading()``: whether this replica may run passes (it holds the lease)."""
        self.source = source
        self.backend = backend
        self.store = store
        self.env = env
        self.routes = routes
        self.public_url = public_url.rstrip("/")
        self.build_retry_sec = build_retry_sec
        # Argo CD's allowEmpty: without it, a pass never prunes every function at once
        self.allow_empty = allow_empty
        self.leading = leading or (lambda: True)
        self._after_pass = after_pass  # previews run after each pass of the tracked branch
        self._settle: threading.Timer | None = None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sless-work")
        self._desired: DesiredState | None = None
        self._manifests = manifest.ManifestCache()
        self._wanted = threading.Event()
        self._triggers: list[str] = []
        self._stopping = threading.Event()
        self._idle = threading.Condition()
        self._passes = 0
        self._taken = False  # a pass has taken the waiting triggers and not finished yet
        self._exclusive = threading.Lock()  # one pass, or one maintenance task, at a time
        self._logged_problems: frozenset[str] = frozenset()
        self._last_revision: str | None = None
        self._interrupted_runs()
        self.publish()

    # --- the loop ----------------------------------------------------------------------

    def request_sync(self, trigger: str) -> int:
        """Ask for a pass; requests that arrive while one runs become one more pass.

        Returns how many passes will have finished once one has served this
        request (a pass that already took its triggers may have fetched before
        it), for :meth:`wait_for_pass`.
        """
        with self._idle:
            self._triggers.append(trigger)
            self._wanted.set()
            return self._passes + (2 if self._taken else 1)

    def run_forever(self) -> None:
        while not self._stopping.is_set():
            if not self._wanted.wait(0.5):
                continue
            if not self.leading():  # requests wait for this replica to lead
                self._stopping.wait(0.5)
                continue
            with self._idle:
                self._wanted.clear()
                triggers, self._triggers = self._triggers, []
                self._taken = True
            self.sync(",".join(sorted(set(triggers))) or "manual")

    def wait_for_pass(self, after: int, timeout: float) -> bool:
        """Block until more than ``after`` passes have finished."""
        with self._idle:
            return self._idle.wait_for(lambda: self._passes > after, timeout)

    @property
    def passes(self) -> int:
        return self._passes

    def stop(self) -> None:
        self._stopping.set()
        if self._settle is not None:
            self._settle.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def exclusively(self, task: Callable[[], Any]) -> Any:
        """Run ``task`` between passes (garbage collection must not race a deploy)."""
        with self._exclusive:
            return task()

    # --- one pass ------------------------------------------------------------------------

    def sync(self, trigger: str = "manual") -> PassResult:
        with self._exclusive:
            try:
                return self._sync(_Pass(trigger, time.time()))
            finally:
                with self._idle:
                    self._passes += 1
                    self._taken = False
                    self._idle.notify_all()
                if self._after_pass is not None:
                    self._after_pass()

    def _sync(self, current: _Pass) -> PassResult:
        level = logging.DEBUG if current.trigger in QUIET_TRIGGERS else logging.INFO
        logs.event(log, "sync.started", f"trigger {current.trigger}", level=level, env=self.env)
        try:
            fetched = self.source.fetch()
            snapshot = self.source.snapshot(getattr(fetched, "commit", None))
            current.revision = snapshot.revision
            desired = self._load(snapshot)
            self._log_problems(desired)
            last = self._converge(desired, snapshot, current)
            result = "Succeeded" if not desired.invalid else "Invalid"
            problems = [str(e).splitlines()[0] for e in desired.invalid.values()]
            if last.refused:
                result, problems = "Failed", [last.refused, *problems]
            error = "; ".join(problems) or None
            self._settle_later()
            self._finish(current, result, error)
            return PassResult(current.revision, last, error)
        except SlessError as exc:
            return self._failed(current, str(exc))
        except Exception as exc:  # a bug must not stop the loop or what is running
            log.exception("sync pass crashed")
            return self._failed(current, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self.publish()

    def _begin_row(self, current: _Pass) -> None:
        if current.sync_id is None:
            current.sync_id = self.store.begin_sync(self.env, current.trigger, current.started)

    def _finish(self, current: _Pass, result: str, error: str | None) -> None:
        previous = self.store.last_sync(self.env)
        if current.sync_id is None:
            self.store.repeat_sync(
                self.env, current.trigger, current.started, result, current.revision, error
            )
        else:
            self.store.finish_sync(current.sync_id, result, current.revision, error)
        METRICS.syncs.inc(env=self.env, result=result)
        METRICS.sync_duration.observe(time.time() - current.started)
        if result != "Failed":
            METRICS.last_success.set(time.time(), env=self.env)
        new_outcome = previous is None or (previous["result"], previous["error"]) != (result, error)
        quiet = current.quiet and current.revision == self._last_revision and not new_outcome
        self._last_revision = current.revision or self._last_revision
        took = time.time() - current.started
        did = (
            f"{current.builds} built, {current.applies} deployed, "
            f"{current.prunes} pruned, {current.jobs} jobs run"
        )
        logs.event(
            log,
            "sync.finished" if result != "Failed" else "sync.failed",
            f"{result} in {took:.2f}s ({did})" + (f": {error}" if error else ""),
            level=logging.DEBUG if quiet else (logging.WARNING if error else logging.INFO),
            env=self.env,
            revision=_short(current.revision),
            syncId=current.sync_id,
            trigger=current.trigger,
            result=result,
        )

    def _failed(self, current: _Pass, error: str) -> PassResult:
        self._finish(current, "Failed", error)
        return PassResult(current.revision, None, error)

    def _log_problems(self, desired: DesiredState) -> None:
        """Each manifest problem once, when it appears (not on every poll)."""
        problems = frozenset(str(p) for p in desired.problems)
        for line in sorted(problems - self._logged_problems):
            logs.event(
                log,
                "manifest.invalid",
                line,
                level=logging.WARNING,
                env=self.env,
                revision=_short(desired.revision),
            )
        self._logged_problems = problems

    def _load(self, snapshot: Snapshot) -> DesiredState:
        cached = self._desired
        if cached is not None and cached.revision == snapshot.revision:
            return cached
        desired = manifest.load(snapshot, self._manifests)
        self._keep_last_good_names(desired)
        self._desired = desired
        return desired

    def _keep_last_good_names(self, desired: DesiredState) -> None:
        """An invalid manifest keeps every function it last declared, however broken it is.

        A file that cannot be read at all (YAML syntax, encoding, size, a
        symlink) yields no names of its own, so the names come from the
        functions the store last saw deployed from that path; only deleting
        the file removes them.
        """
        for record in self.store.functions(self.env):
            path = record["manifest"]
            if path in desired.invalid and record["name"] not in desired.functions:
                desired.invalid_names.setdefault(record["name"], path)

    def _converge(self, desired: DesiredState, snapshot: Snapshot, current: _Pass) -> Plan:
        planned = self._plan(desired)
        for _ in range(MAX_ROUNDS):
            reported = self._report(planned, desired)
            if reported or planned.builds or planned.jobs or planned.prunes:
                self._begin_row(current)
            current.builds += len(planned.builds)
            current.jobs += len(planned.jobs)
            current.prunes += len(planned.prunes)
            self._run_all(lambda fn: self._build(fn, snapshot), planned.builds)
            if planned.builds:
                self.publish()
            self._run_all(lambda item: self._run_job(*item), planned.jobs)
            running = set(self.backend.deployed(self.env)) if planned.applies else set()
            applied = self._run_all(
                lambda d, running=running: self._apply(d, snapshot.revision, d.name in running),
                planned.applies,
            )
            current.applies += sum(applied)
            if any(applied):
                self._begin_row(current)
            for name in planned.prunes:
                self._prune(name)
            if not (planned.builds or planned.jobs):
                break
            planned = self._plan(desired)
        return planned

    def _plan(self, desired: DesiredState) -> Plan:
        observed = self._observe(desired)
        planned = plan(desired, self.env, observed)
        emptying = planned.prunes and not desired.functions and not desired.invalid_names
        if emptying and not self.allow_empty:
            # a wrong path or a bad fetch must not empty an environment (Argo CD: allowEmpty)
            planned.refused = (
                f"refused to prune all {len(planned.prunes)} functions of {self.env}: "
                f"revision {_short(desired.revision)} declares none "
                "(serve --allow-empty permits it)"
            )
            planned.prunes = []
        return planned

    def _run_all(self, step: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        return [future.result() for future in [self._pool.submit(step, item) for item in items]]

    # --- observing --------------------------------------------------------------------------

    def _observe(self, desired: DesiredState) -> Observed:
        self.backend.refresh(self.env)
        self._adopt_job_runs()
        now = time.time()
        failed = {}
        built = set()
        for fn in desired.functions.values():
            if self.backend.is_built(fn):
                built.add(fn.build_tag)
                continue
            record = self.store.build(fn.build_tag)
            recent = record and now - (record["finished"] or 0) < self.build_retry_sec
            if recent and record["phase"] == "Failed":
                failed[fn.build_tag] = record["error"] or "build failed"
        runs = self.store.jobs(self.env)
        finished = frozenset((r["name"], r["run_id"]) for r in runs if r["phase"] in FINISHED)
        return Observed(
            built=frozenset(built),
            failed_builds=failed,
            finished_runs=finished,
            job_results=job_results(desired.jobs, runs),
            deployed=self.backend.deployed(self.env),
            job_errors=job_errors(desired.jobs, runs),
        )

    def _adopt_job_runs(self) -> None:
        """Runs the backend remembers and the store does not (a new or emptied state folder)."""
        for run in self.backend.job_runs(self.env):
            known = self.store.job_run(self.env, run.name, run.run_id)
            if known is not None and known["phase"] in FINISHED:
                continue
            self.store.set_job_run(
                self.env,
                run.name,
                run.run_id,
                function=run.function,
                phase=run.phase,
                result=run.result,
                error=run.error,
                finished=run.finished,
                attempts=(known["attempts"] if known else None) or 1,
            )

    def _interrupted_runs(self) -> None:
        """Runs left 'Running' by a killed reconciler run again, up to MAX_JOB_ATTEMPTS."""
        for env in [self.env]:  # each environment's reconciler takes care of its own
            for run in self.store.jobs(env):
                if run["phase"] != "Running":
                    continue
                attempts = run["attempts"] or 1
                if attempts >= MAX_JOB_ATTEMPTS:
                    phase = "Failed"
                    error = (
                        f"interrupted: the reconciler stopped during each of {attempts} "
                        "attempts; bump runId to run it again"
                    )
                else:
                    phase = "Pending"
                    error = (
                        f"interrupted: the reconciler stopped during attempt {attempts}; "
                        "it runs again"
                    )
                self.store.set_job_run(env, run["name"], run["run_id"], phase=phase, error=error)
                logs.event(
                    log,
                    "job.interrupted",
                    error,
                    level=logging.WARNING,
                    env=env,
                    job=run["name"],
                    runId=run["run_id"],
                )

    # --- steps ---------------------------------------------------------------------------------

    def _build(self, fn: Function, snapshot: Snapshot) -> None:
        users = [f for f in self._desired_functions() if f.build_tag == fn.build_tag]
        names = ", ".join(user.name for user in users)
        for user in users:
            self.store.set_function(self.env, user.name, phase="Building", build_tag=fn.build_tag)
        self.store.start_build(fn.build_tag, fn.runtime, fn.source_id, fn.folder)
        where = {"env": self.env, "function": names, "tag": fn.build_tag}
        logs.event(log, "build.started", f"{fn.build_tag} ({fn.folder or '.'})", **where)
        started = time.monotonic()
        try:
            build_log = self.backend.build(fn, snapshot)
        except BuildFailed as exc:
            took = time.monotonic() - started
            self.store.finish_build(fn.build_tag, "Failed", exc.log_tail, str(exc))
            METRICS.builds.inc(runtime=fn.runtime, result="Failed")
            METRICS.build_duration.observe(took)
            logs.event(
                log, "build.failed", f"{exc} after {took:.1f}s", level=logging.ERROR, **where
            )
            message = f"{exc}\n{exc.log_tail[-1500:]}"
            for user in users:
                self.store.set_function(self.env, user.name, phase="Failed", message=message)
            return
        took = time.monotonic() - started
        self.store.finish_build(fn.build_tag, "Succeeded", build_log)
        METRICS.builds.inc(runtime=fn.runtime, result="Succeeded")
        METRICS.build_duration.observe(took)
        logs.event(log, "build.finished", f"{fn.build_tag} in {took:.1f}s", **where)

    def _desired_functions(self) -> list[Function]:
        return list(self._desired.functions.values()) if self._desired else []

    def _run_job(self, fn: Function, job: Job) -> None:
        before = self.store.job_run(self.env, job.name, job.run_id)
        attempt = (before["attempts"] if before else 0) + 1
        self.store.set_job_run(
            self.env,
            job.name,
            job.run_id,
            function=fn.name,
            phase="Running",
            started=time.time(),
            finished=None,
            attempts=attempt,
        )
        where = {"env": self.env, "function": fn.name, "job": job.name, "runId": job.run_id}
        logs.event(log, "job.started", f"{job.name} run {job.run_id}, attempt {attempt}", **where)
        declared = self._desired.jobs if self._desired else {}
        results = job_results(declared, self.store.jobs(self.env))
        try:
            deployment = deployment_for(self.env, fn, results)
            result = self.backend.run_job(self.env, fn, job, deployment.env_vars)
        except SlessError as exc:
            if self._stopping.is_set():  # killed by the shutdown: the next start runs it again
                logs.event(log, "job.interrupted", f"{job.name}: {exc}", **where)
                return
            self.store.set_job_run(
                self.env, job.name, job.run_id, phase="Failed", error=str(exc), finished=time.time()
            )
            logs.event(log, "job.failed", f"{job.name}: {exc}", level=logging.ERROR, **where)
            return
        self.store.set_job_run(
            self.env,
            job.name,
            job.run_id,
            phase="Succeeded",
            result=result,
            error=None,
            finished=time.time(),
        )
        logs.event(log, "job.succeeded", f"{job.name}: {_clip(result)}", **where)

    def _apply(self, deployment: Deployment, revision: str, replacing: bool) -> bool:
        """Start or replace one function; False when it failed exactly as it did last time."""
        fn = deployment.function
        where = {"env": self.env, "function": fn.name, "revision": _short(revision)}
        try:
            self.backend.apply(deployment, revision)
        except SlessError as exc:
            if self._stopping.is_set():  # refused by the shutdown, not by the function
                return False
            # retried every pass (a secret file may appear without a commit), but a
            # repeat of the same failure is not news: no write, no history row, debug only
            record = self.store.function(self.env, fn.name) or {}
            repeat = (record.get("phase"), record.get("message")) == ("Failed", str(exc))
            if not repeat:
                self.store.set_function(self.env, fn.name, phase="Failed", message=str(exc))
            level = logging.DEBUG if repeat else logging.ERROR
            logs.event(log, "deploy.failed", str(exc), level=level, **where)
            return not repeat
        health = self.backend.health(self.env).get(fn.name)
        self.store.set_function(
            self.env,
            fn.name,
            phase=health.phase if health else ("Ready" if fn.enabled else "Disabled"),
            build_tag=fn.build_tag,
            revision=revision,
            message=health.message if health else None,
            restarts=0,
            last_exit=None,
            spec={"hash": deployment.spec_hash, "replicas": fn.replicas, "http": fn.http},
        )
        what = "replaced" if replacing else "deployed"
        state = "" if fn.enabled else ", disabled"
        logs.event(log, f"function.{what}", f"{fn.name} {what} ({fn.build_tag}{state})", **where)
        return True

    def _prune(self, name: str) -> None:
        self.backend.remove(self.env, name)
        self.store.delete_function(self.env, name)
        logs.event(log, "function.pruned", f"{name} removed", env=self.env, function=name)

    # --- what the running functions report ------------------------------------------------

    def replica_event(self, env: str, name: str, kind: str, reason: str | None) -> None:
        """A replica of ``name`` ended (``exited``, with why) or is healthy again."""
        record = self.store.function(env, name)
        if record is None:
            return
        if kind == "exited":
            self.store.set_function(
                env,
                name,
                restarts=(record["restarts"] or 0) + 1,
                last_exit=reason,
                message=f"a replica ended: {reason}; restarting",
            )
        elif record["message"] and record["message"].startswith("a replica ended"):
            self.store.set_function(env, name, message=None)
        self.publish()

    # --- status ----------------------------------------------------------------------

    def url(self, fn: Function) -> str | None:
        return f"{self.public_url}/fn/{self.env}/{fn.name}/" if fn.http else None

    def publish(self) -> None:
        """Tell the proxy (and /metrics) what the repository declares and in which phase.

        The proxy answers a declared name that does not serve with 503, not 404.
        """
        records = self.store.functions(self.env)
        desired = self._desired.functions if self._desired else {}
        try:
            self.backend.report(self.env, records, desired, lambda: self.store.jobs(self.env))
        except SlessError as exc:  # the status view must never stop a pass
            logs.event(log, "status.unpublished", str(exc), level=logging.WARNING, env=self.env)
        phases: dict[str, int] = dict.fromkeys(FUNCTION_PHASES, 0)
        for record in records:
            phases[record["phase"]] += 1
        for phase, count in phases.items():
            METRICS.functions.set(count, env=self.env, phase=phase)
        if self.routes is None:
            return
        self.routes.declare(
            self.env,
            {
                # an invalid manifest may never have said which triggers it has: 503
                r["name"]: Declared(
                    r["phase"], r["message"], r["url"] is not None or r["phase"] == "Invalid"
                )
                for r in records
            },
        )

    def _report(self, current: Plan, desired: DesiredState) -> int:
        """Write each function's phase and message, only where they changed; count writes."""
        records = {r["name"]: r for r in self.store.functions(self.env)}  # one query, not N
        writes = 0

        def update(name: str, **fields: Any) -> None:
            nonlocal writes
            record = records.get(name)
            if record is None or any(record.get(k) != v for k, v in fields.items()):
                self.store.set_function(self.env, name, **fields)
                writes += 1

        for name, path in desired.invalid_names.items():
            update(name, phase="Invalid", manifest=path, message=str(desired.invalid[path]))
        for name, reason in current.waiting.items():
            update(name, phase="Pending", message=reason)
        for name, reason in current.failed.items():
            if records.get(name, {}).get("phase") != "Failed":  # keep the build's log tail
                update(name, phase="Failed", message=reason)
        for fn in desired.functions.values():
            update(fn.name, manifest=fn.manifest, url=self.url(fn))
        busy = {*current.waiting, *current.failed, *(d.name for d in current.applies)}
        busy |= {fn.name for fn in current.builds}
        for name, health in self.backend.health(self.env).items():
            if name in desired.functions and name not in busy:
                update(name, **_health_fields(health))
        return writes

    def _settle_later(self) -> None:
        """Look again soon while the backend reports a rollout in progress."""
        if self._stopping.is_set() or not any(
            h.settling for h in self.backend.health(self.env).values()
        ):
            return
        if self._settle is None or not self._settle.is_alive():
            self._settle = threading.Timer(SETTLE_SEC, self.request_sync, args=("settle",))
            self._settle.daemon = True
            self._settle.start()


def _health_fields(health: Health) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "phase": health.phase,
        "message": health.message,
        "last_exit": health.last_exit,
        "restarts": health.restarts,
    }
    if health.revision:
        fields["revision"] = health.revision
    if health.build_tag:
        fields["build_tag"] = health.build_tag
    return fields


def _short(revision: str | None) -> str | None:
    return revision[:12] if revision else None


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
