"""A reconcile pass, and the loop that runs one pass at a time.

A pass is an ordered list of steps: (at start-up) restore what served, fetch,
load, plan, start long work, deploy, prune, derive every function's phase,
report. Each function moves through its own pipeline (build, the jobs it
takes results from, deploy): a build or job runs in the background, and the
pass waits for it only while nothing else asks for a pass and its patience
lasts; when it finishes, a follow-up pass deploys what waited for it. So a
60 s install never holds back a one-line change to another function.

What serves is state: every deploy is written down (``serving``) and a
restart starts exactly that before it fetches anything. A step that fails
stops only what depends on it: a fetch that fails changes nothing; a bad
manifest, a failed build or a failed deploy keep the last good version
serving; a crash mid-pass leaves everything that ran running.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import backoff, failure, logs
from .errors import SlessError, TransientError
from .manifests import load as manifest
from .manifests.load import DesiredState, Function, Job
from .metrics import METRICS
from .plan.backend import (
    Backend,
    BuildFailed,
    Deployment,
    JobFailed,
    SecretUnavailable,
    deployment_for,
)
from .plan.diff import job_errors, job_results
from .plan.planner import Held, Observed, Plan, plan
from .source.snapshot import Snapshot
from .state import phases, serving
from .state.inflight import InFlight
from .state.phases import STARTING, Outcome, derive, summarize
from .state.records import Records
from .state.routes import Declared, RouteTable
from .state.store import FUNCTION_PHASES, Store

__all__ = ["Reconciler", "Source"]

log = logging.getLogger(__name__)

FINISHED = ("Succeeded", "Failed", "Skipped")
# a run interrupted by a reconciler crash runs again, as Kubernetes reruns a Job whose pod
# vanished (at-least-once), up to this many attempts in all
MAX_JOB_ATTEMPTS = 3
FOLLOW_UP = "follow-up"  # a build or job finished, or a replica came or went: look again
# passes nobody asked for in person: logged at debug level unless they change something
QUIET_TRIGGERS = ("poll", "settle", "preview", FOLLOW_UP)
SETTLE_SEC = 1.0  # a backend reporting a rollout in progress is looked at again this soon
PATIENCE_SEC = 5.0  # how long a pass waits for the work it started, when nothing else waits


class Source(Protocol):
    """Where snapshots come from: a mirror of a remote, or a fixed snapshot in tests."""

    def fetch(self) -> Any: ...

    def snapshot(self, commit: str | None = None) -> Snapshot: ...


@dataclass(frozen=True)
class PassResult:
    revision: str | None
    plan: Plan | None
    error: str | None
    result: str = "Succeeded"


@dataclass
class _Pass:
    """One pass while it runs: its history row is written only once it changes something."""

    trigger: str
    started: float
    sync_id: int | None = None
    revision: str | None = None
    started_work: int = 0
    applies: int = 0
    failures: int = 0
    prunes: int = 0
    mine: set[Hashable] = field(default_factory=set)  # work it started and may wait for

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
        patience_sec: float = PATIENCE_SEC,
        follow_up: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        work: InFlight | None = None,
    ) -> None:
        """``leading()``: whether this replica may run passes (it holds the lease).

        ``follow_up()``: asks for a pass when background work finished; by
        default :meth:`request_sync`, for a reconciler that runs :meth:`run_forever`.
        ``clock()``: the time deploy backoffs are counted in. ``work``: the builds and
        jobs under way, shared by the reconcilers of one server (by default its own).
        """
        self.source = source
        self.backend = backend
        self.store = store
        self.env = env
        self.routes = routes
        self.public_url = public_url.rstrip("/")
        self.build_retry_sec = build_retry_sec
        self.patience_sec = patience_sec
        self.clock = clock
        # Argo CD's allowEmpty: without it, a pass never prunes every function at once
        self.allow_empty = allow_empty
        self.leading = leading or (lambda: True)
        self._after_pass = after_pass  # previews run after each pass of the tracked branch
        self._follow_up = follow_up or (lambda: self.request_sync(FOLLOW_UP) and None)
        self._settle: threading.Timer | None = None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sless-work")
        # builds and jobs: long, and shared with the other environments' reconcilers
        self._owns_work = work is None
        self._work = work or InFlight(max(16, workers))
        self._work.subscribe(self._work_done)
        self._desired: DesiredState | None = None
        self._manifests = manifest.ManifestCache()
        self._records = Records(store, env)
        self._published = -1  # the records version the proxy and /metrics last saw
        self._derived_from: tuple[Any, ...] | None = None  # the phases' inputs last pass
        self._derived_for: dict[str, tuple[Any, ...]] = {}  # and each function's
        self._derived_url: str | None = None  # the public address the URLs were made with
        self._steady: tuple[tuple[Any, ...], Plan] | None = None  # the last idle plan
        self._outcomes: dict[str, Outcome] = {}  # deploys that did not start, by function
        self._serving: set[str] = {row["name"] for row in store.serving(env)}
        self._restored = False
        self._built: set[str] = set()  # tags known built: a tag never changes once built
        self._deployments: dict[str, tuple[Function, tuple[str | None, ...], Deployment]] = {}
        self._done = {"built": 0, "build_failed": 0, "jobs": 0}  # finished in the background
        self._wanted = threading.Event()
        self._triggers: list[str] = []
        self._stopping = threading.Event()
        self._idle = threading.Condition()
        self._passes = 0
        self._taken = False  # a pass has taken the waiting triggers and not finished yet
        self._follow_up_due = False  # work finished that no pass has looked at yet
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
        following = False
        while not self._stopping.is_set():
            if not self._wanted.wait(0.5):
                continue
            if not self.leading():  # requests wait for this replica to lead
                following = True
                self._stopping.wait(0.5)
                continue
            if following:  # another replica wrote the records meanwhile
                self._records.reload()
                self._derived_for = {}
                following = False
            with self._idle:
                self._wanted.clear()
                triggers, self._triggers = self._triggers, []
                self._taken = True
            self.sync(",".join(sorted(set(triggers))) or "manual")

    def wait_for_pass(self, after: int, timeout: float) -> bool:
        """Block until more than ``after`` passes have finished."""
        with self._idle:
            return self._idle.wait_for(lambda: self._passes > after, timeout)

    def wait_for_settled(self, after: int, timeout: float) -> bool:
        """Block until more than ``after`` passes have finished and no work is under way:
        what the commit asks for is built, run and deployed, or has failed."""
        with self._idle:
            return self._idle.wait_for(
                lambda: (
                    self._passes > after
                    and not self._taken
                    and not self._follow_up_due
                    and not self._under_way()
                ),
                timeout,
            )

    @property
    def passes(self) -> int:
        return self._passes

    def stop(self) -> None:
        self._stopping.set()
        if self._settle is not None:
            self._settle.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._work.unsubscribe(self._work_done)
        if self._owns_work:
            self._work.shutdown()

    def exclusively(self, task: Callable[[], Any]) -> Any:
        """Run ``task`` between passes (garbage collection must not race a deploy)."""
        with self._exclusive:
            try:
                return task()
            finally:
                self._built.clear()  # it may have removed artifacts

    def busy(self) -> bool:
        """Builds or job runs this environment waits for are under way."""
        return self._under_way()

    def _under_way(self) -> bool:
        """Work this environment waits for: its jobs, and builds of tags it wants."""
        tags = {fn.build_tag for fn in self._desired_functions()}
        return any(
            (key[0] == "job" and key[1] == self.env) or (self._builds_here(key) and key[1] in tags)
            for key in self._work.under_way()
        )

    def _builds_here(self, key: Hashable) -> bool:
        """Builds whose image this environment may run: of its own scope (trust) only."""
        return (
            isinstance(key, tuple) and key[0] == "build" and key[2:] == (self.backend.build_scope,)
        )

    def _work_done(self) -> None:
        with self._idle:
            self._follow_up_due = True
            self._idle.notify_all()
        if not self._stopping.is_set():
            self._follow_up()

    def _interrupted(self) -> bool:
        """Someone asks for a pass (a push, a poll, the API): stop waiting for long work."""
        return self._stopping.is_set() or any(t != FOLLOW_UP for t in self._triggers)

    # --- one pass ------------------------------------------------------------------------

    def sync(self, trigger: str = "manual") -> PassResult:
        if self._stopping.is_set():  # a follow-up asked for before the stop: nothing to do
            return PassResult(None, None, "the reconciler is stopping", "Failed")
        with self._exclusive:
            with self._idle:
                self._follow_up_due = False  # this pass sees whatever finished until now
            try:
                with _collections_deferred():
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
            if not self._restored:  # before the fetch: an unreachable remote changes nothing
                self._restore()
            fetched = self.source.fetch()
            snapshot = self.source.snapshot(getattr(fetched, "commit", None))
            current.revision = snapshot.revision
            desired = self._load(snapshot)
            self._log_problems(desired)
            last = self._converge(desired, snapshot, current)
            result, error = self._conclude(desired, last, current)
            if last.refused:
                result, error = "Failed", "; ".join(filter(None, [last.refused, error]))
            self._settle_later()
            self._finish(current, result, error)
            return PassResult(current.revision, last, error, result)
        except SlessError as exc:
            return self._failed(current, str(exc))
        except Exception as exc:  # a bug must not stop the loop or what is running
            if self._stopping.is_set():  # stopped under it (its pools are gone): not a failure
                return PassResult(current.revision, None, "the reconciler stopped", "Failed")
            log.exception("sync pass crashed")
            return self._failed(current, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            self.publish()

    def _begin_row(self, current: _Pass) -> None:
        if current.sync_id is None:
            current.sync_id = self.store.begin_sync(self.env, current.trigger, current.started)

    def _finish(self, current: _Pass, result: str, error: str | None) -> None:
        previous = self.store.last_sync(self.env)
        done, self._done = self._done, dict.fromkeys(self._done, 0)
        if any(done.values()):
            self._begin_row(current)
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
        logs.event(
            log,
            "sync.finished" if result != "Failed" else "sync.failed",
            f"{result} in {took:.2f}s ({_did(current, done)})" + (f": {error}" if error else ""),
            level=logging.DEBUG if quiet else (logging.WARNING if error else logging.INFO),
            env=self.env,
            revision=_short(current.revision),
            syncId=current.sync_id,
            trigger=current.trigger,
            result=result,
        )

    def _failed(self, current: _Pass, error: str) -> PassResult:
        self._finish(current, "Failed", error)
        return PassResult(current.revision, None, error, "Failed")

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
        symlink) yields no names of its own, so the names come from what
        serves from that path, and from the records; only deleting the file
        removes them.
        """
        if not desired.invalid:
            return
        declared = {row["name"]: row["manifest"] for row in self._records.all()}
        for row in self.store.serving(self.env):
            declared[row["name"]] = row["deployment"]["function"]["manifest"]
        for name, path in declared.items():
            if path in desired.invalid and name not in desired.functions:
                desired.invalid_names.setdefault(name, path)

    def _converge(self, desired: DesiredState, snapshot: Snapshot, current: _Pass) -> Plan:
        """Plan and act until nothing more can be done now; returns the last plan."""
        deadline = time.monotonic() + self.patience_sec
        while True:
            since = self._work.mark()
            planned = self._plan(desired)
            if self._start_work(planned, snapshot, current):
                self._show_started(desired, planned, current)
            self._deploy(planned, snapshot.revision, current)
            left = deadline - time.monotonic()
            if not self._work.wait_any(current.mine, since, left, self._interrupted):
                return planned

    def _plan(self, desired: DesiredState) -> Plan:
        self.backend.refresh(self.env)
        self._adopt_job_runs()
        # first: a build that finishes after this is seen as under way, never as not started
        under_way = self._work.under_way()
        runs = self.store.jobs(self.env)
        key = self._steady_key(desired, under_way, runs)
        if key is not None and self._steady is not None and self._steady[0] == key:
            return self._steady[1]  # nothing the last (idle) plan came from changed
        planned = plan(
            desired, self.env, self._observe(desired, under_way, runs), self._deployment_for
        )
        idle = planned.is_empty and not planned.failed and not planned.building
        self._steady = (key, planned) if key is not None and idle else None
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

    def _steady_key(
        self, desired: DesiredState, under_way: frozenset[Hashable], runs: list[dict[str, Any]]
    ) -> tuple[Any, ...] | None:
        """What a plan comes from, cheap to compare at 10,000 functions; None when the backend
        cannot say whether what runs changed (then every pass plans)."""
        running = self.backend.health_version(self.env)
        if running is None:
            return None
        return (
            desired.revision,
            running,
            under_way,
            self._work.mark(),
            len(self._built),
            len(self._serving),
            tuple(sorted(self._outcomes.items())),
            tuple((r["name"], r["run_id"], r["phase"], r["error"]) for r in runs),
        )

    def _deployment_for(self, env: str, fn: Function, results: Mapping[str, str]) -> Deployment:
        """deployment_for, remembered while the function and the results it takes stay."""
        cached = self._deployments.get(fn.name)
        if cached is not None and cached[0] is fn:
            deps = fn.job_dependencies(env) if cached[1] else ()
            if tuple(results.get(job) for job in deps) == cached[1]:
                return cached[2]
        deps = fn.job_dependencies(env)
        deployment = deployment_for(env, fn, results)
        self._deployments[fn.name] = (fn, tuple(results.get(job) for job in deps), deployment)
        return deployment

    def _run_all(self, step: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        return [future.result() for future in [self._pool.submit(step, item) for item in items]]

    # --- observing --------------------------------------------------------------------------

    def _observe(
        self, desired: DesiredState, under_way: frozenset[Hashable], runs: list[dict[str, Any]]
    ) -> Observed:
        now = self.clock()
        failed = {}
        for fn in desired.functions.values():
            tag = fn.build_tag
            if tag in self._built:
                continue
            if self.backend.is_built(fn):
                self._built.add(tag)
                continue
            # this scope's record only: a fork's failed build of the tag holds back no other
            record = self.store.build(tag, self.backend.build_scope)
            recent = record and now - (record["finished"] or 0) < self.build_retry_sec
            if recent and record["phase"] == "Failed":
                failed[tag] = record["error"] or "build failed"
        finished = frozenset((r["name"], r["run_id"]) for r in runs if r["phase"] in FINISHED)
        return Observed(
            built=frozenset(self._built),
            failed_builds=failed,
            finished_runs=finished,
            job_results=job_results(desired.jobs, runs),
            deployed=self.backend.deployed(self.env),
            job_errors=job_errors(desired.jobs, runs),
            building=frozenset(key[1] for key in under_way if self._builds_here(key)),
            running=frozenset(
                key[2:] for key in under_way if key[0] == "job" and key[1] == self.env
            ),
            job_waits=_job_waits(desired, runs),
            held={
                name: Held(o.spec_hash, o.message, o.retry_at)
                for name, o in self._outcomes.items()
                if o.retry_at is not None
            },
            serving=frozenset(self._serving),
            now=now,
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
        for run in self.store.jobs(self.env):
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
                    f"interrupted: the reconciler stopped during attempt {attempts}; it runs again"
                )
            self.store.set_job_run(self.env, run["name"], run["run_id"], phase=phase, error=error)
            logs.event(
                log,
                "job.interrupted",
                error,
                level=logging.WARNING,
                env=self.env,
                job=run["name"],
                runId=run["run_id"],
            )

    # --- steps ---------------------------------------------------------------------------------

    def _restore(self) -> None:
        """Start what served when the last reconciler stopped, as it was, before anything else."""
        self._restored = True
        rows = self.store.serving(self.env)
        if not rows:
            return
        self.backend.refresh(self.env)
        running = self.backend.deployed(self.env)
        todo = []
        for row in rows:
            try:
                deployment = serving.from_record(row["deployment"])
            except (KeyError, TypeError, ValueError) as exc:
                self._warn("function.unrestored", row["name"], f"unreadable record: {exc}")
                continue
            if running.get(deployment.name) == deployment.spec_hash:
                continue  # still running (a cluster keeps what it runs)
            if not self.backend.is_built(deployment.function):
                why = f"its build {deployment.function.build_tag} is gone; it is built again"
                self._warn("function.unrestored", deployment.name, why)
                continue
            todo.append((deployment, row["revision"]))
        self._run_all(lambda item: self._start_restored(*item), todo)

    def _start_restored(self, deployment: Deployment, revision: str | None) -> None:
        try:
            self.backend.apply(deployment, revision)
        except SlessError as exc:
            self._warn("function.unrestored", deployment.name, str(exc))
            return
        fn = deployment.function
        where = {"env": self.env, "function": fn.name, "revision": _short(revision)}
        logs.event(log, "function.restored", f"{fn.name} serves {fn.build_tag} again", **where)

    def _warn(self, event: str, name: str, message: str) -> None:
        where = {"env": self.env, "function": name}
        logs.event(log, event, f"{name}: {message}", level=logging.WARNING, **where)

    def _start_work(self, planned: Plan, snapshot: Snapshot, current: _Pass) -> bool:
        """Builds and jobs go to the background; True if any started."""
        started = 0
        for fn in planned.builds:
            key = ("build", fn.build_tag, self.backend.build_scope)
            if self._work.start(key, lambda fn=fn: self._build(fn, snapshot)):
                current.mine.add(key)
                started += 1
        for fn, job in planned.jobs:
            key = ("job", self.env, job.name, job.run_id)
            if self._job_can_run(fn, job) and self._work.start(
                key, lambda fn=fn, job=job: self._run_job(fn, job)
            ):
                current.mine.add(key)
                started += 1
        if started:
            self._begin_row(current)
            current.started_work += started
        return started > 0

    def _job_can_run(self, fn: Function, job: Job) -> bool:
        """A job whose secret is missing waits (Pending, with why), as its pod would."""
        results = job_results(
            self._desired.jobs if self._desired else {}, self.store.jobs(self.env)
        )
        why = self.backend.unavailable(self.env, deployment_for(self.env, fn, results).env_vars)
        if why is None:
            return True
        before = self.store.job_run(self.env, job.name, job.run_id) or {}
        if (before.get("phase"), before.get("error")) != ("Pending", why):
            self.store.set_job_run(
                self.env, job.name, job.run_id, function=fn.name, phase="Pending", error=why
            )
            where = {"env": self.env, "function": fn.name, "job": job.name, "runId": job.run_id}
            logs.event(log, "job.waiting", f"{job.name}: {why}", level=logging.WARNING, **where)
        return False

    def _deploy(self, planned: Plan, revision: str, current: _Pass) -> None:
        running = set(self.backend.deployed(self.env)) if planned.applies else set()
        applied = self._run_all(
            lambda d: self._apply(d, revision, d.name in running), planned.applies
        )
        current.applies += sum(1 for a in applied if a is True)
        current.failures += sum(1 for a in applied if a is False)
        if any(a is not None for a in applied):
            self._begin_row(current)
        for name in planned.prunes:
            self._prune(name)
            current.prunes += 1
            self._begin_row(current)

    def _build(self, fn: Function, snapshot: Snapshot) -> None:
        users = ", ".join(f.name for f in self._desired_functions() if f.build_tag == fn.build_tag)
        scope = self.backend.build_scope
        self.store.start_build(fn.build_tag, fn.runtime, fn.source_id, fn.folder, scope)
        where = {"env": self.env, "function": users, "tag": fn.build_tag}
        logs.event(log, "build.started", f"{fn.build_tag} ({fn.folder or '.'})", **where)
        started = time.monotonic()
        try:
            build_log = self.backend.build(fn, snapshot)
        except TransientError as exc:  # stopped by a shutdown, files changed: not a failure
            self.store.delete_builds([fn.build_tag], scope)
            logs.event(log, "build.interrupted", str(exc), level=logging.WARNING, **where)
            return
        except SlessError as exc:
            took = time.monotonic() - started
            self.store.finish_build(
                fn.build_tag, "Failed", _tail(exc), _build_error(exc), scope=scope
            )
            self._done["build_failed"] += 1
            METRICS.builds.inc(runtime=fn.runtime, result="Failed")
            METRICS.build_duration.observe(took)
            logs.event(
                log, "build.failed", f"{exc} after {took:.1f}s", level=logging.ERROR, **where
            )
            return
        took = time.monotonic() - started
        image = self.backend.image(fn)
        self.store.finish_build(fn.build_tag, "Succeeded", build_log, image=image, scope=scope)
        self._done["built"] += 1
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
            error=None,
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
        except SecretUnavailable as exc:  # it went between the check and the start: wait again
            self.store.set_job_run(
                self.env,
                job.name,
                job.run_id,
                phase="Pending",
                error=str(exc),
                attempts=attempt - 1,
            )
            logs.event(log, "job.waiting", f"{job.name}: {exc}", level=logging.WARNING, **where)
            return
        except SlessError as exc:
            if self._stopping.is_set():  # killed by the shutdown: the next start runs it again
                logs.event(log, "job.interrupted", f"{job.name}: {_summary(exc)}", **where)
                return
            self.store.set_job_run(
                self.env, job.name, job.run_id, phase="Failed", error=str(exc), finished=time.time()
            )
            self._done["jobs"] += 1
            said = f"{job.name}: {_summary(exc)}; its error ({_size(str(exc))}) is read with "
            reader = _job_reader(self.env, fn, job)
            logs.event(log, "job.failed", said + reader, level=logging.ERROR, **where)
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
        self._done["jobs"] += 1
        # never the result itself: it is shown only to those who may read the API
        said = f"{job.name}: result of {_size(result)}, read with {_job_reader(self.env, fn, job)}"
        logs.event(log, "job.succeeded", said, **where)

    def _apply(self, deployment: Deployment, revision: str, replacing: bool) -> bool | None:
        """Start or replace one function: True if it did, False if it failed, None if it
        waits for a secret or the server stops."""
        fn = deployment.function
        where = {"env": self.env, "function": fn.name, "revision": _short(revision)}
        try:
            self.backend.apply(deployment, revision)
        except SecretUnavailable as exc:
            # tried again on every pass: the secret may appear without a commit
            before = self._outcomes.get(fn.name)
            self._outcomes[fn.name] = Outcome(deployment.spec_hash, "Pending", str(exc))
            level = logging.DEBUG if before and before.message == str(exc) else logging.WARNING
            logs.event(log, "deploy.waiting", str(exc), level=level, **where)
            return None
        except SlessError as exc:
            if self._stopping.is_set():  # refused by the shutdown, not by the function
                return None
            self._back_off(deployment, str(exc), where)
            return False
        self._outcomes.pop(fn.name, None)
        self.store.set_serving(self.env, fn.name, serving.to_record(deployment), revision)
        self._serving.add(fn.name)
        self._records.update(
            fn.name,
            build_tag=fn.build_tag,
            revision=revision,
            restarts=0,
            last_exit=None,
            next_retry=None,
            spec={"hash": deployment.spec_hash, "replicas": fn.replicas, "http": fn.http},
        )
        what = "replaced" if replacing else "deployed"
        state = "" if fn.enabled else ", disabled"
        logs.event(log, f"function.{what}", f"{fn.name} {what} ({fn.build_tag}{state})", **where)
        return True

    def _back_off(self, deployment: Deployment, message: str, where: dict[str, Any]) -> None:
        """A deploy that failed is tried again later and later (CrashLoopBackOff)."""
        before = self._outcomes.get(deployment.name)
        same = before is not None and before.spec_hash == deployment.spec_hash
        attempts = before.attempts + 1 if same and before else 1
        wait = backoff.delay(attempts)
        self._outcomes[deployment.name] = Outcome(
            deployment.spec_hash, "Failed", message, attempts, self.clock() + wait
        )
        logs.event(
            log,
            "deploy.failed",
            f"{message} (attempt {attempts}; next try in {wait:g}s)",
            level=logging.ERROR,
            attempt=attempts,
            retryInSec=wait,
            **where,
        )

    def _prune(self, name: str) -> None:
        self.backend.remove(self.env, name)
        self._records.delete(name)  # and what it served
        self._serving.discard(name)
        self._outcomes.pop(name, None)
        self._deployments.pop(name, None)
        logs.event(log, "function.pruned", f"{name} removed", env=self.env, function=name)

    # --- status ----------------------------------------------------------------------

    def _show_started(self, desired: DesiredState, planned: Plan, current: _Pass) -> None:
        """Building and Pending show at once, not when the pass ends (it may wait)."""
        names = [
            name for name in (*planned.building, *planned.waiting) if name in desired.functions
        ]
        health = self.backend.health(self.env)
        hashes = {d.name: d.spec_hash for d in planned.applies}
        urls = {name: self.url(desired.functions[name]) for name in names}
        fields = derive(desired, planned, self._outcomes, health, hashes, urls, names)
        if sum(self._records.update(name, **f) for name, f in fields.items()):
            self._begin_row(current)

    def _write_phases(self, desired: DesiredState, planned: Plan, current: _Pass | None) -> None:
        inputs = self._phase_inputs(desired, planned)
        if inputs is not None and inputs == self._derived_from:
            return  # nothing it is derived from changed: neither can a phase
        health = self.backend.health(self.env)
        hashes = {d.name: d.spec_hash for d in planned.applies}
        # a new public address (a Gateway's) changes every URL, not only changed functions'
        seen = self._derived_for if self._url_base() == self._derived_url else {}
        self._derived_url = self._url_base()
        fresh = {
            name: phases.inputs(fn, planned, self._outcomes, health, hashes)
            for name, fn in desired.functions.items()
        }
        changed = [name for name, given in fresh.items() if seen.get(name) != given]
        urls = {name: self.url(desired.functions[name]) for name in changed}
        fields = derive(desired, planned, self._outcomes, health, hashes, urls, changed)
        writes = sum(self._records.update(name, **f) for name, f in fields.items())
        for name in set(self._records.names()) - fresh.keys() - desired.invalid_names.keys():
            self._records.delete(name)  # neither declared nor served: nothing to say of it
            writes += 1
        self._derived_for = fresh
        if writes and current is not None:
            self._begin_row(current)
        self._derived_from = self._phase_inputs(desired, planned)

    def _phase_inputs(self, desired: DesiredState, planned: Plan) -> tuple[Any, ...] | None:
        """What the phases are derived from, in a form cheap to compare at 10,000 functions;
        None when the backend cannot say whether what runs changed."""
        health = self.backend.health_version(self.env)
        if health is None:
            return None
        return (
            desired.revision,
            self._url_base(),
            self._records.version,
            health,
            tuple(sorted(self._outcomes.items())),
            tuple((d.name, d.spec_hash) for d in planned.applies),
            tuple(planned.prunes),
            *(tuple(sorted(part.items())) for part in _decided(planned)),
        )

    def _conclude(
        self, desired: DesiredState, planned: Plan, current: _Pass
    ) -> tuple[str, str | None]:
        """Every function's phase from what is true now, and the pass's result from them."""
        keep = set(planned.retry_at) | {d.name for d in planned.applies}
        self._outcomes = {n: o for n, o in self._outcomes.items() if n in keep}
        self._write_phases(desired, planned, current)
        records = self._records.unsettled()
        failed_jobs = job_errors(desired.jobs, self.store.jobs(self.env))
        summary = summarize(records, desired, failed_jobs)
        return summary.result, summary.error

    def replica_event(self, env: str, name: str, kind: str, reason: str | None) -> None:
        """A replica of ``name`` ended (``exited``, with why) or is healthy again: look again."""
        if env == self.env and not self._stopping.is_set():
            self._follow_up()

    def url(self, fn: Function) -> str | None:
        return f"{self._url_base()}/fn/{self.env}/{fn.name}/" if fn.http else None

    def _url_base(self) -> str:
        """The backend's public address (a cluster's Gateway) if it has one, else ours."""
        return (self.backend.public_url() or self.public_url).rstrip("/")

    def publish(self) -> None:
        """Tell the proxy (and /metrics) what the repository declares and in which phase.

        The proxy answers a declared name that does not serve with 503, not 404.
        """
        version = self._records.version
        if self.backend.publishes:  # every pass: it puts back what was edited by hand
            self._report(self._records.all())
        if version == self._published:
            return
        self._published = version
        records = self._records.all()
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

    def _report(self, records: list[dict[str, Any]]) -> None:
        desired = self._desired.functions if self._desired else {}
        try:
            self.backend.report(self.env, records, desired, lambda: self.store.jobs(self.env))
        except SlessError as exc:  # the status view must never stop a pass
            logs.event(log, "status.unpublished", str(exc), level=logging.WARNING, env=self.env)

    def _settle_later(self) -> None:
        """Look again soon while the backend reports a rollout in progress."""
        starting = any(r["message"] == STARTING for r in self._records.unsettled().values())
        if self._stopping.is_set() or not (starting or self.backend.settling(self.env)):
            return
        if self._settle is None or not self._settle.is_alive():
            self._settle = threading.Timer(SETTLE_SEC, self.request_sync, args=("settle",))
            self._settle.daemon = True
            self._settle.start()


_deferring = 0  # passes under way that hold back cyclic garbage collection
_deferring_lock = threading.Lock()


@contextmanager
def _collections_deferred() -> Iterator[None]:
    """A pass allocates many short-lived objects; a cyclic collection in the middle of one
    scans the whole heap (millions of objects at 10,000 functions) and makes it several
    times slower. Collections wait for the last pass under way to end, then run if due."""
    global _deferring
    with _deferring_lock:
        _deferring += 1
        gc.disable()
    try:
        yield
    finally:
        with _deferring_lock:
            _deferring -= 1
            if _deferring == 0:
                gc.enable()


def _tail(exc: SlessError) -> str:
    return exc.log_tail if isinstance(exc, BuildFailed) else ""


def _build_error(exc: SlessError) -> str:
    """What the function says: the reason, then the log lines that tell why (the tag is shown
    beside it already; a one-line view keeps the reason)."""
    if not isinstance(exc, BuildFailed):
        return str(exc)
    if exc.summary is not None:  # the backend keeps the build's output out of the status
        return exc.summary
    why = failure.cause(exc.log_tail) if exc.log_tail.strip() else ""
    return f"build failed: {exc.reason}" + (f"\n{why}" if why else "")


def _decided(planned: Plan) -> tuple[Mapping[str, Any], ...]:
    return (planned.waiting, planned.failed, planned.building, planned.retry_at)


def _job_waits(desired: DesiredState, runs: list[dict[str, Any]]) -> dict[str, str]:
    """Jobs whose current run waits for something (a secret), with why."""
    current = {job.name: job.run_id for job in desired.jobs.values()}
    return {
        run["name"]: run["error"]
        for run in runs
        if run["phase"] == "Pending" and run["error"] and current.get(run["name"]) == run["run_id"]
    }


def _did(current: _Pass, done: Mapping[str, int]) -> str:
    parts = [
        f"{done['built']} built",
        f"{current.applies} deployed",
        f"{current.prunes} pruned",
        f"{done['jobs']} jobs run",
    ]
    failed = current.failures + done["build_failed"]
    if failed:
        parts.insert(2, f"{failed} failed")
    if current.mine:
        builds = sum(1 for key in current.mine if key[0] == "build")
        parts.append(f"{builds} builds and {len(current.mine) - builds} jobs started")
    return ", ".join(parts)


def _short(revision: str | None) -> str | None:
    return revision[:12] if revision else None


def _size(text: str) -> str:
    size = len(text.encode())
    return f"{size} byte" if size == 1 else f"{size} bytes"


def _summary(exc: SlessError) -> str:
    """What the log may say of a failed job: never what the job printed."""
    return exc.summary if isinstance(exc, JobFailed) else str(exc)


def _job_reader(env: str, fn: Function, job: Job) -> str:
    """Where a job's result and error are read: by those the API lets read them."""
    return (
        f"`gitops-sless logs {env}/{fn.name} --job {job.name}` "
        f"(GET /api/v1/environments/{env}/jobs)"
    )
