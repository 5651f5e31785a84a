"""Garbage collection in the cluster, against a real registry and a real S3 server.

Builds run through the test API server's kaniko, which pushes real images to
Debian's ``docker-registry`` (deletion enabled) through the OCI distribution
API; contexts live in a bucket of the real SeaweedFS server made for the test.
Time is moved forward by the collector's clock, never waited for.
"""

from __future__ import annotations

import base64
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from gitops_sless.kube.builds import RECORD_LABEL, _record_name
from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.gc import ClusterGC, Collected
from gitops_sless.kube.registry import Registry, credentials_from_docker_config
from gitops_sless.kube.renderer import BUILD_LABEL, MANAGED_BY, pinned_image
from gitops_sless.metrics import METRICS

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, Harness, make, settings
from ..kubeapi import FakeKube
from ..oci_registry import OciRegistry
from ..s3server import S3Server
from .test_kube_backend import wait_for

HOUR = 3600.0
REPOSITORY = "sless/functions"
HANDLER = "def handler(event, context):\n    return {'from': %r}\n"


def folder(name: str, text: str) -> dict[str, str]:
    manifest = (
        "functions:\n"
        f"  - name: {name}\n"
        "    runtime: python3.11\n"
        "    entrypoint: main.handler\n"
        "    triggers:\n"
        "      - type: http\n"
    )
    return {f"{name}/sless.yaml": manifest, f"{name}/main.py": HANDLER % text}


@pytest.fixture
def cluster(
    fake_kube: FakeKube, s3_server: S3Server, oci_registry: OciRegistry, tmp_path: Path
) -> Any:
    """A harness whose builds push to the real registry and upload to a bucket of its own."""
    admin = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    admin.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    fake_kube.kubelet.oci_registries[oci_registry.host] = oci_registry.url
    bucket = f"gc-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    kube_settings = settings(
        fake_kube.kubeconfig,
        s3_server.config(bucket=bucket),
        registry=f"{oci_registry.host}/sless",
    )
    repo = WorkRepo(tmp_path / "repo")
    made: list[Harness] = []

    def start() -> Harness:
        # alpha's previous version stays runnable (a kept revision), the one before goes
        made.append(make(repo, tmp_path / "state", kube_settings, keep_revisions=2))
        return made[-1]

    yield repo, start, admin
    for harness in made:
        harness.close()


def deploy(harness: Harness, repo: WorkRepo, files: dict[str, str], name: str) -> str:
    """Commit ``files``, sync until ``name`` runs them; its build tag."""
    repo.write(files)
    repo.commit(f"{name} changes")
    head = repo.head()

    def ready() -> bool:
        harness.sync()
        record = harness.function(name)
        return record["phase"] == "Ready" and record["revision"] == head

    wait_for(ready, f"{name} Ready at {head[:8]}", timeout=30)
    return str(harness.function(name)["build_tag"])


def three_versions(cluster: Any) -> tuple[Harness, dict[str, str], KubeClient]:
    """alpha built three times (v3 runs), beta once: their tags by version."""
    repo, start, admin = cluster
    repo.write(folder("beta", "b1"))
    harness = start()
    tags = {"beta": deploy(harness, repo, folder("alpha", "v1"), "alpha")}
    tags["v1"] = str(harness.function("alpha")["build_tag"])
    tags["v2"] = deploy(harness, repo, folder("alpha", "v2"), "alpha")
    tags["v3"] = deploy(harness, repo, folder("alpha", "v3"), "alpha")
    tags["beta"] = str(harness.function("beta")["build_tag"])
    assert len(set(tags.values())) == 4
    return harness, tags, admin


def collector(harness: Harness, keep: int, later_sec: float = 0.0) -> ClusterGC:
    backend = harness.backend
    return ClusterGC(
        backend.client,
        backend.builds.contexts,
        backend.config,
        keep=keep,
        min_age_sec=HOUR,
        clock=lambda: time.time() + later_sec,
    )


def collect(gc: ClusterGC, building: frozenset[str] = frozenset()) -> Collected:
    return gc.collect(wanted=set, building=lambda: set(building))


