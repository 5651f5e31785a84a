"""Decide: observe what is built, run and deployed, and plan the work of this pass."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from ..manifests.model import DesiredState, Function
from ..plan.backend import Deployment, deployment_for
from ..plan.diff import FINISHED, job_errors, job_results
from ..plan.planner import Held, Observed, Plan, plan
from .context import Context, short
from .jobs import Jobs
from .revisions import Revisions
from .rollouts import Rollouts

__all__ = ["Decide"]


class Decide:
    def __init__(
        self,
        ctx: Context,
        jobs: Jobs,
        allow_empty: bool = False,
        revisions: Revisions | None = None,
        rollouts: Rollouts | None = None,
    ) -> None:
        self.ctx = ctx
        self.jobs = jobs
        # a pinned function's deploy is held (see Revisions), and one a rollout took on
        self.revisions = revisions or Revisions(ctx)
        self.rollouts = rollouts or Rollouts(ctx, self.revisions)
        # Argo CD's allowEmpty: without it, a pass never prunes every function at once
        self.allow_empty = allow_empty
        self._steady: tuple[tuple[Any, ...], Plan] | None = None  # the last idle plan

    def run(self, desired: DesiredState) -> Plan:
        ctx = self.ctx
        ctx.backend.refresh(ctx.env)
        self.jobs.adopt_runs()
        # first: a build that finishes after this is seen as under way, never as not started
        under_way = ctx.work.under_way()
        runs = ctx.store.jobs(ctx.env)
        key = self._steady_key(desired, under_way, runs)
        if key is not None and self._steady is not None and self._steady[0] == key:
            return self._steady[1]  # nothing the last (idle) plan came from changed
        planned = plan(
            desired, ctx.env, self._observe(desired, under_way, runs), self._deployment_for
        )
        self.revisions.hold_pinned(planned)
        self.rollouts.hold(planned)
        idle = planned.is_empty and not planned.failed and not planned.building
        self._steady = (key, planned) if key is not None and idle else None
        emptying = planned.prunes and not desired.functions and not desired.invalid_names
        if emptying and not self.allow_empty:
            # a wrong path or a bad fetch must not empty an environment (Argo CD: allowEmpty)
            planned.refused = (
                f"refused to prune all {len(planned.prunes)} functions of {ctx.env}: "
                f"revision {short(desired.revision)} declares none "
                "(serve --allow-empty permits it)"
            )
            planned.prunes = []
        return planned

    def _steady_key(
        self, desired: DesiredState, under_way: frozenset[Hashable], runs: list[dict[str, Any]]
    ) -> tuple[Any, ...] | None:
        """What a plan comes from, cheap to compare at 10,000 functions; None when the backend
        cannot say whether what runs changed (then every pass plans)."""
        ctx = self.ctx
        running = ctx.backend.health_version(ctx.env)
        if running is None:
            return None
        return (
            desired.revision,
            running,
            under_way,
            ctx.work.mark(),
            len(ctx.built),
            len(ctx.serving),
            tuple(sorted(ctx.outcomes.items())),
            tuple((r["name"], r["run_id"], r["phase"], r["error"]) for r in runs),
            self.revisions.pin_key(),
        )

    def _deployment_for(self, env: str, fn: Function, results: Mapping[str, str]) -> Deployment:
        """deployment_for, remembered while the function and the results it takes stay."""
        cache = self.ctx.deployments
        cached = cache.get(fn.name)
        if cached is not None and cached[0] is fn:
            deps = fn.job_dependencies(env) if cached[1] else ()
            if tuple(results.get(job) for job in deps) == cached[1]:
                return cached[2]
        deps = fn.job_dependencies(env)
        deployment = deployment_for(env, fn, results)
        cache[fn.name] = (fn, tuple(results.get(job) for job in deps), deployment)
        return deployment

    def _observe(
        self, desired: DesiredState, under_way: frozenset[Hashable], runs: list[dict[str, Any]]
    ) -> Observed:
        ctx = self.ctx
        now = ctx.clock()
        failed = {}
        for fn in desired.functions.values():
            tag = fn.build_tag
            if tag in ctx.built:
                continue
            if ctx.backend.is_built(fn):
                ctx.built.add(tag)
                continue
            # this scope's record only: a fork's failed build of the tag holds back no other
            record = ctx.store.build(tag, ctx.backend.build_scope)
            recent = record and now - (record["finished"] or 0) < ctx.build_retry_sec
            if recent and record["phase"] == "Failed":
                failed[tag] = record["error"] or "build failed"
        finished = frozenset((r["name"], r["run_id"]) for r in runs if r["phase"] in FINISHED)
        return Observed(
            built=frozenset(ctx.built),
            failed_builds=failed,
            finished_runs=finished,
            job_results=job_results(desired.jobs, runs),
            deployed=ctx.backend.deployed(ctx.env),
            job_errors=job_errors(desired.jobs, runs),
            building=frozenset(key[1] for key in under_way if ctx.builds_here(key)),
            running=frozenset(
                key[2:] for key in under_way if key[0] == "job" and key[1] == ctx.env
            ),
            job_waits=_job_waits(desired, runs),
            held={
                name: Held(o.spec_hash, o.message, o.retry_at)
                for name, o in ctx.outcomes.items()
                if o.retry_at is not None
            },
            serving=frozenset(ctx.serving),
            now=now,
        )


def _job_waits(desired: DesiredState, runs: list[dict[str, Any]]) -> dict[str, str]:
    """Jobs whose current run waits for something (a secret), with why."""
    current = {job.name: job.run_id for job in desired.jobs.values()}
    return {
        run["name"]: run["error"]
        for run in runs
        if run["phase"] == "Pending" and run["error"] and current.get(run["name"]) == run["run_id"]
    }
