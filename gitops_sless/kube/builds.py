"""Images built in the cluster: a build context in S3, a kaniko Job per tag, a record per image.

A tag is built at most once, whoever asks and however often the reconciler
restarts: the context is uploaded only if absent, the Job is named from the
tag (an existing one is adopted and waited for, never duplicated), and the
finished image is recorded in a ConfigMap in the reconciler's namespace, so
a reconciler with an empty state folder knows what is built without asking
a registry.

A build is followed by watch, not polled: one informer on the build Jobs and
one on their pods in each build namespace (the reconciler's, the untrusted
one), started at its first build. A build costs the API server its Job's
create, its log's GET and its record's create; the Job's completion, the pod's
termination message (the digest) and a pod that cannot start (the kubelet's
reason) are all read from the caches.

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

from ..manifests.model import Function
from ..plan.backend import BuildFailed
from ..source.snapshot import Snapshot
from ..timestamps import epoch
from . import runs
from .client import AlreadyExists, Invalid, KubeClient, NotFound
from .contexts import build_context
from .informer import Informer
from .renderer import (
    BUILD_LABEL,
    MANAGED_BY,
    TRUST_LABEL,
    RenderConfig,
    build_job,
    build_job_name,
    image_ref,
    pinned_image,
)
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
POD_SETTLE_SEC = 5.0  # how long an ended Job's pod may lag behind it in the pods' cache


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
        self._informer_options = informer_options
        self._records = Informer(
            client, "ConfigMap", self.namespace, {RECORD_LABEL: "built"}, **informer_options
        )
        self._followed: dict[str, _BuildWatch] = {}  # namespace -> its build Jobs and pods

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
        with self._lock:
            followed, self._followed = list(self._followed.values()), {}
        for watch in followed:
            watch.stop()

    def cached(self) -> int:
        """Objects held in memory: the records, the build Jobs and their pods."""
        with self._lock:
            followed = list(self._followed.values())
        return len(self._records) + sum(len(w.jobs) + len(w.pods) for w in followed)

    def _follow(self, namespace: str, trusted: bool) -> _BuildWatch:
        """The build Jobs and pods of ``namespace``, watched from its first build on."""
        with self._lock:
            watch = self._followed.get(namespace)
            if watch is None:
                watch = _BuildWatch(self.client, namespace, trusted, self._informer_options)
                self._followed[namespace] = watch
        watch.sync()
        return watch

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
        watch = self._start_watch(tag, namespace, trusted)
        job = watch.jobs.get(name)
        if job is not None and "Failed" in runs.conditions(job):
            if time.time() - _finished_at(job) < self.retry_sec:
                raise self._failed(tag, watch, name, job, watch.pods_of(name))
            self._delete(watch, name)  # a retry, later
            job = None
        if job is None:
            watch.jobs.put(self._start(fn, snapshot, namespace, trusted))
        job = self._wait(tag, watch, name)
        if "Complete" not in runs.conditions(job):
            raise self._failed(tag, watch, name, job, watch.ended_pods(name))
        pods = watch.ended_pods(name)
        build_log = self._log(namespace, pods)
        digest = pushed_digest(pods, build_log)
        if digest is None:
            raise BuildFailed(
                tag, "kaniko reported no image digest", build_log, "build failed (no digest)"
            )
        self._record(fn, digest, trusted, time.monotonic() - started)
        # the build's status (the API's build log) names what runs: the image by its digest
        return f"{build_log.rstrip()}\nrecorded {pinned_image(self.config, digest, trusted)}\n"

    def _start_watch(self, tag: str, namespace: str, trusted: bool) -> _BuildWatch:
        try:
            return self._follow(namespace, trusted)
        except NotFound:
            raise BuildFailed(tag, _no_namespace(namespace)) from None

    def _delete(self, watch: _BuildWatch, name: str) -> None:
        self.client.delete("Job", watch.namespace, name, "Background")
        watch.jobs.drop(name)

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
            raise BuildFailed(tag, _no_namespace(namespace)) from None

    def _wait(self, tag: str, watch: _BuildWatch, name: str) -> dict[str, Any]:
        def check(job: dict[str, Any], waited: float) -> None:
            if waited > 2 and not (job.get("status") or {}).get("succeeded"):
                self._check_start(tag, watch, name, waited)

        timeout = self.config.build_timeout_sec
        try:
            return runs.wait(watch.jobs, name, timeout + 60, self.poll_sec, check)
        except runs.JobTimedOut:
            raise BuildFailed(tag, f"no result after {timeout} s") from None
        except runs.JobGone:
            raise BuildFailed(tag, f"build Job {name} was deleted while it ran") from None

    def _check_start(self, tag: str, watch: _BuildWatch, name: str, waited: float) -> None:
        """A pod that cannot start fails the build with the kubelet's reason."""
        pods = watch.pods_of(name)
        reason = stuck_reason(pods)
        if reason:
            self._delete(watch, name)
            raise BuildFailed(tag, f"build pod cannot start: {reason}")
        pending = any((pod.get("status") or {}).get("phase") == "Pending" for pod in pods)
        if pending and waited > self.start_timeout_sec:
            self._delete(watch, name)
            raise BuildFailed(tag, f"build pod still Pending after {self.start_timeout_sec:.0f} s")

    def _failed(
        self,
        tag: str,
        watch: _BuildWatch,
        name: str,
        job: dict[str, Any],
        pods: list[dict[str, Any]],
    ) -> BuildFailed:
        """The failure of an ended Job: its exit code as the summary, its log kept apart."""
        cond = runs.conditions(job).get("Failed") or {}
        reason = cond.get("reason") or "Failed"
        summary = exit_summary(pods)
        if reason == "DeadlineExceeded":
            summary = f"build timed out after {self.config.build_timeout_sec} s"
        summary = summary or f"build failed ({reason})"
        return BuildFailed(tag, summary, self._log(watch.namespace, pods), summary)

    def _log(self, namespace: str, pods: list[dict[str, Any]]) -> str:
        """The newest pod's kaniko log ("" when there is none)."""
        if not pods:
            return ""
        pod = _newest(pods)["metadata"]["name"]
        try:
            return self.client.pod_log(namespace, pod, LOG_TAIL_LINES)
        except (Invalid, NotFound):  # kaniko never started (its context was not fetched)
            return ""


