"""The planner: desired state against what is built, run and deployed, as a list of work.

Pure: it reads what it is given and returns a Plan; it starts nothing. Every
pass plans again from scratch, so work that waits on something (a build, a
job result) is picked up by the first pass after it becomes possible, never by
an event that may not come.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..manifests.model import DesiredState, Function, Job
from .backend import Deployment, deployment_for

__all__ = ["Held", "Observed", "Plan", "plan"]

DeploymentFor = Callable[[str, Function, Mapping[str, str]], Deployment]


@dataclass(frozen=True)
class Held:
    """A deploy that failed: the same spec is not tried again before ``retry_at``."""

    spec_hash: str
    message: str
    retry_at: float


@dataclass(frozen=True)
class Observed:
    """What exists, as far as the planner needs to know."""

    built: frozenset[str]  # build tags with a finished artifact or image
    failed_builds: Mapping[str, str]  # tag -> error, for tags not to retry yet
    finished_runs: frozenset[tuple[str, int]]  # (job, runId) runs that ended, either way
    job_results: Mapping[str, str]  # job -> the result dependents receive
    deployed: Mapping[str, str]  # function -> spec hash of what runs
    job_errors: Mapping[str, str] = field(default_factory=dict)  # job -> why its run failed
    building: frozenset[str] = frozenset()  # tags whose build is under way
    running: frozenset[tuple[str, int]] = frozenset()  # (job, runId) runs under way
    job_waits: Mapping[str, str] = field(default_factory=dict)  # job -> why it cannot run yet
    held: Mapping[str, Held] = field(default_factory=dict)  # function -> its backed-off deploy
    serving: frozenset[str] = frozenset()  # functions with a last good version on record
    now: float = 0.0


@dataclass
class Plan:
    env: str
    builds: list[Function] = field(default_factory=list)  # one function per tag to build
    jobs: list[tuple[Function, Job]] = field(default_factory=list)
    applies: list[Deployment] = field(default_factory=list)
    prunes: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    # function -> why it is not deployed yet (Pending) or cannot be (Failed)
    waiting: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    building: dict[str, str] = field(default_factory=dict)  # function -> the tag under way
    retry_at: dict[str, float] = field(default_factory=dict)  # function -> its next deploy try
    refused: str | None = None  # why the prunes were held back (they would empty the env)
    # function -> the spec hash of a deploy held back on purpose (a pin, a rollout's)
    held: dict[str, str] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (self.builds or self.jobs or self.applies or self.prunes)


def _missing_results(fn: Function, env: str, observed: Observed) -> list[str]:
    return [job for job in fn.job_dependencies(env) if job not in observed.job_results]


def _plan_jobs(out: Plan, fn: Function, observed: Observed) -> None:
    for job in fn.jobs:
        run = (job.name, job.run_id)
        if job.run_id == 0 or run in observed.finished_runs or run in observed.running:
            continue
        missing = _missing_results(fn, out.env, observed)
        if missing:
            out.waiting.setdefault(fn.name, f"job {job.name} waits for job {', '.join(missing)}")
            continue
        out.jobs.append((fn, job))


def _waiting_reason(missing: list[str], all_jobs: Mapping[str, Job], observed: Observed) -> str:
    never = [name for name in missing if name in all_jobs and all_jobs[name].run_id == 0]
    if never:
        return f"waiting for job {', '.join(never)}, which has runId 0 and never runs"
    failed = [name for name in missing if name in observed.job_errors]
    if failed:
        name = failed[0]
        return (
            f"waiting for job {name}, whose run {all_jobs[name].run_id} failed: "
            f"{observed.job_errors[name]} (fix it and bump runId)"
        )
    stuck = [name for name in missing if name in observed.job_waits]
    if stuck:
        return f"waiting for job {stuck[0]}: {observed.job_waits[stuck[0]]}"
    return f"waiting for the result of job {', '.join(missing)}"


def _plan_build(out: Plan, fn: Function, observed: Observed, planned: set[str]) -> None:
    """``fn``'s tag is not built: build it, wait for the build under way, or say it failed."""
    tag = fn.build_tag
    if tag in observed.building or tag in planned:
        out.building[fn.name] = tag
    elif tag in observed.failed_builds:
        out.failed[fn.name] = observed.failed_builds[tag]
    else:
        planned.add(tag)
        out.builds.append(fn)
        out.building[fn.name] = tag


def _plan_deploy(out: Plan, deployment: Deployment, observed: Observed) -> None:
    name = deployment.name
    if observed.deployed.get(name) == deployment.spec_hash:
        out.unchanged.append(name)
        return
    held = observed.held.get(name)
    if held and held.spec_hash == deployment.spec_hash and observed.now < held.retry_at:
        out.failed[name] = held.message  # backing off, as Kubernetes does a crash loop
        out.retry_at[name] = held.retry_at
        return
    out.applies.append(deployment)


def plan(
    desired: DesiredState,
    env: str,
    observed: Observed,
    deployment: DeploymentFor = deployment_for,
) -> Plan:
    """What to do in ``env`` to bring what runs to ``desired``.

    Each function moves on its own: a build or job under way holds back only
    the function it belongs to (and those that take the job's result).
    """
    out = Plan(env)
    all_jobs = desired.jobs
    tags_planned: set[str] = set()
    for fn in desired.ordered:
        if fn.build_tag not in observed.built:
            _plan_build(out, fn, observed, tags_planned)
            continue
        _plan_jobs(out, fn, observed)
        missing = _missing_results(fn, env, observed)
        if missing:
            out.waiting[fn.name] = _waiting_reason(missing, all_jobs, observed)
            continue
        _plan_deploy(out, deployment(env, fn, observed.job_results), observed)
    keep = set(desired.functions) | set(desired.invalid_names)
    present = set(observed.deployed) | observed.serving
    out.prunes = sorted(name for name in present if name not in keep)
    return out
