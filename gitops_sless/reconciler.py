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

from . import manifest
from .backend import Backend, BuildFailed, Deployment, deployment_for
from .errors import SlessError
from .manifest import DesiredState, Function, Job
from .metrics import METRICS
from .planner import Observed, Plan, plan
from .source import Snapshot
from .store import Store

__all__ = ["Reconciler", "Source"]

log = logging.getLogger(__name__)

FINISHED = ("Succeeded", "Failed", "Skipped")
MAX_ROUNDS = 5  # plan again after jobs finish, so their dependents deploy in the same pass


class Source(Protocol):
    """Where snapshots come from: a mirror of a remote, or a fixed snapshot in tests."""

    def fetch(self) -> Any: ...

    def snapshot(self, commit: str | None = None) -> Snapshot: ...


@dataclass(frozen=True)
class PassResult:
    revision: str | None
    plan: Plan | None
    error: str | None


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
    ) -> None:
        self.source = source
        self.backend = backend
        self.store = store
        self.env = env
        self.public_url = public_url.rstrip("/")
        self.build_retry_sec = build_retry_sec
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sless-work")
        self._desired: DesiredState | None = None
        self._manifests = manifest.ManifestCache()
        self._wanted = threading.Event()
        self._triggers: list[str] = []
        self._stopping = threading.Event()
        self._idle = threading.Condition()
        self._passes = 0
        self._interrupted_runs()

    # --- the loop ----------------------------------------------------------------------

    def request_sync(self, trigger: str) -> None:
        """Ask for a pass; requests that arrive while one runs become one more pass."""
        self._triggers.append(trigger)
        self._wanted.set()

    def run_forever(self) -> None:
        while not self._stopping.is_set():
            if not self._wanted.wait(0.5):
                continue
            self._wanted.clear()
            triggers, self._triggers = self._triggers, []
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
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- one pass ------------------------------------------------------------------------

    def sync(self, trigger: str = "manual") -> PassResult:
        sync_id = self.store.begin_sync(self.env, trigger)
        revision = None
        try:
            fetched = self.source.fetch()
            snapshot = self.source.snapshot(getattr(fetched, "commit", None))
            revision = snapshot.revision
            desired = self._load(snapshot)
            last = self._converge(desired, snapshot)
            result = "Succeeded" if not desired.invalid else "Invalid"
            error = "; ".join(str(e).splitlines()[0] for e in desired.invalid.values()) or None
            self.store.finish_sync(sync_id, result, revision, error)
            METRICS.syncs.inc(env=self.env, result=result)
            return PassResult(revision, last, error)
        except SlessError as exc:
            return self._failed(sync_id, revision, str(exc))
        except Exception as exc:  # a bug must not stop the loop or what is running
            log.exception("sync pass crashed")
            return self._failed(sync_id, revision, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            with self._idle:
                self._passes += 1
                self._idle.notify_all()

    def _failed(self, sync_id: int, revision: str | None, error: str) -> PassResult:
        log.warning("sync failed: %s", error)
        self.store.finish_sync(sync_id, "Failed", revision, error)
        METRICS.syncs.inc(env=self.env, result="Failed")
        return PassResult(revision, None, error)

    def _load(self, snapshot: Snapshot) -> DesiredState:
        cached = self._desired
        if cached is not None and cached.revision == snapshot.revision:
            return cached
        desired = manifest.load(snapshot, self._manifests)
        self._desired = desired
        return desired

    def _converge(self, desired: DesiredState, snapshot: Snapshot) -> Plan:
        current = plan(desired, self.env, self._observe(desired))
        for _ in range(MAX_ROUNDS):
            self._report(current, desired)
            self._run_all(lambda fn: self._build(fn, snapshot), current.builds)
            self._run_all(lambda item: self._run_job(*item), current.jobs)
            self._run_all(lambda d: self._apply(d, snapshot.revision), current.applies)
            for name in current.prunes:
                self._prune(name)
            if not (current.builds or current.jobs):
                break
            current = plan(desired, self.env, self._observe(desired))
        return current

    def _run_all(self, step: Callable[[Any], None], items: Iterable[Any]) -> None:
        for future in [self._pool.submit(step, item) for item in items]:
            future.result()

    # --- observing --------------------------------------------------------------------------

    def _observe(self, desired: DesiredState) -> Observed:
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
            job_results=self._job_results(desired, runs),
            deployed=self.backend.deployed(self.env),
            job_errors=self._job_errors(desired, runs),
        )

    def _job_errors(self, desired: DesiredState, runs: list[dict[str, Any]]) -> dict[str, str]:
        """Why the current runId of a job failed, for the jobs whose current run did."""
        current = {job.name: job.run_id for job in desired.jobs.values()}
        return {
            run["name"]: run["error"] or "failed"
            for run in runs
            if run["phase"] == "Failed" and current.get(run["name"]) == run["run_id"]
        }

    def _job_results(self, desired: DesiredState, runs: list[dict[str, Any]]) -> dict[str, str]:
        """The result each job hands on: the current runId's, else the newest that succeeded."""
        results: dict[str, str] = {}
        current = {job.name: job.run_id for job in desired.jobs.values()}
        for run in sorted(runs, key=lambda r: r["run_id"]):  # newest wins
            if run["phase"] == "Succeeded" and run["result"] is not None:
                results[run["name"]] = run["result"]
        for run in runs:
            if run["phase"] == "Succeeded" and current.get(run["name"]) == run["run_id"]:
                results[run["name"]] = run["result"]
        return results

    def _interrupted_runs(self) -> None:
        """Runs left 'Running' by a killed reconciler ended without a result: never rerun them."""
        for env in self.store.environments():
            for run in self.store.jobs(env):
                if run["phase"] == "Running":
                    self.store.set_job_run(
                        env,
                        run["name"],
                        run["run_id"],
                        phase="Failed",
                        error="interrupted: the reconciler stopped while the job ran; "
                        "bump runId to run it again",
                        finished=time.time(),
                    )

    # --- steps ---------------------------------------------------------------------------------

    def _build(self, fn: Function, snapshot: Snapshot) -> None:
        users = [f for f in self._desired_functions() if f.build_tag == fn.build_tag]
        for user in users:
            self.store.set_function(self.env, user.name, phase="Building", build_tag=fn.build_tag)
        self.store.start_build(fn.build_tag, fn.runtime, fn.source_id)
        try:
            build_log = self.backend.build(fn, snapshot)
        except BuildFailed as exc:
            self.store.finish_build(fn.build_tag, "Failed", exc.log_tail, str(exc))
            METRICS.builds.inc(runtime=fn.runtime, result="Failed")
            message = f"{exc}\n{exc.log_tail[-1500:]}"
            for user in users:
                self.store.set_function(self.env, user.name, phase="Failed", message=message)
            return
        self.store.finish_build(fn.build_tag, "Succeeded", build_log)
        METRICS.builds.inc(runtime=fn.runtime, result="Succeeded")

    def _desired_functions(self) -> list[Function]:
        return list(self._desired.functions.values()) if self._desired else []

    def _run_job(self, fn: Function, job: Job) -> None:
        self.store.set_job_run(
            self.env, job.name, job.run_id, function=fn.name, phase="Running", started=time.time()
        )
        results = self._job_results(self._desired or DesiredState(""), self.store.jobs(self.env))
        try:
            deployment = deployment_for(self.env, fn, results)
            result = self.backend.run_job(self.env, fn, job, deployment.env_vars)
        except SlessError as exc:
            self.store.set_job_run(
                self.env, job.name, job.run_id, phase="Failed", error=str(exc), finished=time.time()
            )
            return
        self.store.set_job_run(
            self.env, job.name, job.run_id, phase="Succeeded", result=result, finished=time.time()
        )

    def _apply(self, deployment: Deployment, revision: str) -> None:
        fn = deployment.function
        try:
            self.backend.apply(deployment)
        except SlessError as exc:
            self.store.set_function(self.env, fn.name, phase="Failed", message=str(exc))
            return
        self.store.set_function(
            self.env,
            fn.name,
            phase="Ready" if fn.enabled else "Disabled",
            build_tag=fn.build_tag,
            revision=revision,
            message=None,
            spec={"hash": deployment.spec_hash, "replicas": fn.replicas, "http": fn.http},
        )

    def _prune(self, name: str) -> None:
        self.backend.remove(self.env, name)
        self.store.delete_function(self.env, name)

    # --- status ----------------------------------------------------------------------

    def url(self, fn: Function) -> str | None:
        return f"{self.public_url}/fn/{self.env}/{fn.name}/" if fn.http else None

    def _report(self, current: Plan, desired: DesiredState) -> None:
        """Write each function's phase and message, only where they changed."""
        records = {r["name"]: r for r in self.store.functions(self.env)}  # one query, not N

        def update(name: str, **fields: Any) -> None:
            record = records.get(name)
            if record is None or any(record.get(k) != v for k, v in fields.items()):
                self.store.set_function(self.env, name, **fields)

        for name, path in desired.invalid_names.items():
            update(name, phase="Invalid", manifest=path, message=str(desired.invalid[path]))
        for name, reason in current.waiting.items():
            update(name, phase="Pending", message=reason)
        for name, reason in current.failed.items():
            if records.get(name, {}).get("phase") != "Failed":  # keep the build's log tail
                update(name, phase="Failed", message=reason)
        for fn in desired.functions.values():
            update(fn.name, manifest=fn.manifest, url=self.url(fn))
