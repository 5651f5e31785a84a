"""Images built in the cluster: a build context in S3, a kaniko Job per tag, a record per image.

A tag is built at most once, whoever asks and however often the reconciler
restarts: the context is uploaded only if absent, the Job is named from the
tag (an existing one is adopted and waited for, never duplicated), and the
finished image is recorded in a ConfigMap in the reconciler's namespace, so
a reconciler with an empty state folder knows what is built without asking
a registry.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..backend import BuildFailed
from ..manifest import Function
from ..renderer import BUILD_LABEL, MANAGED_BY, RenderConfig, build_job, build_job_name, image_ref
from ..source import Snapshot
from ..timestamps import epoch
from . import runs
from .client import AlreadyExists, KubeClient
from .contexts import build_context
from .status import stuck_reason
from .storage import ContextStore

__all__ = ["Builds"]

log = logging.getLogger(__name__)

RECORD_LABEL = "gitops-sless.dev/record"
LOG_TAIL_LINES = 60


def _built_name(tag: str) -> str:
    return "built-" + tag.replace(".", "-").replace("_", "-")


def _finished_at(job: dict[str, Any]) -> float:
    for cond in runs.conditions(job).values():
        stamp = epoch(cond.get("lastTransitionTime"))
        if stamp:
            return stamp
    return 0.0


class Builds:
    """Which tags have an image, and building the ones that do not."""

    def __init__(
        self,
        client: KubeClient,
        contexts: ContextStore,
        config: RenderConfig,
        *,
        retry_sec: float = 300.0,
        start_timeout_sec: float = 300.0,
        poll_sec: float = 2.0,
        ensure_secret: Callable[[], None] = lambda: None,
    ) -> None:
        self.client = client
        self.contexts = contexts
        self.config = config
        self.namespace = config.controller_namespace
        self.retry_sec = retry_sec
        self.start_timeout_sec = start_timeout_sec
        self.poll_sec = poll_sec
        self._ensure_secret = ensure_secret
        self._built: set[str] = set()
        self._lock = threading.Lock()

    # --- what is built -----------------------------------------------------------------

    def refresh(self) -> None:
        records = self.client.list("ConfigMap", self.namespace, {RECORD_LABEL: "built"})
        built = {tag for r in records if (tag := (r.get("data") or {}).get("tag"))}
        with self._lock:
            self._built = built

    def is_built(self, tag: str) -> bool:
        return tag in self._built

    def built(self) -> set[str]:
        return set(self._built)

    def _record(self, fn: Function, took: float) -> None:
        record = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": _built_name(fn.build_tag),
                "namespace": self.namespace,
                "labels": {MANAGED_BY: "gitops-sless", RECORD_LABEL: "built"},
            },
            "data": {
                "tag": fn.build_tag,
                "image": image_ref(self.config, fn.build_tag),
                "runtime": fn.runtime,
                "folder": fn.folder,
                "seconds": f"{took:.1f}",
            },
        }
        record["metadata"]["labels"][BUILD_LABEL] = fn.build_tag
        # AlreadyExists: built by an earlier attempt that stopped before it knew
        with contextlib.suppress(AlreadyExists):
            self.client.create(record)
        with self._lock:
            self._built = {*self._built, fn.build_tag}

    # --- building ------------------------------------------------------------------------

    def build(self, fn: Function, snapshot: Snapshot) -> str:
        """Build ``fn.build_tag`` in the cluster and wait; the build's log. Raises BuildFailed."""
        tag, started = fn.build_tag, time.monotonic()
        name = build_job_name(tag)
        job = self.client.get("Job", self.namespace, name)
        if job is not None and "Failed" in runs.conditions(job):
            if time.time() - _finished_at(job) < self.retry_sec:
                raise BuildFailed(tag, self._failure(job), self._log(name))
            self.client.delete("Job", self.namespace, name, "Background")  # a retry, later
            job = None
        if job is None:
            key = self.contexts.key(tag)
            uploaded = self.contexts.upload_if_absent(key, build_context(fn, snapshot))
            log.debug("%s: context %s (%s)", tag, key, "uploaded" if uploaded else "present")
            self._ensure_secret()
            try:
                job = self.client.create(build_job(fn, self.config))
            except AlreadyExists:  # another replica or an earlier attempt made it: adopt it
                job = self.client.get("Job", self.namespace, name) or {}
        job = self._wait(tag, name, job)
        build_log = self._log(name)
        if "Complete" not in runs.conditions(job):
            raise BuildFailed(tag, self._failure(job), build_log)
        self._record(fn, time.monotonic() - started)
        return build_log

    def _wait(self, tag: str, name: str, job: dict[str, Any]) -> dict[str, Any]:
        def check(job: dict[str, Any], waited: float) -> None:
            if waited > 2 and not (job.get("status") or {}).get("succeeded"):
                self._check_start(tag, name, waited)

        timeout = self.config.build_timeout_sec
        try:
            return runs.wait(
                self.client, self.namespace, name, job, timeout + 60, self.poll_sec, check
            )
        except runs.JobTimedOut:
            raise BuildFailed(tag, f"no result after {timeout} s") from None
        except runs.JobGone:
            raise BuildFailed(tag, f"build Job {name} was deleted while it ran") from None

    def _check_start(self, tag: str, name: str, waited: float) -> None:
        """A pod that cannot start fails the build with the kubelet's reason."""
        pods = runs.pods(self.client, self.namespace, name)
        reason = stuck_reason(pods)
        if reason:
            self.client.delete("Job", self.namespace, name, "Background")
            raise BuildFailed(tag, f"build pod cannot start: {reason}")
        pending = any((pod.get("status") or {}).get("phase") == "Pending" for pod in pods)
        if pending and waited > self.start_timeout_sec:
            self.client.delete("Job", self.namespace, name, "Background")
            raise BuildFailed(tag, f"build pod still Pending after {self.start_timeout_sec:.0f} s")

    def _failure(self, job: dict[str, Any]) -> str:
        cond = runs.conditions(job).get("Failed") or {}
        reason = cond.get("reason") or "Failed"
        if reason == "DeadlineExceeded":
            return f"timed out after {self.config.build_timeout_sec} s (DeadlineExceeded)"
        return f"kaniko failed ({reason}{': ' + cond['message'] if cond.get('message') else ''})"

    def _log(self, name: str) -> str:
        return runs.log(self.client, self.namespace, name, LOG_TAIL_LINES)