def registry_of(harness: Harness) -> Registry:
    return Registry(harness.backend.config.registry.partition("/")[0])


def digest_of(harness: Harness, tag: str) -> str:
    return str(harness.backend.builds._digests[(tag, True)])


def present(harness: Harness, tag: str, digest: str) -> dict[str, bool]:
    """Where ``tag`` still is: the registry (by tag and digest), the bucket, its record."""
    contexts = harness.backend.builds.contexts
    records = harness.backend.client.list("ConfigMap", NAMESPACE, {RECORD_LABEL: "built"})
    names = {r["metadata"]["name"] for r in records}
    registry = registry_of(harness)
    try:
        return {
            "tag": registry.digest(REPOSITORY, tag) is not None,
            "manifest": registry.digest(REPOSITORY, digest) is not None,
            "context": contexts.exists(contexts.key(tag)),
            "record": _record_name(tag, True) in names,
        }
    finally:
        registry.close()


EVERYWHERE = {"tag": True, "manifest": True, "context": True, "record": True}
NOWHERE = {"tag": False, "manifest": False, "context": False, "record": False}


def metric(counter: Any, what: str) -> float:
    return float(counter.values.get((("what", what),), 0.0))


# --- what goes, what stays ----------------------------------------------------------------


def test_unused_builds_go_and_those_any_managed_namespace_references_stay(cluster):
    harness, tags, admin = three_versions(cluster)
    digests = {version: digest_of(harness, tag) for version, tag in tags.items()}
    # another environment (a preview's namespace) still runs v2 from a CronJob
    admin.create(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "sless-pr-7", "labels": {MANAGED_BY: "gitops-sless"}},
        }
    )
    image = pinned_image(harness.backend.config, digests["v2"])
    admin.create(cronjob("sless-pr-7", "alpha-cron-0", image))
    contexts = harness.backend.builds.contexts
    v1_context = next(c for c in contexts.contexts() if c.tag == tags["v1"])
    before = {w: metric(METRICS.gc_objects, w) for w in ("image", "context", "record")}
    bytes_before = {w: metric(METRICS.gc_reclaimed, w) for w in ("image", "context", "record")}

    out = collect(collector(harness, keep=0, later_sec=2 * HOUR))

    assert present(harness, tags["v1"], digests["v1"]) == NOWHERE
    for version in ("v2", "v3", "beta"):
        assert present(harness, tags[version], digests[version]) == EVERYWHERE, version
    assert out.removed["context"] == [v1_context.key]
    assert out.reclaimed_bytes["context"] == v1_context.size
    assert out.reclaimed_bytes["image"] > 0 and out.reclaimed_bytes["record"] > 0
    assert out.errors == []
    for what in ("image", "context", "record"):
        assert metric(METRICS.gc_objects, what) - before[what] == 1
        reclaimed = metric(METRICS.gc_reclaimed, what) - bytes_before[what]
        assert reclaimed == out.reclaimed_bytes[what]
    # prod still serves what it ran, and the next pass builds nothing again
    harness.sync()
    assert harness.function("alpha")["phase"] == "Ready"
    assert harness.function("alpha")["build_tag"] == tags["v3"]


def test_a_kept_revision_keeps_its_build_and_one_past_the_kept_ones_goes(cluster):
    harness, tags, _ = three_versions(cluster)  # alpha keeps 2 revisions: v3 serves, v2 kept
    digests = {version: digest_of(harness, tag) for version, tag in tags.items()}
    kept = [
        d["metadata"]["name"]
        for d in harness.backend.client.list(
            "Deployment", "sless-prod", {MANAGED_BY: "gitops-sless"}
        )
        if d["metadata"]["name"].startswith("alpha-rev-")
    ]
    assert len(kept) == 1  # v2's, at zero; v1's objects went when it was no longer kept

    collect(collector(harness, keep=0, later_sec=2 * HOUR))

    assert present(harness, tags["v2"], digests["v2"]) == EVERYWHERE
    assert present(harness, tags["v1"], digests["v1"]) == NOWHERE


