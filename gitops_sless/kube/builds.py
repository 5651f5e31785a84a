"""Images built in the cluster: a build context in S3, a kaniko Job per tag, a record per image.

A tag is built at most once, whoever asks and however often the reconciler
restarts: the context is uploaded only if absent, the Job is named from the
tag (an existing one is adopted and waited for, never duplicated), and the
finished image is recorded in a ConfigMap in the reconciler's namespace, so
a reconciler with an empty state folder knows what is built without asking
a registry.

The record keeps the digest kaniko pushed (its termination message), and
what runs is that digest: a tag pushed again, by anyone, changes no pod.
Builds of untrusted code (a fork's preview) run in their own namespace and
push to their own repository; their records say so, and a trusted
environment never runs what they built: it builds the tag again itself.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from typing import Any

from ..backend import BuildFailed
from ..manifest import Function
from ..renderer import (
    BUILD_LABEL,
    MANAGED_BY,
    RenderConfig,
    build_job,
    build_job_name,
    image_ref,
    pinned_image,
)
from ..source import Snapshot
from ..timestamps import epoch
from . import runs
from .client import AlreadyExists, Invalid, KubeClient, NotFound
from .contexts import build_context
from .informer import Informer
from .status import stuck_reason
from .storage import ContextStore

__all__ = ["Builds", "exit_summary", "pushed_digest"]

log = logging.getLogger(__name__)

RECORD_LABEL = "gitops-sless.dev/record"
LOG_TAIL_LINES = 60
FETCH_CONTAINER = "fetch-context"
KANIKO_CONTAINER = "kaniko"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_PUSHED = re.compile(r"Pushed \S+@(sha256:[0-9a-f]{64})")


def _record_name(tag: str, trusted: bool) -> str:
    # not built-<tag>: those records, from before images were pinned, have no digest
    prefix = "pinned-" if trusted else "untrusted-"
    return prefix + tag.replace(".", "-").replace("_", "-")


def _finished_at(job: dict[str, Any]) -> float:
    for cond in runs.conditions(job).values():
        stamp = epoch(cond.get("lastTransitionTime"))
        if stamp:
            return stamp
    return 0.0


def _terminated(pod: dict[str, Any], container: str) -> dict[str, Any]:
    status = pod.get("status") or {}
    for found in (status.get("initContainerStatuses") or []) + (
        status.get("containerStatuses") or []
    ):
        if found.get("name") == container:
            return (found.get("state") or {}).get("terminated") or {}
    return {}


def _newest(pods: list[dict[str, Any]]) -> dict[str, Any]:
    return max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", default={})


def pushed_digest(pods: list[dict[str, Any]], build_log: str) -> str | None:
    """The digest kaniko pushed: its termination message (``--digest-file``), else its log."""
    message = str(_terminated(_newest(pods), KANIKO_CONTAINER).get("message") or "").strip()
    if _DIGEST.fullmatch(message):
        return message
    found = _PUSHED.findall(build_log)
    return found[-1] if found else None


def exit_summary(pods: list[dict[str, Any]]) -> str | None:
    """What a failed build pod says in a few words: which step exited with which code.

    Never its output: that is the build's log, for readers with a token."""
    pod = _newest(pods)
    fetch = _terminated(pod, FETCH_CONTAINER)
    if fetch.get("exitCode"):
        return f"build context could not be fetched (exit {fetch['exitCode']})"
    kaniko = _terminated(pod, KANIKO_CONTAINER)
    if "exitCode" in kaniko and kaniko["exitCode"] != 0:
        return f"build failed (exit {kaniko['exitCode']})"
    return None


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
        **informer_options: Any,
    ) -> None:
        self.client = client
        self.contexts = contexts
        self.config = config
        self.namespace = config.controller_namespace
        self.retry_sec = retry_sec
        self.start_timeout_sec = start_timeout_sec
        self.poll_sec = poll_sec
        self._digests: dict[tuple[str, bool], str] = {}  # (tag, trusted) -> digest
        self._lock = threading.Lock()
        self._records = Informer(
            client, "ConfigMap", self.namespace, {RECORD_LABEL: "built"}, **informer_options
        )

    # --- what is built -----------------------------------------------------------------

    def sync(self) -> None:
        """What is built, from the records' informer: no request while its watch is sound."""
        self._records.sync()
        self._read(self._records.items())

    def refresh(self) -> None:
        """What is built, from a fresh LIST of the records (after garbage collection)."""
        self._records.fresh = False
        self.sync()

    def close(self) -> None:
        self._records.stop()

    def _read(self, records: list[dict[str, Any]]) -> None:
        digests = {}
        for record in records:
            data = record.get("data") or {}
            tag, digest = data.get("tag"), data.get("digest") or ""
            # a record without a digest predates pinning: its tag is built again
            if tag and _DIGEST.fullmatch(digest):
                digests[(tag, data.get("trust") != "untrusted")] = digest
        with self._lock:
            self._digests = digests

    def image(self, tag: str, trusted: bool = True) -> str | None:
        """The pinned image an environment of this trust runs for ``tag``, or None.

        Untrusted environments run a trusted image when there is one, never the reverse."""
        for built_trusted in (True,) if trusted else (True, False):
            digest = self._digests.get((tag, built_trusted))
            if digest:
                return pinned_image(self.config, digest, built_trusted)
        return None

    def is_built(self, tag: str, trusted: bool = True) -> bool:
        return self.image(tag, trusted) is not None

    def images(self, trusted: bool = True) -> dict[str, str]:
        """Every tag built for this trust -> the pinned image it runs."""
        tags = {tag for tag, _ in self._digests}
        return {tag: image for tag in tags if (image := self.image(tag, trusted))}

    def _record(self, fn: Function, digest: str, trusted: bool, took: float) -> None:
        labels = {MANAGED_BY: "gitops-sless", RECORD_LABEL: "built", BUILD_LABEL: fn.build_tag}
        record = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": _record_name(fn.build_tag, trusted),
                "namespace": self.namespace,
                "labels": labels,
            },
            "data": {
                "tag": fn.build_tag,
                "image": image_ref(self.config, fn.build_tag, trusted),
                "digest": digest,
                "trust": "trusted" if trusted else "untrusted",
                "runtime": fn.runtime,
                "folder": fn.folder,
                "seconds": f"{took:.1f}",
            },
        }
        # AlreadyExists: built by an earlier attempt that stopped before it knew
        with contextlib.suppress(AlreadyExists):
            self._records.put(self.client.create(record))
        with self._lock:
            self._digests = {**self._digests, (fn.build_tag, trusted): digest}

    # --- building ------------------------------------------------------------------------

    def build(self, fn: Function, snapshot: Snapshot, trusted: bool = True) -> str:
        """Build ``fn.build_tag`` in the cluster and wait; the build's log. Raises BuildFailed."""
        tag, started = fn.build_tag, time.monotonic()
        namespace = self.namespace if trusted else self.config.untrusted_namespace
        name = build_job_name(tag)
        job = self.client.get("Job", namespace, name)
        if job is not None and "Failed" in runs.conditions(job):
            if time.time() - _finished_at(job) < self.retry_sec:
                raise self._failed(tag, namespace, name, job)
            self.client.delete("Job", namespace, name, "Background")  # a retry, later
            job = None
        if job is None:
            job = self._start(fn, snapshot, namespace, trusted)
        job = self._wait(tag, namespace, name, job)
        if "Complete" not in runs.conditions(job):
            raise self._failed(tag, namespace, name, job)
        pods = runs.pods(self.client, namespace, name)
        build_log = self._log(namespace, pods)
        digest = pushed_digest(pods, build_log)
        if digest is None:
            raise BuildFailed(
                tag, "kaniko reported no image digest", build_log, "build failed (no digest)"
            )
        self._record(fn, digest, trusted, time.monotonic() - started)
        # the build's status (the API's build log) names what runs: the image by its digest
        return f"{build_log.rstrip()}\nrecorded {pinned_image(self.config, digest, trusted)}\n"

    def _start(
        self, fn: Function, snapshot: Snapshot, namespace: str, trusted: bool
    ) -> dict[str, Any]:
        """Upload the context, and create the Job with a URL that reads it (no key)."""
        tag = fn.build_tag
        key = self.contexts.key(tag)
        uploaded = self.contexts.upload_if_absent(key, build_context(fn, snapshot))
        log.debug("%s: context %s (%s)", tag, key, "uploaded" if uploaded else "present")
        url = self.contexts.presigned_get(key)
        try:
            return self.client.create(build_job(fn, self.config, url, trusted))
        except AlreadyExists:  # another replica or an earlier attempt made it: adopt it
            return self.client.get("Job", namespace, build_job_name(tag)) or {}
        except NotFound:
            raise BuildFailed(
                tag,
                f"namespace {namespace} does not exist: create it (kubectl create namespace "
                f"{namespace}) or set SLESS_UNTRUSTED_BUILD_NAMESPACE",
            ) from None

    def _wait(self, tag: str, namespace: str, name: str, job: dict[str, Any]) -> dict[str, Any]:
        def check(job: dict[str, Any], waited: float) -> None:
            if waited > 2 and not (job.get("status") or {}).get("succeeded"):
                self._check_start(tag, namespace, name, waited)

        timeout = self.config.build_timeout_sec
        try:
            return runs.wait(self.client, namespace, name, job, timeout + 60, self.poll_sec, check)
        except runs.JobTimedOut:
            raise BuildFailed(tag, f"no result after {timeout} s") from None
        except runs.JobGone:
            raise BuildFailed(tag, f"build Job {name} was deleted while it ran") from None

    def _check_start(self, tag: str, namespace: str, name: str, waited: float) -> None:
        """A pod that cannot start fails the build with the kubelet's reason."""
        pods = runs.pods(self.client, namespace, name)
        reason = stuck_reason(pods)
        if reason:
            self.client.delete("Job", namespace, name, "Background")
            raise BuildFailed(tag, f"build pod cannot start: {reason}")
        pending = any((pod.get("status") or {}).get("phase") == "Pending" for pod in pods)
        if pending and waited > self.start_timeout_sec:
            self.client.delete("Job", namespace, name, "Background")
            raise BuildFailed(tag, f"build pod still Pending after {self.start_timeout_sec:.0f} s")

    def _failed(self, tag: str, namespace: str, name: str, job: dict[str, Any]) -> BuildFailed:
        """The failure of an ended Job: its exit code as the summary, its log kept apart."""
        cond = runs.conditions(job).get("Failed") or {}
        reason = cond.get("reason") or "Failed"
        pods = runs.pods(self.client, namespace, name)
        summary = exit_summary(pods)
        if reason == "DeadlineExceeded":
            summary = f"build timed out after {self.config.build_timeout_sec} s"
        summary = summary or f"build failed ({reason})"
        return BuildFailed(tag, summary, self._log(namespace, pods), summary)

    def _log(self, namespace: str, pods: list[dict[str, Any]]) -> str:
        """The newest pod's kaniko log ("" when there is none)."""
        if not pods:
            return ""
        pod = _newest(pods)["metadata"]["name"]
        try:
            return self.client.pod_log(namespace, pod, LOG_TAIL_LINES)
        except (Invalid, NotFound):  # kaniko never started (its context was not fetched)
            return ""
