"""Kubernetes builds hold no storage key, untrusted builds run apart, and what runs is pinned.

Against the test API server (strict 1.30 schemas) and the real S3 server: the fake kubelet
runs a build pod's init container itself, as a plain GET of the URL it names (no
credentials: only a presigned URL works), refuses a build pod that holds a storage
credential (``kube.build_violations``), and keeps a registry in which a tag names the
digest of its latest push.
"""

from __future__ import annotations

import base64
import gzip
import io
import json
import re
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.connect import connect
from gitops_sless.kube.renderer import build_job, build_job_name
from gitops_sless.kube.settings import StartupError
from gitops_sless.reconciler import Reconciler
from gitops_sless.state.routes import RouteTable
from gitops_sless.state.store import Store
from gitops_sless.web.models import Build

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, REGISTRY, Harness, RepoSource, make, settings
from ..kubeapi import FakeKube
from ..s3server import S3Server
from .test_kube_backend import function_folder, images, wait_for

PROD = "sless-prod"
UNTRUSTED = "gitops-sless-untrusted"
FORKS = "registry.test/forks"
PINNED = re.compile(r"(?P<repo>.+)/functions@sha256:[0-9a-f]{64}")


def _client(kube: FakeKube) -> KubeClient:
    return KubeClient.from_config(str(kube.kubeconfig), calls=None)


def _push_secret(kube: FakeKube, namespace: str, name: str) -> None:
    config = {"auths": {name: {"auth": base64.b64encode(b"u:p").decode()}}}
    _client(kube).create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "type": "kubernetes.io/dockerconfigjson",
            "data": {".dockerconfigjson": base64.b64encode(json.dumps(config).encode()).decode()},
        }
    )


@pytest.fixture
def kube(fake_kube: FakeKube, s3_server: S3Server) -> FakeKube:
    client = _client(fake_kube)
    for namespace in (NAMESPACE, UNTRUSTED):
        client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    _push_secret(fake_kube, NAMESPACE, "prod-push")
    _push_secret(fake_kube, UNTRUSTED, "forks-push")
    fake_kube.keep_out_of_builds(s3_server.secret_key)
    return fake_kube


@pytest.fixture
def kube_settings(kube: FakeKube, s3_server: S3Server) -> Any:
    return settings(
        kube.kubeconfig,
        s3_server.config(),
        push_secret="prod-push",
        untrusted_push_secret="forks-push",
        untrusted_registry=FORKS,
        build_runtime_class="gvisor",
    )


@pytest.fixture
def prod(kube: FakeKube, kube_settings: Any, tmp_path: Path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", function_folder("alpha"))
    made: list[Harness] = []

    def start(state: str = "prod-state") -> Harness:
        harness = make(repo, tmp_path / state, kube_settings)
        made.append(harness)
        return harness

    yield start
    for harness in made:
        harness.close()


def _preview(harness: Harness, tmp_path: Path) -> Reconciler:
    """A fork's preview of the same repository, on the same backend, as serve makes it."""
    store = Store(tmp_path / "preview.db")
    return Reconciler(
        RepoSource(harness.repo.path),
        harness.backend.for_untrusted(),
        store,
        env="pr-7",
        routes=harness.routes,
        workers=4,
    )


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


def _serving(harness: Harness, name: str = "alpha", env: str | None = None) -> None:
    wait_for(
        lambda: harness.sync() and harness.function(name, env)["phase"] == "Ready",
        f"{name} Ready",
    )


# --- no keys in build pods -------------------------------------------------------------


def test_a_build_pod_holds_no_storage_key_and_reads_its_context_by_a_presigned_url(
    kube, prod, s3_server
):
    harness = prod()
    _serving(harness)
    tag = harness.function("alpha")["build_tag"]
    job = kube.get("Job", NAMESPACE, build_job_name(tag))
    pod = _pod(job)
    containers = pod["initContainers"] + pod["containers"]
    names = [env["name"] for c in containers for env in c.get("env") or []]
    assert not [n for n in names if n.startswith("AWS_") or "SECRET" in n or "KEY" in n]
    assert s3_server.secret_key not in json.dumps(job)
    # the one Secret in the pod is the push credential, where kaniko reads it
    secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
    assert secrets == ["prod-push"]
    assert kube.build_violations == []
    # the build's log (the API's build status) ends with the image by its digest
    pinned = images(kube.get("Deployment", PROD, "alpha"))[0]
    assert harness.store.build(tag)["log"].rstrip().endswith(f"recorded {pinned}")
    assert Build.from_row(harness.store.build(tag)).image == pinned  # the API's build status
    # kaniko reads what the init container fetched, as a local tar
    assert "--context=tar:///workspace/context.tar.gz" in pod["containers"][0]["args"]
    url = next(w for w in pod["initContainers"][0]["command"] if w.startswith("http"))
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert query["X-Amz-Expires"] == ["900"] and "X-Amz-Signature" in query
    # the URL alone reads the context from the real S3 server; without its signature, nothing
    with urllib.request.urlopen(url, timeout=10) as answer:
        data = answer.read()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tar:
        members = {m.name.removeprefix("./") for m in tar.getmembers()}
    assert "Dockerfile" in members and "function/main.py" in members
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url.split("?", 1)[0], timeout=10)
    refused.value.close()
    assert refused.value.code == 403