def test_nothing_younger_than_the_minimum_age_goes(cluster):
    harness, tags, _ = three_versions(cluster)
    digest = digest_of(harness, tags["v1"])

    out = collect(collector(harness, keep=0))  # everything was built seconds ago

    assert not any(out.removed.values())
    assert present(harness, tags["v1"], digest) == EVERYWHERE
    out = collect(collector(harness, keep=0, later_sec=HOUR - 60))
    assert not any(out.removed.values())
    collect(collector(harness, keep=0, later_sec=HOUR + 60))
    assert present(harness, tags["v1"], digest) == NOWHERE


def test_the_newest_builds_of_each_folder_are_kept(cluster):
    harness, tags, _ = three_versions(cluster)
    digests = {version: digest_of(harness, tag) for version, tag in tags.items()}

    collect(collector(harness, keep=2, later_sec=2 * HOUR))

    assert present(harness, tags["v1"], digests["v1"]) == NOWHERE
    assert present(harness, tags["v2"], digests["v2"]) == EVERYWHERE  # kept for a revert
    assert present(harness, tags["v3"], digests["v3"]) == EVERYWHERE


def test_a_build_in_progress_is_never_collected(cluster):
    harness, tags, admin = three_versions(cluster)
    digests = {version: digest_of(harness, tag) for version, tag in tags.items()}
    # v1 is being built again (a Job that has not ended): its pod can never pull its image
    admin.create(build_job(tags["v1"], "registry.test/unpullable:1"))
    # and the reconciler is building v2 right now
    gc = collector(harness, keep=0, later_sec=2 * HOUR)

    out = collect(gc, building=frozenset({tags["v2"]}))

    assert present(harness, tags["v1"], digests["v1"]) == EVERYWHERE
    assert present(harness, tags["v2"], digests["v2"]) == EVERYWHERE
    assert not any(out.removed.values())


def test_a_replica_that_does_not_lead_deletes_nothing(cluster):
    harness, tags, _ = three_versions(cluster)
    digest = digest_of(harness, tags["v1"])
    gc = collector(harness, keep=0, later_sec=2 * HOUR)

    out = gc.collect(wanted=set, building=set, leading=lambda: False)

    assert not any(out.removed.values())
    assert present(harness, tags["v1"], digest) == EVERYWHERE


# --- objects the tests write by hand ------------------------------------------------------


def cronjob(namespace: str, name: str, image: str) -> dict[str, Any]:
    container = {"name": "fn", "image": image}
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "schedule": "0 2 * * *",
            "jobTemplate": {
                "spec": {
                    "template": {"spec": {"restartPolicy": "Never", "containers": [container]}}
                }
            },
        },
    }


def build_job(tag: str, image: str) -> dict[str, Any]:
    labels = {MANAGED_BY: "gitops-sless", BUILD_LABEL: tag}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": f"rebuild-{uuid.uuid4().hex[:8]}",
            "namespace": NAMESPACE,
            "labels": labels,
        },
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "k", "image": image}]},
            },
        },
    }


# --- the registry client's credentials -------------------------------------------------------


def test_the_registry_client_answers_a_token_challenge_with_the_push_secret_credentials():
    auth = base64.b64encode(b"robot:s3cret").decode()
    credentials = credentials_from_docker_config(
        {"auths": {"registry.example": {"auth": auth}}}, "registry.example"
    )
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path} {request.url.params.get('scope', '')}")
        if request.url.host == "auth.example":
            assert request.headers["Authorization"] == f"Basic {auth}"
            return httpx.Response(200, json={"token": "t0ken"})
        if request.headers.get("Authorization") != "Bearer t0ken":
            challenge = 'Bearer realm="https://auth.example/token",service="registry.example"'
            return httpx.Response(401, headers={"WWW-Authenticate": challenge})
        return httpx.Response(202)

    registry = Registry("registry.example", credentials, transport=httpx.MockTransport(answer))
    assert registry.base_url == "https://registry.example"
    assert registry.delete(REPOSITORY, "sha256:" + "0" * 64)
    registry.close()
    assert seen[1] == f"GET /token repository:{REPOSITORY}:delete,pull"
    loopback = Registry("127.0.0.1:5000")
    assert loopback.base_url == "http://127.0.0.1:5000"  # as kaniko's library: plain HTTP
    loopback.close()
