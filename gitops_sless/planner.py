"""The planner: desired state against what is built, run and deployed, as a list of work.

Pure: it reads what it is given and returns a Plan; it starts nothing. Every
pass plans again from scratch, so work that waits on something (a build, a
job result) is picked up by the first pass after it becomes possible, never by
an event that may not come.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .backend import Deployment, deployment_for
from .manifest import DesiredState, Function, Job

__all__ = ["Observed", "Plan", "plan"]


@dataclass(frozen=True)
class Observed:
    """What exists, as far as the planner needs to know."""

    built: frozenset[str]  # build tags with a finished artifact or image
    failed_builds: Mapping[str, str]  # tag -> error, for tags not to retry yet
    finished_runs: frozenset[tuple[str, int]]  # (job, runId) runs that ended, either way
    job_results: Mapping[str, str]  # job -> the result dependents receive
    deployed: Mapping[str, str]  # function -> spec hash of what runs
    job_errors: Mapping[str, str] = field(default_factory=dict)  # job -> why its run failed


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
    refused: str | None = None  # why the prunes were held back (they would empty the env)

    @property
    def is_empty(self) -> bool:
        return not (self.builds or self.jobs or self.applies or self.prunes)


def _missing_results(fn: Function, env: str, observed: Observed) -> list[str]:
    return [job for job in fn.job_dependencies(env) if job not in observed.job_results]


def _plan_jobs(out: Plan, fn: Function, observed: Observed) -> None:
    for job in fn.jobs:
        if job.run_id == 0 or (job.name, job.run_id) in observed.finished_runs:
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
    return f"waiting for the result of job {', '.join(missing)}"


def plan(desired: DesiredState, env: str, observed: Observed) -> Plan:
    """What to do in ``env`` to bring what runs to ``desired``."""
    out = Plan(env)
    all_jobs = desired.jobs
    tags_planned: set[str] = set()
    for fn in sorted(desired.functions.values(), key=lambda f: f.name):
        if fn.build_tag not in observed.built:
            if fn.build_tag in observed.failed_builds:
                out.failed[fn.name] = observed.failed_builds[fn.build_tag]
            elif fn.build_tag not in tags_planned:
                tags_planned.add(fn.build_tag)
                out.builds.append(fn)
            continue
        _plan_jobs(out, fn, observed)
        missing = _missing_results(fn, env, observed)
        if missing:
            out.waiting[fn.name] = _waiting_reason(missing, all_jobs, observed)
            continue
        deployment = deployment_for(env, fn, observed.job_results)
        if observed.deployed.get(fn.name) == deployment.spec_hash:
            out.unchanged.append(fn.name)
        else:
            out.applies.append(deployment)
    keep = set(desired.functions) | set(desired.invalid_names)
    out.prunes = sorted(name for name in observed.deployed if name not in keep)
    return out
