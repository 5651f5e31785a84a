"""Job runs as Kubernetes Jobs: one per ``(name, runId)``, the result read from the pod's log.

The Job is followed by the view's watch on Jobs (:func:`runs.wait`): its end
is an event, not the answer to a GET; its pods are listed only while it has no
ready pod, at most every ``poll_sec``, to fail a run whose pod cannot start.

The Job's name holds the runId, so a run is created once whoever asks; a
reconciler that restarts while it runs waits for the same Job. When a run
ends, its result (or error) is written onto the Job as an annotation: the
cluster, not the local state folder, remembers which runs ended and what they
returned, so a reconciler with an empty state folder runs nothing again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from ..manifests.model import Function, Job
from ..plan.backend import EnvValue, JobFailed, JobRecord
from ..timestamps import epoch
from . import runs
from .client import AlreadyExists, KubeClient
from .renderer import FUNCTION_LABEL, JOB_LABEL, RUN_LABEL, RenderConfig, render_job
from .status import stuck_reason
from .view import View, annotation, label

__all__ = ["JobRunner", "finished_runs"]

RESULT = "gitops-sless.dev/result"
ERROR = "gitops-sless.dev/error"
MAX_RESULT_BYTES = 200_000  # annotations are capped at 256 KiB per object
LOG_TAIL_LINES = 40


def finished_runs(view: View) -> list[JobRecord]:
    """The runs whose result or error is recorded on their Job."""
    out = []
    for job in view.all("Job"):
        name, run_id = label(job, JOB_LABEL), label(job, RUN_LABEL)
        result, error = annotation(job, RESULT), annotation(job, ERROR)
        if not name or not run_id or (result is None and error is None):
            continue
        out.append(
            JobRecord(
                name=name,
                run_id=int(run_id),
                function=label(job, FUNCTION_LABEL) or "",
                phase="Succeeded" if error is None else "Failed",
                result=result,
                error=error,
                finished=epoch((job.get("status") or {}).get("completionTime")),
            )
        )
    return out


class JobRunner:
    def __init__(self, client: KubeClient, config: RenderConfig, poll_sec: float = 2.0) -> None:
        self.client = client
        self.config = config
        self.poll_sec = poll_sec

    def run(
        self,
        view: View,
        fn: Function,
        job: Job,
        env_vars: Mapping[str, EnvValue],
        image: str | None = None,
    ) -> str:
        """Run ``job`` with ``image`` (pinned; None: the build tag's, for tests)."""
        obj = render_job(view.env, fn, job, env_vars, self.config, image)
        name, namespace = obj["metadata"]["name"], view.namespace
        live = view.get("Job", name)
        if live is None:
            try:
                live = self.client.create(obj)
            except AlreadyExists:
                live = self.client.get("Job", namespace, name) or {}
            if live:
                view.put(live)
        recorded = annotation(live, RESULT), annotation(live, ERROR)
        if recorded[0] is not None:
            return recorded[0]
        if recorded[1] is not None:
            raise JobFailed(recorded[1], f"Job {name} failed (its error is recorded on it)")
        try:
            live = self._wait(view, name, fn.timeout_sec)
        except _Stuck as stuck:
            # a missing Secret fails the run as on the local backend (fix it, bump runId);
            # suspending the Job stops a pod that would otherwise start once it appears
            patch = {"metadata": {"annotations": {ERROR: str(stuck)}}, "spec": {"suspend": True}}
            view.put(self.client.patch("Job", namespace, name, patch))
            raise JobFailed(str(stuck)) from None
        output = self._log(namespace, name)
        if "Complete" in runs.conditions(live):
            # a pod log mixes stdout and stderr; the runner prints its result last, one line
            lines = [line for line in output.splitlines() if line.strip()]
            result = lines[-1].strip() if lines else ""
            problem = _bad_result(result)
            if problem is None:
                self._record(view, name, {RESULT: result})
                return result
            summary = f"Job {name}: {problem.split(':', 1)[0]}"  # never the output itself
        else:
            reason = summary = _failure(live)
            tail = "\n".join(output.splitlines()[-LOG_TAIL_LINES:])
            problem = f"{reason}: {tail}" if tail else reason
        self._record(view, name, {ERROR: problem})
        raise JobFailed(problem, summary)

    def _wait(self, view: View, name: str, timeout: int) -> dict[str, Any]:
        namespace, listed = view.namespace, [0.0]

        def check(job: dict[str, Any], waited: float) -> None:
            # the watch wakes this for every Job of the environment: LIST pods at most
            # every poll_sec, and only while no pod of this one is ready
            if waited <= 1 or (job.get("status") or {}).get("ready"):
                return
            if time.monotonic() - listed[0] < self.poll_sec:
                return
            listed[0] = time.monotonic()
            reason = stuck_reason(runs.pods(self.client, namespace, name))
            if reason:
                raise _Stuck(f"the job's pod cannot start: {reason}")

        limit = timeout + 120  # activeDeadlineSeconds ends it before
        try:
            return runs.wait(view.informer("Job"), name, limit, self.poll_sec, check)
        except runs.JobTimedOut:
            raise JobFailed(f"Job {name} did not finish within {limit} s") from None
        except runs.JobGone:
            raise JobFailed(f"Job {name} was deleted while it ran") from None

    def _log(self, namespace: str, name: str) -> str:
        return runs.log(self.client, namespace, name)

    def _record(self, view: View, name: str, annotations: Mapping[str, str]) -> None:
        patch = {"metadata": {"annotations": dict(annotations)}}
        view.put(self.client.patch("Job", view.namespace, name, patch))


class _Stuck(Exception):
    pass


def _bad_result(result: str) -> str | None:
    if len(result.encode()) > MAX_RESULT_BYTES:
        return f"result is {len(result.encode())} bytes; at most {MAX_RESULT_BYTES} are kept"
    try:
        json.loads(result)
    except ValueError:
        first = result.splitlines()[0][:200] if result else "(empty)"
        return f"the runner's output is not JSON: {first}"
    return None


def _failure(job: Mapping[str, Any]) -> str:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Failed" and cond.get("status") == "True":
            reason = cond.get("reason") or "Failed"
            if reason == "DeadlineExceeded":
                return "timed out (DeadlineExceeded)"
            return f"the Job failed ({reason})"
    return "the Job failed"