def test_a_build_pod_with_a_storage_key_is_refused_by_the_test_kubelet(kube, prod, s3_server):
    """The check the other tests rely on can fail: a build pod given the key, as before."""
    harness = prod()
    fn = harness.reconciler.load.run(harness.reconciler.source.snapshot()).functions["alpha"]
    job = build_job(fn, harness.backend.config, "http://127.0.0.1:9/unused")
    job["metadata"]["name"] = "old-style"
    secret = {"name": "AWS_SECRET_ACCESS_KEY", "value": s3_server.secret_key}
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [secret]
    _client(kube).create(job)
    wait_for(
        lambda: ((kube.get("Job", NAMESPACE, "old-style") or {}).get("status") or {}).get("failed"),
        "the old-style build to fail",
    )
    assert any("AWS_SECRET_ACCESS_KEY" in v for v in kube.build_violations)
    assert any("holds" in v for v in kube.build_violations)  # the key itself, found in the pod


# --- untrusted builds apart --------------------------------------------------------------


def test_untrusted_builds_run_apart_and_prod_never_runs_what_they_built(kube, prod, tmp_path):
    harness = prod()
    preview = _preview(harness, tmp_path)
    try:
        preview.sync("test")
        tag = (
            harness.reconciler.load.run(harness.reconciler.source.snapshot())
            .functions["alpha"]
            .build_tag
        )
        wait_for(lambda: kube.get("Job", UNTRUSTED, build_job_name(tag)), "the untrusted build")
        wait_for(
            lambda: preview.sync("test") and kube.get("Deployment", "sless-pr-7", "alpha"),
            "the preview's Deployment",
        )
        job = kube.get("Job", UNTRUSTED, build_job_name(tag))
        pod = _pod(job)
        # its own namespace, credential, repository and cache, under the sandboxing runtime
        assert kube.get("Job", NAMESPACE, build_job_name(tag)) is None
        assert pod["runtimeClassName"] == "gvisor"
        assert [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v] == [
            "forks-push"
        ]
        args = pod["containers"][0]["args"]
        assert f"--destination={FORKS}/functions:{tag}" in args
        assert f"--cache-repo={FORKS}/cache" in args
        preview_image = images(kube.get("Deployment", "sless-pr-7", "alpha"))[0]
        assert PINNED.fullmatch(preview_image).group("repo") == FORKS
        # prod wants the same tag: it builds it again, trusted, and runs only that
        _serving(harness)
        assert kube.get("Job", NAMESPACE, build_job_name(tag)) is not None
        prod_image = images(kube.get("Deployment", PROD, "alpha"))[0]
        assert PINNED.fullmatch(prod_image).group("repo") == REGISTRY
        assert kube.build_violations == []
    finally:
        preview.stop()
        preview.store.close()


