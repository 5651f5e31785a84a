"""Report: every function's phase from what is true now, the pass's result from them, and
what the proxy, /metrics and the backend's status view are told."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from .. import logs
from ..errors import SlessError
from ..manifests.model import DesiredState, Function
from ..metrics import METRICS
from ..plan.diff import job_errors
from ..plan.planner import Plan
from ..state import phases
from ..state.phases import STARTING, derive, summarize
from ..state.routes import Declared, RouteTable
from ..state.store import FUNCTION_PHASES
from .context import Context, PassState, log

__all__ = ["SETTLE_SEC", "Report"]

SETTLE_SEC = 1.0  # a backend reporting a rollout in progress is looked at again this soon


class Report:
    def __init__(
        self,
        ctx: Context,
        public_url: str,
        routes: RouteTable | None,
        settle: Callable[[], Any],
    ) -> None:
        """``settle()`` asks for a pass (while a rollout is in progress)."""
        self.ctx = ctx
        self.public_url = public_url.rstrip("/")
        self.routes = routes
        self._ask_settle = settle
        self._settle: threading.Timer | None = None
        # the (records version, revision) the proxy and /metrics last saw
        self._published: tuple[int, str | None] | None = None
        self._derived_from: tuple[Any, ...] | None = None  # the phases' inputs last pass
        self._derived_for: dict[str, tuple[Any, ...]] = {}  # and each function's
        self._derived_url: str | None = None  # the public address the URLs were made with

    def forget(self) -> None:
        """Another replica wrote the records: derive every phase again."""
        self._derived_for = {}

    def url(self, fn: Function) -> str | None:
        return f"{self._url_base()}/fn/{self.ctx.env}/{fn.name}/" if fn.http else None

    def _url_base(self) -> str:
        """The backend's public address (a cluster's Gateway) if it has one, else ours."""
        return (self.ctx.backend.public_url() or self.public_url).rstrip("/")

    def started(self, desired: DesiredState, planned: Plan, current: PassState) -> None:
        """Building and Pending show at once, not when the pass ends (it may wait)."""
        ctx = self.ctx
        names = [
            name for name in (*planned.building, *planned.waiting) if name in desired.functions
        ]
        health = ctx.backend.health(ctx.env)
        hashes = {**planned.held, **{d.name: d.spec_hash for d in planned.applies}}
        urls = {name: self.url(desired.functions[name]) for name in names}
        fields = derive(desired, planned, ctx.outcomes, health, hashes, urls, names)
        if ctx.records.update_many(fields):
            ctx.begin_row(current)

    def conclude(
        self, desired: DesiredState, planned: Plan, current: PassState
    ) -> tuple[str, str | None]:
        """Every function's phase from what is true now, and the pass's result from them."""
        ctx = self.ctx
        keep = set(planned.retry_at) | set(planned.held) | {d.name for d in planned.applies}
        ctx.outcomes = {n: o for n, o in ctx.outcomes.items() if n in keep}
        self._write_phases(desired, planned, current)
        records = ctx.records.unsettled()
        failed_jobs = job_errors(desired.jobs, ctx.store.jobs(ctx.env))
        summary = summarize(records, desired, failed_jobs)
        return summary.result, summary.error

    def _write_phases(self, desired: DesiredState, planned: Plan, current: PassState) -> None:
        ctx = self.ctx
        inputs = self._phase_inputs(desired, planned)
        if inputs is not None and inputs == self._derived_from:
            return  # nothing it is derived from changed: neither can a phase
        health = ctx.backend.health(ctx.env)
        hashes = {**planned.held, **{d.name: d.spec_hash for d in planned.applies}}
        # a new public address (a Gateway's) changes every URL, not only changed functions'
        seen = self._derived_for if self._url_base() == self._derived_url else {}
        self._derived_url = self._url_base()
        fresh = {
            name: phases.inputs(fn, planned, ctx.outcomes, health, hashes)
            for name, fn in desired.functions.items()
        }
        changed = [name for name, given in fresh.items() if seen.get(name) != given]
        urls = {name: self.url(desired.functions[name]) for name in changed}
        fields = derive(desired, planned, ctx.outcomes, health, hashes, urls, changed)
        writes = ctx.records.update_many(fields)
        # a refused prune (the guard against emptying an environment) leaves them serving:
        # they stay listed, and say why they still run
        kept = ctx.serving if planned.refused else set()
        for name in set(ctx.records.names()) - fresh.keys() - desired.invalid_names.keys():
            if name in kept:
                writes += ctx.records.update(name, message=planned.refused)
                continue
            ctx.records.delete(name)  # neither declared nor served: nothing to say of it
            writes += 1
        self._derived_for = fresh
        if writes:
            ctx.begin_row(current)
        self._derived_from = self._phase_inputs(desired, planned)

    def _phase_inputs(self, desired: DesiredState, planned: Plan) -> tuple[Any, ...] | None:
        """What the phases are derived from, in a form cheap to compare at 10,000 functions;
        None when the backend cannot say whether what runs changed."""
        ctx = self.ctx
        health = ctx.backend.health_version(ctx.env)
        if health is None:
            return None
        return (
            desired.revision,
            self._url_base(),
            ctx.records.version,
            health,
            tuple(sorted(ctx.outcomes.items())),
            tuple((d.name, d.spec_hash) for d in planned.applies),
            tuple(planned.prunes),
            *(tuple(sorted(part.items())) for part in _decided(planned)),
        )

    def publish(self) -> None:
        """Tell the proxy (and /metrics) what the repository declares and in which phase.

        The proxy answers a declared name that does not serve with 503, not 404.
        """
        ctx = self.ctx
        version = ctx.records.version
        if ctx.backend.publishes:  # every pass: it puts back what was edited by hand
            self._report(ctx.records.all())
        # a new revision may change what the records do not show (an async policy)
        published = (version, ctx.desired.revision if ctx.desired else None)
        if published == self._published:
            return
        self._published = published
        records = ctx.records.all()
        counts: dict[str, int] = dict.fromkeys(FUNCTION_PHASES, 0)
        for record in records:
            counts[record["phase"]] += 1
        for phase, count in counts.items():
            METRICS.functions.set(count, env=ctx.env, phase=phase)
        if self.routes is None:
            return
        self.routes.declare(ctx.env, {r["name"]: self._declared(r) for r in records})

    def _declared(self, record: dict[str, Any]) -> Declared:
        ctx = self.ctx
        name = record["name"]
        # an invalid manifest may never have said which triggers it has: 503
        http = record["url"] is not None or record["phase"] == "Invalid"
        fn = ctx.desired.functions.get(name) if ctx.desired else None
        if fn is None:  # not valid now: its last good version keeps running, as it said
            before = self.routes.declared(ctx.env, name) if self.routes else None
            if before is None:
                return Declared(record["phase"], record["message"], http)
            return replace(before, phase=record["phase"], message=record["message"], http=http)
        return Declared(record["phase"], record["message"], http, fn.async_policy, fn.subjects)

    def _report(self, records: list[dict[str, Any]]) -> None:
        ctx = self.ctx
        desired = ctx.desired.functions if ctx.desired else {}
        try:
            ctx.backend.report(ctx.env, records, desired, lambda: ctx.store.jobs(ctx.env))
        except SlessError as exc:  # the status view must never stop a pass
            logs.event(log, "status.unpublished", str(exc), level=logging.WARNING, env=ctx.env)

    def settle_later(self) -> None:
        """Look again soon while the backend reports a rollout in progress."""
        ctx = self.ctx
        starting = any(r["message"] == STARTING for r in ctx.records.unsettled().values())
        if ctx.stopping.is_set() or not (starting or ctx.backend.settling(ctx.env)):
            return
        if self._settle is None or not self._settle.is_alive():
            self._settle = threading.Timer(SETTLE_SEC, self._ask_settle)
            self._settle.daemon = True
            self._settle.start()

    def stop(self) -> None:
        if self._settle is not None:
            self._settle.cancel()


def _decided(planned: Plan) -> tuple[Mapping[str, Any], ...]:
    return (planned.waiting, planned.failed, planned.building, planned.retry_at)
