"""The coordinator: a reconcile pass, and the loop that runs one pass at a time.

A pass is an ordered list of steps, one object each (``steps``): (at start-up)
restore what served, fetch, load, plan, start long work, deploy, prune, derive
every function's phase, report. Each function moves through its own pipeline
(build, the jobs it takes results from, deploy): a build or job runs in the
background, and the pass waits for it only while nothing else asks for a pass and its patience
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
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from . import logs, telemetry
from .errors import SlessError
from .manifests.model import DesiredState, Function
from .metrics import METRICS
from .plan.backend import Backend
from .plan.planner import Plan
from .source.snapshot import Snapshot
from .state.inflight import InFlight
from .state.revisions import DEFAULT_KEEP
from .state.routes import RouteTable
from .state.store import Store
from .steps import (
    Apply,
    Build,
    Context,
    Decide,
    Jobs,
    Load,
    PassState,
    Prune,
    Report,
    Restore,
    Revisions,
    Rollouts,
    Verdict,
)
from .steps.context import short

__all__ = ["PassResult", "Reconciler", "Source"]

log = logging.getLogger(__name__)

FOLLOW_UP = "follow-up"  # a build or job finished, or a replica came or went: look again
# passes nobody asked for in person: logged at debug level unless they change something
QUIET_TRIGGERS = ("poll", "settle", "preview", "rollout", FOLLOW_UP)
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
        keep_revisions: int = DEFAULT_KEEP,
        on_verdict: Callable[[Verdict], None] | None = None,
    ) -> None:
        """``leading()``: whether this replica may run passes (it holds the lease).

        ``follow_up()``: asks for a pass when background work finished; by
        default :meth:`request_sync`, for a reconciler that runs :meth:`run_forever`.
        ``clock()``: the time deploy backoffs are counted in. ``work``: the builds and
        jobs under way, shared by the reconcilers of one server (by default its own).
        ``keep_revisions``: how many revisions of each function stay runnable.
        ``on_verdict(verdict)``: hears each rollout start and end (the forge's commit
        status); it must return at once.
        """
        self.source = source
        self.backend = backend
        self.store = store
        self.env = env
        self.routes = routes
        self.public_url = public_url.rstrip("/")
        self.patience_sec = patience_sec
        self.leading = leading or (lambda: True)
        self._after_pass = after_pass  # previews run after each pass of the tracked branch
        self._follow_up = follow_up or (lambda: self.request_sync(FOLLOW_UP) and None)
        self._stopping = threading.Event()
        # builds and jobs: long, and shared with the other environments' reconcilers
        self._owns_work = work is None
        self.context = Context(
            env,
            backend,
            store,
            work or InFlight(max(16, workers)),
            ThreadPoolExecutor(workers, thread_name_prefix="sless-work"),
            build_retry_sec=build_retry_sec,
            clock=clock,
            stopping=self._stopping,
        )
        ctx = self.context
        self.revisions = Revisions(ctx, keep_revisions)
        self.rollouts = Rollouts(
            ctx,
            self.revisions,
            lambda: self.request_sync("rollout"),
            self.between_passes,
            on_verdict,
        )
        self.restore = Restore(ctx)
        self.load = Load(ctx)
        self.jobs = Jobs(ctx)
        self.decide = Decide(ctx, self.jobs, allow_empty, self.revisions, self.rollouts)
        self.build = Build(ctx)
        self.apply = Apply(ctx, self.revisions, self.rollouts)
        self.prune = Prune(ctx)
        self.report = Report(ctx, public_url, routes, lambda: self.request_sync("settle"))
        ctx.work.subscribe(self._work_done)
        self._wanted = threading.Event()
        self._triggers: list[str] = []
        self._idle = threading.Condition()
        self._passes = 0
        self._taken = False  # a pass has taken the waiting triggers and not finished yet
        self._follow_up_due = False  # work finished that no pass has looked at yet
        self._exclusive = threading.Lock()  # one pass, or one maintenance task, at a time
        self._last_revision: str | None = None
        self.jobs.interrupted_runs()
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
                self.context.records.reload()
                self.report.forget()
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
        self.report.stop()
        self.rollouts.stop()
        self.context.pool.shutdown(wait=False, cancel_futures=True)
        self.context.work.unsubscribe(self._work_done)
        if self._owns_work:
            self.context.work.shutdown()

    def exclusively(self, task: Callable[[], Any]) -> Any:
        """Run ``task`` between passes (garbage collection must not race a deploy)."""
        with self._exclusive:
            try:
                return task()
            finally:
                self.context.built.clear()  # it may have removed artifacts

    def restore_serving(self) -> None:
        """Once, at start-up: what served when the last reconciler stopped runs again (or
        is adopted), with the revisions kept beside it."""
        if not self.restore.done:
            self.restore.run(self.revisions.restored)
            self.rollouts.restored()

    def between_passes(self, task: Callable[[], Any]) -> Any:
        """Run ``task`` while no pass runs, as :meth:`exclusively` does, without forgetting
        what is built (it removes nothing)."""
        with self._exclusive:
            return task()

    def busy(self) -> bool:
        """Builds or job runs this environment waits for are under way."""
        return self._under_way()

    def _under_way(self) -> bool:
        """Work this environment waits for: its jobs, and builds of tags it wants."""
        ctx = self.context
        tags = {fn.build_tag for fn in ctx.functions()}
        return any(
            (key[0] == "job" and key[1] == self.env) or (ctx.builds_here(key) and key[1] in tags)
            for key in ctx.work.under_way()
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
                    return self._sync(PassState(trigger, time.time()))
            finally:
                with self._idle:
                    self._passes += 1
                    self._taken = False
                    self._idle.notify_all()
                if self._after_pass is not None:
                    self._after_pass()

    def _sync(self, current: PassState) -> PassResult:
        where = {"sless.environment": self.env, "sless.trigger": current.trigger}
        with telemetry.span("sync", where) as span:
            result = self._traced_sync(current)
            span.set_attribute("sless.result", result.result)
            if current.revision:
                span.set_attribute("sless.revision", current.revision)
            if result.result == "Failed":
                span.failed(result.error or "failed")
            return result

    def _traced_sync(self, current: PassState) -> PassResult:
        level = logging.DEBUG if current.trigger in QUIET_TRIGGERS else logging.INFO
        logs.event(log, "sync.started", f"trigger {current.trigger}", level=level, env=self.env)
        try:
            self.restore_serving()  # before the fetch: an unreachable remote changes nothing
            with telemetry.span("fetch"):
                fetched = self.source.fetch()
            snapshot = self.source.snapshot(getattr(fetched, "commit", None))
            current.revision = snapshot.revision
            desired = self.load.run(snapshot)
            self.load.log_problems(desired)
            last = self._converge(desired, snapshot, current)
            result, error = self.report.conclude(desired, last, current)
            if last.refused:
                result, error = "Failed", "; ".join(filter(None, [last.refused, error]))
            self.report.settle_later()
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

    def _finish(self, current: PassState, result: str, error: str | None) -> None:
        previous = self.store.last_sync(self.env)
        ctx = self.context
        done, ctx.done = ctx.done, dict.fromkeys(ctx.done, 0)
        if any(done.values()):
            ctx.begin_row(current)
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
        # a poll at a known commit that did nothing: not worth an info line
        quiet = current.trigger in QUIET_TRIGGERS and not current.changed
        quiet = quiet and current.revision == self._last_revision and not new_outcome
        self._last_revision = current.revision or self._last_revision
        took = time.time() - current.started
        logs.event(
            log,
            "sync.finished" if result != "Failed" else "sync.failed",
            f"{result} in {took:.2f}s ({_did(current, done)})" + (f": {error}" if error else ""),
            level=logging.DEBUG if quiet else (logging.WARNING if error else logging.INFO),
            env=self.env,
            revision=short(current.revision),
            syncId=current.sync_id,
            trigger=current.trigger,
            result=result,
        )

    def _failed(self, current: PassState, error: str) -> PassResult:
        self._finish(current, "Failed", error)
        return PassResult(current.revision, None, error, "Failed")

    def _converge(self, desired: DesiredState, snapshot: Snapshot, current: PassState) -> Plan:
        """Plan and act until nothing more can be done now; returns the last plan."""
        work = self.context.work
        deadline = time.monotonic() + self.patience_sec
        while True:
            since = work.mark()
            with telemetry.span("plan"):
                planned = self.decide.run(desired)
            started = self.build.start(planned, snapshot, current)
            started += self.jobs.start(planned, current)
            if started:
                self.context.begin_row(current)
                current.started_work += started
                self.report.started(desired, planned, current)
            with telemetry.span("apply", {"sless.deploys": len(planned.applies)}):
                self.apply.run(planned, snapshot.revision, current)
                self.rollouts.advance()
            with telemetry.span("prune", {"sless.removals": len(planned.prunes)}):
                self.prune.run(planned, current)
            left = deadline - time.monotonic()
            if not work.wait_any(current.mine, since, left, self._interrupted):
                return planned

    @property
    def allow_empty(self) -> bool:
        """Argo CD's allowEmpty: whether a commit that declares nothing may prune everything."""
        return self.decide.allow_empty

    @allow_empty.setter
    def allow_empty(self, value: bool) -> None:
        self.decide.allow_empty = value

    # --- what others ask ---------------------------------------------------------------

    def replica_event(self, env: str, name: str, kind: str, reason: str | None) -> None:
        """A replica of ``name`` ended (``exited``, with why) or is healthy again: look again."""
        if env == self.env and not self._stopping.is_set():
            self._follow_up()

    def declared(self) -> Mapping[str, Function]:
        """The functions the last state loaded declares (none before the first pass)."""
        desired = self.context.desired
        return desired.functions if desired is not None else {}

    def url(self, fn: Function) -> str | None:
        return self.report.url(fn)

    def publish(self) -> None:
        """Tell the proxy (and /metrics) what the repository declares and in which phase."""
        self.report.publish()


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


def _did(current: PassState, done: Mapping[str, int]) -> str:
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