def test_an_untrusted_preview_runs_the_trusted_image_of_a_tag_prod_built(kube, prod, tmp_path):
    harness = prod()
    _serving(harness)
    preview = _preview(harness, tmp_path)
    try:
        wait_for(
            lambda: preview.sync("test") and kube.get("Deployment", "sless-pr-7", "alpha"),
            "the preview's Deployment",
        )
        assert kube.objects("Job", UNTRUSTED) == []  # nothing to build
        preview_image = images(kube.get("Deployment", "sless-pr-7", "alpha"))[0]
        assert preview_image == images(kube.get("Deployment", PROD, "alpha"))[0]
    finally:
        preview.stop()
        preview.store.close()


def test_a_forks_failed_build_of_a_tag_never_holds_back_prods_build_of_it(kube, prod, tmp_path):
    """A fork's PR carries the very tree prod is about to build; its build, in the untrusted
    namespace, fails (the forks' repository refuses the push). Prod, sharing the store as
    in ``serve``, still builds that tag with its own credentials, at once, and serves it."""
    harness = prod()
    kube.fail_build(FORKS, "error pushing image: UNAUTHORIZED: the forks' repository refused\n")
    fork = Reconciler(
        RepoSource(harness.repo.path),
        harness.backend.for_untrusted(),
        harness.store,  # one store for every environment, as serve has it
        env="pr-7",
        routes=harness.routes,
        workers=4,
    )
    tag = fork.load.run(fork.source.snapshot()).functions["alpha"].build_tag
    try:
        wait_for(
            lambda: fork.sync("test") and fork.store.function("pr-7", "alpha")["phase"] == "Failed",
            "the fork's build to fail",
        )
        failed = kube.get("Job", UNTRUSTED, build_job_name(tag))
        assert "Failed" in {c["type"] for c in failed["status"]["conditions"]}
        assert kube.get("Job", NAMESPACE, build_job_name(tag)) is None  # prod has not built
        # prod wants the same tag within build_retry_sec of that failure: it builds it
        _serving(harness)
        assert kube.get("Job", NAMESPACE, build_job_name(tag)) is not None
        prod_image = images(kube.get("Deployment", PROD, "alpha"))[0]
        assert PINNED.fullmatch(prod_image).group("repo") == REGISTRY
        assert harness.store.build(tag, "")["phase"] == "Succeeded"
        assert harness.store.build(tag, "untrusted")["phase"] == "Failed"
        # the fork may run what prod built (never the reverse): its preview gets prod's image
        wait_for(
            lambda: fork.sync("test") and kube.get("Deployment", "sless-pr-7", "alpha"),
            "the preview's Deployment",
        )
        assert images(kube.get("Deployment", "sless-pr-7", "alpha")) == [prod_image]
    finally:
        fork.stop()


def test_untrusted_builds_in_the_reconcilers_namespace_are_refused_at_start(kube, s3_server):
    same = settings(kube.kubeconfig, s3_server.config(), untrusted_namespace=NAMESPACE)
    with pytest.raises(StartupError, match="SLESS_UNTRUSTED_BUILD_NAMESPACE=gitops-sless is"):
        connect(same, RouteTable())
    shared = settings(kube.kubeconfig, s3_server.config(), untrusted_registry=REGISTRY)
    with pytest.raises(StartupError, match="untrusted builds must push elsewhere"):
        connect(shared, RouteTable())


# --- pinned by digest --------------------------------------------------------------------


def test_a_tag_pushed_again_with_other_content_changes_no_pod(kube, prod):
    first = prod()
    _serving(first)
    tag = first.function("alpha")["build_tag"]
    pinned = images(kube.get("Deployment", PROD, "alpha"))[0]
    assert PINNED.fullmatch(pinned)
    # someone with a push credential pushes other content under prod's tag
    evil = kube.push_image(f"{REGISTRY}/functions:{tag}", b"other content")
    assert not pinned.endswith(evil)
    first.close()
    # a reconciler that starts over (empty state folder) changes nothing that runs
    second = prod("second-state")
    kube.reset_counts()
    _serving(second)
    assert kube.counts()["writes"].get(("apply", "Deployment"), 0) == 0
    assert images(kube.get("Deployment", PROD, "alpha")) == [pinned]
    pods = kube.objects("Pod", PROD)
    assert pods and all(
        s["imageID"] == pinned for p in pods for s in p["status"]["containerStatuses"]
    )
