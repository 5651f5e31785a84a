"""Jobs: the job runs a plan asks for, in the background, and runs the store has not seen
(adopted) or a killed reconciler left behind (run again, up to MAX_JOB_ATTEMPTS)."""

from __future__ import annotations

import logging
import time

from .. import logs, telemetry
from ..errors import SlessError
from ..manifests.model import Function, Job
from ..plan.backend import JobFailed, SecretUnavailable, deployment_for
from ..plan.diff import FINISHED, job_results
from ..plan.planner import Plan
from ..telemetry.tracecontext import child_traceparent
from .context import Context, PassState, log

__all__ = ["MAX_JOB_ATTEMPTS", "Jobs"]

# a run interrupted by a reconciler crash runs again, as Kubernetes reruns a Job whose pod
# vanished (at-least-once), up to this many attempts in all
MAX_JOB_ATTEMPTS = 3


class Jobs:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def start(self, planned: Plan, current: PassState) -> int:
        """How many job runs started; a run whose secret is missing waits (Pending)."""
        ctx = self.ctx
        started = 0
        trace = telemetry.current()  # each run a span of this pass, wherever it runs
        for fn, job in planned.jobs:
            key = ("job", ctx.env, job.name, job.run_id)
            if self._can_run(fn, job) and ctx.work.start(
                key, lambda fn=fn, job=job: self.traced(fn, job, trace)
            ):
                current.mine.add(key)
                started += 1
        return started

    def adopt_runs(self) -> None:
        """Runs the backend remembers and the store does not (a new or emptied state folder)."""
        ctx = self.ctx
        for run in ctx.backend.job_runs(ctx.env):
            known = ctx.store.job_run(ctx.env, run.name, run.run_id)
            if known is not None and known["phase"] in FINISHED:
                continue
            ctx.store.set_job_run(
                ctx.env,
                run.name,
                run.run_id,
                function=run.function,
                phase=run.phase,
                result=run.result,
                error=run.error,
                finished=run.finished,
                attempts=(known["attempts"] if known else None) or 1,
            )

    def interrupted_runs(self) -> None:
        """Runs left 'Running' by a killed reconciler run again, up to MAX_JOB_ATTEMPTS."""
        ctx = self.ctx
        for run in ctx.store.jobs(ctx.env):
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
            ctx.store.set_job_run(ctx.env, run["name"], run["run_id"], phase=phase, error=error)
            logs.event(
                log,
                "job.interrupted",
                error,
                level=logging.WARNING,
                env=ctx.env,
                job=run["name"],
                runId=run["run_id"],
            )

    def _can_run(self, fn: Function, job: Job) -> bool:
        """A job whose secret is missing waits (Pending, with why), as its pod would."""
        ctx = self.ctx
        results = job_results(ctx.desired.jobs if ctx.desired else {}, ctx.store.jobs(ctx.env))
        why = ctx.backend.unavailable(ctx.env, deployment_for(ctx.env, fn, results).env_vars)
        if why is None:
            return True
        before = ctx.store.job_run(ctx.env, job.name, job.run_id) or {}
        if (before.get("phase"), before.get("error")) != ("Pending", why):
            ctx.store.set_job_run(
                ctx.env, job.name, job.run_id, function=fn.name, phase="Pending", error=why
            )
            where = {"env": ctx.env, "function": fn.name, "job": job.name, "runId": job.run_id}
            logs.event(log, "job.waiting", f"{job.name}: {why}", level=logging.WARNING, **where)
        return False

    def traced(self, fn: Function, job: Job, trace: object) -> None:
        attributes = {"sless.job": job.name, "sless.run_id": job.run_id, "sless.function": fn.name}
        with telemetry.span("job", attributes, trace) as span:
            # the run's trace: under its span when exported, else a trace of its own
            self.run(fn, job, span.traceparent() or child_traceparent(None))
            if telemetry.enabled():  # its record says how it went
                row = self.ctx.store.job_run(self.ctx.env, job.name, job.run_id) or {}
                span.set_attribute("sless.result", str(row.get("phase")))
                if row.get("phase") == "Failed":
                    span.failed(f"job {job.name} run {job.run_id} failed")

    def run(self, fn: Function, job: Job, traceparent: str) -> None:
        """One run, to its end; its record holds the result or the error. The runner gets
        ``traceparent`` (``SLESS_TRACEPARENT``) and the run's id (``SLESS_REQUEST_ID``)."""
        ctx = self.ctx
        env = ctx.env
        before = ctx.store.job_run(env, job.name, job.run_id)
        attempt = (before["attempts"] if before else 0) + 1
        ctx.store.set_job_run(
            env,
            job.name,
            job.run_id,
            function=fn.name,
            phase="Running",
            error=None,
            started=time.time(),
            finished=None,
            attempts=attempt,
        )
        where = {"env": env, "function": fn.name, "job": job.name, "runId": job.run_id}
        logs.event(
            log,
            "job.started",
            f"{job.name} run {job.run_id}, attempt {attempt}, trace {traceparent[3:35]}",
            **where,
        )
        declared = ctx.desired.jobs if ctx.desired else {}
        results = job_results(declared, ctx.store.jobs(env))
        try:
            deployment = deployment_for(env, fn, results)
            env_vars = {
                **deployment.env_vars,
                "SLESS_TRACEPARENT": traceparent,
                "SLESS_REQUEST_ID": f"{job.name}-{job.run_id}",
            }
            result = ctx.backend.run_job(env, fn, job, env_vars)
        except SecretUnavailable as exc:  # it went between the check and the start: wait again
            ctx.store.set_job_run(
                env, job.name, job.run_id, phase="Pending", error=str(exc), attempts=attempt - 1
            )
            logs.event(log, "job.waiting", f"{job.name}: {exc}", level=logging.WARNING, **where)
            return
        except SlessError as exc:
            if ctx.stopping.is_set():  # killed by the shutdown: the next start runs it again
                logs.event(log, "job.interrupted", f"{job.name}: {_summary(exc)}", **where)
                return
            ctx.store.set_job_run(
                env, job.name, job.run_id, phase="Failed", error=str(exc), finished=time.time()
            )
            ctx.done["jobs"] += 1
            said = f"{job.name}: {_summary(exc)}; its error ({_size(str(exc))}) is read with "
            logs.event(
                log, "job.failed", said + _reader(env, fn, job), level=logging.ERROR, **where
            )
            return
        ctx.store.set_job_run(
            env,
            job.name,
            job.run_id,
            phase="Succeeded",
            result=result,
            error=None,
            finished=time.time(),
        )
        ctx.done["jobs"] += 1
        # never the result itself: it is shown only to those who may read the API
        said = f"{job.name}: result of {_size(result)}, read with {_reader(env, fn, job)}"
        logs.event(log, "job.succeeded", said, **where)


def _size(text: str) -> str:
    size = len(text.encode())
    return f"{size} byte" if size == 1 else f"{size} bytes"


def _summary(exc: SlessError) -> str:
    """What the log may say of a failed job: never what the job printed."""
    return exc.summary if isinstance(exc, JobFailed) else str(exc)


def _reader(env: str, fn: Function, job: Job) -> str:
    """Where a job's result and error are read: by those the API lets read them."""
    return (
        f"`gitops-sless logs {env}/{fn.name} --job {job.name}` "
        f"(GET /api/v1/environments/{env}/jobs)"
    )
