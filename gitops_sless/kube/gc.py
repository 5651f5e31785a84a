"""Garbage collection in the cluster: build records, S3 contexts and registry images.

The rules are the local backend's (``local/gc.py``), with the cluster's own
safety on top. Kept, whatever else holds:

- every image a Deployment, Job, CronJob or Pod in any managed namespace
  references (by digest or by tag), and the tags the environments want now;
- every build in progress: a build Job that has not ended (in the reconciler's
  namespace or the untrusted one), or a tag the reconciler is building;
- the newest ``keep`` builds of each function folder (per trust), so a revert
  to a recent version deploys without a build;
- anything built or uploaded within ``min_age`` seconds.

Everything else goes, image first, then context, then record: a record is
the last trace of a build, so one that stays (a failed deletion) is retried
next time. An image without any record (its record was collected before a
registry failure) goes only once its context is gone or older than
``min_age``: a build uploads its context before its Job exists.

The order of the reads matters: the registry is listed first, builds in
progress and records after it, so a build that pushed before the listing
is seen either in progress or recorded.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import logs
from ..errors import SlessError
from ..metrics import METRICS
from ..timestamps import epoch
from . import runs
from .builds import RECORD_LABEL
from .client import KubeClient
from .registry import Image, Registry, credentials_from_docker_config, split_repository
from .renderer import BUILD_LABEL, MANAGED_BY, RenderConfig
from .storage import ContextStore, StoredContext

__all__ = ["ClusterGC", "Collected"]

log = logging.getLogger(__name__)

WORKLOAD_KINDS = ("Deployment", "CronJob", "Job", "Pod")
KINDS_COLLECTED = ("image", "context", "record")


@dataclass
class Collected:
    """What one collection removed: names by kind (image, context, record) and their bytes."""

    removed: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    reclaimed_bytes: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def add(self, what: str, name: str, size: int) -> None:
        self.removed[what].append(name)
        self.reclaimed_bytes[what] += size


@dataclass(frozen=True)
class _Record:
    name: str
    tag: str
    trusted: bool
    digest: str
    group: tuple[str, ...]
    created: float
    size: int
    # the record's resourceVersion: records are never written again, so it orders their
    # creation within the second creationTimestamp leaves them tied
    order: int = 0


@dataclass(frozen=True)
class _Stored:
    trusted: bool
    image: Image


@dataclass
class _Keep:
    """What stays: (tag, trusted) pairs, tags of any trust, and digests in use."""

    builds: set[tuple[str, bool]] = field(default_factory=set)
    tags: set[str] = field(default_factory=set)
    digests: set[str] = field(default_factory=set)
    refs: set[str] = field(default_factory=set)  # images referenced by tag

    def holds(self, tag: str, trusted: bool) -> bool:
        return tag in self.tags or (tag, trusted) in self.builds


class ClusterGC:
    def __init__(
        self,
        client: KubeClient,
        contexts: ContextStore,
        config: RenderConfig,
        *,
        keep: int = 3,
        min_age_sec: float = 3600.0,
        clock: Callable[[], float] = time.time,
        registries: Callable[[bool], Registry] | None = None,
    ) -> None:
        """``registries(trusted)``: the registry a scope pushes to (default: from the push
        Secrets' docker config)."""
        self.client = client
        self.contexts = contexts
        self.config = config
        self.keep = keep
        self.min_age_sec = min_age_sec
        self.clock = clock
        self._registries = registries or self._registry
        self._open: dict[bool, Registry] = {}  # one client per scope, for one collection

    def collect(
        self,
        wanted: Callable[[], set[str]],
        building: Callable[[], set[str]],
        leading: Callable[[], bool] = lambda: True,
    ) -> Collected:
        """Delete what nothing uses. ``wanted()``: the tags environments want now;
        ``building()``: tags being built by this process. Both are asked after the
        registry is read (see the module's docstring)."""
        try:
            return self._collect(wanted, building, leading)
        finally:
            for registry in self._open.values():
                registry.close()
            self._open.clear()

    def _collect(
        self,
        wanted: Callable[[], set[str]],
        building: Callable[[], set[str]],
        leading: Callable[[], bool],
    ) -> Collected:
        out = Collected()
        stored = self._images(out)
        contexts = self.contexts.contexts()
        in_progress = building() | self._build_jobs_running()
        records = self._records()
        keep = self._in_use()
        keep.tags |= wanted() | in_progress
        now = self.clock()
        keep.builds |= self._kept_records(records, now)
        keep.builds |= {(r.tag, r.trusted) for r in records if r.digest in keep.digests}
        gone = [r for r in records if not keep.holds(r.tag, r.trusted)]
        recorded = {(r.tag, r.trusted) for r in records}
        young_contexts = {c.tag for c in contexts if now - c.modified < self.min_age_sec}
        kept_tags = {tag for tag, _ in keep.builds} | keep.tags
        failed: set[str] = set()
        if not leading():  # S3 and the registry know nothing of the lease: ask first
            return out
        for item in self._unwanted_images(stored, keep, recorded, young_contexts):
            if not self._delete_image(item, out):
                failed.add(item.image.tag)
        for context in contexts:
            if context.tag in kept_tags | failed or context.tag in young_contexts:
                continue
            self._delete_context(context, out)
        for record in gone:
            if record.tag not in failed:
                self._delete_record(record, out)
        self._log(out)
        _count(out)
        return out

    # --- reading ---------------------------------------------------------------------

    def _images(self, out: Collected) -> list[_Stored]:
        found = []
        for trusted in (True, False):
            _, path = split_repository(self._repository(trusted))
            registry = self._registry_for(trusted)
            try:
                for tag in registry.tags(path):
                    image = registry.image(path, tag)
                    if image is not None and image.digest:
                        found.append(_Stored(trusted, image))
            except SlessError as exc:
                # the untrusted registry may be out of reach of these credentials
                out.errors.append(str(exc))
                log.warning("gc: %s: images of this registry are not collected", exc)
        return found

    def _repository(self, trusted: bool) -> str:
        return f"{self.config.build_registry(trusted)}/functions"

    def _registry_for(self, trusted: bool) -> Registry:
        if trusted not in self._open:
            self._open[trusted] = self._registries(trusted)
        return self._open[trusted]

    def _registry(self, trusted: bool) -> Registry:
        host, _ = split_repository(self._repository(trusted))
        secret = self.config.push_secret if trusted else self.config.untrusted_push_secret
        namespace = self.config.controller_namespace if trusted else self.config.untrusted_namespace
        return Registry(host, self._credentials(namespace, secret, host))

    def _credentials(self, namespace: str, secret: str | None, host: str) -> Any:
        if not secret:
            return None
        found = self.client.get("Secret", namespace, secret)
        raw = ((found or {}).get("data") or {}).get(".dockerconfigjson")
        if not raw:
            return None
        try:
            return credentials_from_docker_config(json.loads(base64.b64decode(raw)), host)
        except ValueError:
            log.warning("gc: Secret %s/%s holds no docker config", namespace, secret)
            return None

    def _build_jobs_running(self) -> set[str]:
        tags = set()
        for namespace in {self.config.controller_namespace, self.config.untrusted_namespace}:
            for job in self.client.list("Job", namespace, BUILD_LABEL):
                tag = (job["metadata"].get("labels") or {}).get(BUILD_LABEL)
                if tag and not runs.ended(job):
                    tags.add(tag)
        return tags

    def _records(self) -> list[_Record]:
        found = self.client.list(
            "ConfigMap", self.config.controller_namespace, {RECORD_LABEL: "built"}
        )
        return [r for item in found if (r := _record(item))]

    def _in_use(self) -> _Keep:
        keep = _Keep()
        selector = {MANAGED_BY: "gitops-sless"}
        for namespace in self.client.list("Namespace", None, selector):
            name = namespace["metadata"]["name"]
            for kind in WORKLOAD_KINDS:
                for obj in self.client.list(kind, name):
                    for image in _images_of(obj):
                        _, at, digest = image.partition("@")
                        if at:
                            keep.digests.add(digest)
                        else:
                            keep.refs.add(image)
        keep.tags |= {ref.rsplit(":", 1)[1] for ref in keep.refs if self._ours(ref)}
        return keep

    def _ours(self, ref: str) -> bool:
        repo = ref.rsplit(":", 1)[0]
        return ":" in ref.rsplit("/", 1)[-1] and repo in {
            self._repository(True),
            self._repository(False),
        }

    # --- deciding --------------------------------------------------------------------

    def _kept_records(self, records: list[_Record], now: float) -> set[tuple[str, bool]]:
        """The young records, and the newest ``keep`` of each folder."""
        kept = {(r.tag, r.trusted) for r in records if now - r.created < self.min_age_sec}
        groups: dict[tuple[str, ...], list[_Record]] = defaultdict(list)
        for record in records:
            groups[record.group].append(record)
        for group in groups.values():
            newest = sorted(group, key=lambda r: (r.created, r.order, r.tag), reverse=True)
            kept |= {(r.tag, r.trusted) for r in newest[: self.keep]}
        return kept

    def _unwanted_images(
        self,
        stored: list[_Stored],
        keep: _Keep,
        recorded: set[tuple[str, bool]],
        young_contexts: set[str],
    ) -> Iterator[_Stored]:
        """Images to delete: a manifest goes only when every tag naming it may go."""
        by_digest: dict[tuple[str, str], list[_Stored]] = defaultdict(list)
        for item in stored:
            by_digest[(item.image.repository, item.image.digest)].append(item)
        for (_, digest), items in sorted(by_digest.items()):
            if digest in keep.digests:
                continue
            if all(self._may_go(i, keep, recorded, young_contexts) for i in items):
                yield items[0]

    @staticmethod
    def _may_go(
        item: _Stored, keep: _Keep, recorded: set[tuple[str, bool]], young_contexts: set[str]
    ) -> bool:
        tag = item.image.tag
        if keep.holds(tag, item.trusted):
            return False
        # no record: a build may have pushed it just now, unless its context is old or gone
        return (tag, item.trusted) in recorded or tag not in young_contexts

    # --- deleting --------------------------------------------------------------------

    def _delete_image(self, item: _Stored, out: Collected) -> bool:
        image = item.image
        name = f"{self._repository(item.trusted)}@{image.digest}"
        try:
            self._registry_for(item.trusted).delete(image.repository, image.digest)
        except SlessError as exc:
            out.errors.append(str(exc))
            log.warning("gc: cannot delete %s: %s", name, exc)
            return False
        out.add("image", name, image.size)
        return True

    def _delete_context(self, context: StoredContext, out: Collected) -> None:
        try:
            self.contexts.delete(context.key)
        except SlessError as exc:
            out.errors.append(str(exc))
            log.warning("gc: cannot delete %s: %s", context.key, exc)
            return
        out.add("context", context.key, context.size)

    def _delete_record(self, record: _Record, out: Collected) -> None:
        namespace = self.config.controller_namespace
        try:
            self.client.delete("ConfigMap", namespace, record.name)
        except SlessError as exc:
            out.errors.append(str(exc))
            log.warning("gc: cannot delete record %s: %s", record.name, exc)
            return
        out.add("record", record.name, record.size)

    def _log(self, out: Collected) -> None:
        if not any(out.removed.values()):
            return
        counts = ", ".join(f"{len(out.removed[w])} {w}s" for w in KINDS_COLLECTED)
        total = sum(out.reclaimed_bytes.values())
        logs.event(log, "gc.finished", f"removed {counts}, {total} bytes reclaimed")


def _count(out: Collected) -> None:
    METRICS.gc_runs.inc()
    for what in KINDS_COLLECTED:
        METRICS.gc_objects.inc(len(out.removed[what]), what=what)
        METRICS.gc_reclaimed.inc(out.reclaimed_bytes[what], what=what)


def _record(item: dict[str, Any]) -> _Record | None:
    data = item.get("data") or {}
    tag = data.get("tag")
    if not tag:
        return None
    trusted = data.get("trust") != "untrusted"
    meta = item["metadata"]
    # records without a folder are each their own group: the keep window holds them
    folder = data.get("folder") or f"?{tag}"
    return _Record(
        name=meta["name"],
        tag=tag,
        trusted=trusted,
        digest=data.get("digest") or "",
        group=(str(trusted), str(data.get("runtime")), folder),
        # no creation time: counted as new, never collected by mistake
        created=epoch(meta.get("creationTimestamp")) or float("inf"),
        size=len(json.dumps(data)),
        order=int(version) if (version := str(meta.get("resourceVersion") or "")).isdigit() else 0,
    )


def _images_of(obj: dict[str, Any]) -> Iterable[str]:
    spec = obj.get("spec") or {}
    if obj.get("kind") == "CronJob":
        spec = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}
        spec = spec.get("spec") or {}
    elif obj.get("kind") != "Pod":
        spec = (spec.get("template") or {}).get("spec") or {}
    for key in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(key) or []:
            if container.get("image"):
                yield str(container["image"])