def _no_namespace(namespace: str) -> str:
    return (
        f"namespace {namespace} does not exist: create it (kubectl create namespace "
        f"{namespace}) or set SLESS_UNTRUSTED_BUILD_NAMESPACE"
    )


class _BuildWatch:
    """The build Jobs of one namespace and their pods, each kept by an informer; the pods
    indexed by their Job. Both keep only metadata and status (a pod spec is most of it)."""

    def __init__(
        self, client: KubeClient, namespace: str, trusted: bool, options: dict[str, Any]
    ) -> None:
        self.client = client
        self.namespace = namespace
        selector = {
            MANAGED_BY: "gitops-sless",
            TRUST_LABEL: "trusted" if trusted else "untrusted",
        }
        self._by_job: dict[str, dict[str, dict[str, Any]]] = {}  # job -> pod name -> pod
        self._lock = threading.RLock()
        self.jobs = Informer(client, "Job", namespace, selector, transform=_status_only, **options)
        self.pods = Informer(
            client,
            "Pod",
            namespace,
            selector,
            transform=_status_only,
            on_change=self._indexed,
            lock=self._lock,
            **options,
        )

    def sync(self) -> None:
        self.jobs.sync()
        self.pods.sync()

    def stop(self) -> None:
        self.jobs.stop()
        self.pods.stop()

    def _indexed(self, new: dict[str, Any] | None, old: dict[str, Any] | None) -> None:
        for obj, add in ((old, False), (new, True)):
            job = ((obj or {}).get("metadata") or {}).get("labels", {}).get("job-name")
            if not obj or not job:
                continue
            pods = self._by_job.setdefault(job, {})
            if add:
                pods[obj["metadata"]["name"]] = obj
            else:
                pods.pop(obj["metadata"]["name"], None)
                if not pods:
                    del self._by_job[job]

    def pods_of(self, job: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._by_job.get(job, {}).values())

    def ended_pods(self, job: str) -> list[dict[str, Any]]:
        """The pods of an ended Job once their end is in the cache (a pod's events may come
        after its Job's on the other watch); a LIST if they lag more than ``POD_SETTLE_SEC``."""
        deadline = time.monotonic() + POD_SETTLE_SEC
        while True:
            seen = self.pods.version()
            pods = self.pods_of(job)
            if any(_settled(pod) for pod in pods):
                return pods
            left = deadline - time.monotonic()
            if left <= 0:
                return runs.pods(self.client, self.namespace, job)
            self.pods.wait_change(seen, left)


def _settled(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _status_only(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    kept = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp", "labels")
    return {
        "kind": obj.get("kind"),
        "metadata": {key: meta[key] for key in kept if key in meta},
        "status": obj.get("status") or {},
    }
