"""``Function`` resources: the cluster's view of the repository, written by the leader.

The CRD is ``deploy/crd-functions.yaml``, installed into the test API server,
which serves the resources under their group and validates them against the
CRD's schema, with the status subresource.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gitops_sless.kube.client import KubeClient

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, make, settings
from ..paths import ROOT

CRD = ROOT / "deploy" / "crd-functions.yaml"
PROD = "sless-prod"
HANDLER = "def handler(event, context):\n    return {'from': %r}\n"


def function_folder(name: str, text: str = "v1") -> dict[str, str]:
    manifest = (
        f"functions:\n  - name: {name}\n    runtime: python3.11\n    entrypoint: main.handler\n"
        "    env:\n      DSN: {secret: shared-db, key: dsn}\n      MODE: fast\n"
        "    triggers:\n      - type: http\n"
    )
    return {f"{name}/sless.yaml": manifest, f"{name}/main.py": HANDLER % text}


def install_crd(kubeconfig: Path) -> KubeClient:
    client = KubeClient.from_config(str(kubeconfig), calls=None)
    client.request(
        "create",
        "CustomResourceDefinition",
        "POST",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        body=yaml.safe_load(CRD.read_text()),
    )
    return client


@pytest.fixture
def kube(fake_kube):
    client = install_crd(fake_kube.kubeconfig)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    client.create(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": PROD, "labels": {"app.kubernetes.io/managed-by": "gitops-sless"}},
        }
    )
    client.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "shared-db", "namespace": PROD},
            "stringData": {"dsn": "postgres://very-secret@db"},
        }
    )
    return fake_kube


@pytest.fixture
def harness(kube, s3_server, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**function_folder("alpha"), **function_folder("beta")})
    made = make(repo, tmp_path / "state", settings(kube.kubeconfig, s3_server.config()))
    yield made
    made.close()


def settle(harness: Any, kube: Any, timeout: float = 20) -> None:
    """Sync until a pass writes nothing (the rollouts are done, the status is in)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kube.reset_counts()
        harness.reconciler.sync("test")
        if not any(kube.counts()["writes"].values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"never settled: {kube.counts()['writes']}")


def function(kube: Any, name: str) -> dict[str, Any]:
    obj = kube.get("Function", PROD, name)
    assert obj is not None, f"no Function {name}"
    return obj


def test_function_resources_mirror_the_repository_and_the_cluster(kube, harness):
    settle(harness, kube)
    alpha = function(kube, "alpha")
    spec, status = alpha["spec"], alpha["status"]
    assert spec["runtime"] == "python3.11" and spec["manifest"] == "alpha/sless.yaml"
    assert spec["http"] is True and spec["replicas"] == 1 and spec["environment"] == "prod"
    # a secret stays a reference: its value is nowhere in the resource
    assert spec["env"]["DSN"] == {"secret": "shared-db", "key": "dsn"}
    assert spec["env"]["MODE"] == {"value": "fast"}
    assert "very-secret" not in str(alpha)
    labels = alpha["metadata"]["labels"]
    assert labels["gitops-sless.dev/environment"] == "prod"
    assert labels["gitops-sless.dev/manifest"] == "alpha.sless.yaml"
    # the printer columns' fields: Phase, Runtime, Tag, Revision, URL
    record = harness.function("alpha")
    assert status["phase"] == "Ready" == record["phase"]
    assert status["buildTag"] == record["build_tag"] and status["revision"] == harness.repo.head()
    assert status["url"] == record["url"]
    # the image it runs, by the digest its build pushed (what `kubectl get fn` shows)
    deployment = kube.get("Deployment", PROD, "alpha")
    assert status["image"] == deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert "@sha256:" in status["image"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "True" and conditions["Built"]["status"] == "True"
    for condition in conditions.values():
        assert condition["observedGeneration"] == alpha["metadata"]["generation"]
        assert condition["lastTransitionTime"].endswith("Z") and condition["reason"]
    assert status["observedGeneration"] == alpha["metadata"]["generation"]


def test_a_no_change_pass_writes_nothing_not_even_status(kube, harness):
    settle(harness, kube)
    kube.reset_counts()
    harness.reconciler.sync("test")
    assert not any(kube.counts()["writes"].values()), kube.counts()["writes"]


def test_hand_edits_are_put_back_and_removed_functions_go(kube, harness):
    settle(harness, kube)
    client = KubeClient.from_config(str(kube.kubeconfig), calls=None)
    path = f"/apis/gitops-sless.dev/v1alpha1/namespaces/{PROD}/functions/alpha"
    merge = "application/merge-patch+json"
    client.request("patch", "Function", "PATCH", path, {"fieldManager": "kubectl-edit"},
                   {"spec": {"replicas": 7}}, merge)  # fmt: skip
    client.request("patch", "Function", "PATCH", path + "/status", {"fieldManager": "kubectl"},
                   {"status": {"phase": "Failed"}}, merge)  # fmt: skip
    assert function(kube, "alpha")["spec"]["replicas"] == 7
    assert function(kube, "alpha")["status"]["phase"] == "Failed"
    # the next pass after the watch brought the edit puts it back (a busy machine may
    # deliver the event after a pass that starts at once)
    view = harness.backend.view("prod")
    deadline = time.monotonic() + 10
    while (view.get("Function", "alpha") or {}).get("spec", {}).get("replicas") != 7:
        assert time.monotonic() < deadline, "the edit never reached the reconciler's view"
        time.sleep(0.02)
    harness.reconciler.sync("test")
    assert function(kube, "alpha")["spec"]["replicas"] == 1
    assert function(kube, "alpha")["status"]["phase"] == "Ready"
    harness.repo.commit("drop beta", {"beta/sless.yaml": None, "beta/main.py": None})
    harness.reconciler.sync("test")
    assert kube.get("Function", PROD, "beta") is None
    assert kube.get("Deployment", PROD, "beta") is None


def test_a_failed_build_shows_on_the_built_condition(kube, harness):
    settle(harness, kube)
    harness.repo.commit("break", {"alpha/main.py": HANDLER % "broken"})
    desired = harness.reconciler.load.run(harness.reconciler.source.snapshot())
    kube.fail_build(desired.functions["alpha"].build_tag, "error: pip exited 1\n")
    harness.reconciler.sync("test")
    conditions = {c["type"]: c for c in function(kube, "alpha")["status"]["conditions"]}
    assert conditions["Built"]["status"] == "False"
    # anyone who may read the resource sees that it failed; what it printed stays in the log
    assert conditions["Built"]["message"] == "build failed (exit 1)"
    assert "pip exited 1" not in str(function(kube, "alpha"))


def test_the_sample_repository_lists_every_function(kube, s3_server, tmp_path):
    repo = WorkRepo(tmp_path / "sample")
    shutil.copytree(ROOT / "sample-repo", repo.path, dirs_exist_ok=True)
    repo.commit("sample")
    harness = make(repo, tmp_path / "state", settings(kube.kubeconfig, s3_server.config()))
    try:
        harness.reconciler.sync("test")
        names = {f["metadata"]["name"] for f in kube.objects("Function", PROD)}
        assert names == {r["name"] for r in harness.store.functions("prod")}
        assert "greeting-py" in names and "notes-sql-py" in names
        sql = function(kube, "notes-sql-py")
        assert sql["spec"]["jobs"][0]["name"] == "notes-create-table-py"
        assert sql["status"]["jobs"][0]["phase"] == "Failed"
    finally:
        harness.close()


def images(kube: Any, name: str) -> list[str]:
    obj = kube.get("Deployment", PROD, name)
    return [c["image"] for c in obj["spec"]["template"]["spec"]["containers"]]


def test_a_rollback_switches_the_deployment_back_and_the_function_says_it_is_pinned(kube, harness):
    settle(harness, kube)
    first = images(kube, "alpha")
    harness.repo.commit("v2", function_folder("alpha", "v2"))
    # a pass that writes nothing may come while v2 still builds (a busy machine)
    deadline = time.monotonic() + 60
    while images(kube, "alpha") == first and time.monotonic() < deadline:
        settle(harness, kube)
    assert images(kube, "alpha") != first
    settle(harness, kube)
    reconciler = harness.reconciler
    assert [r.label for r in reconciler.revisions.of("alpha")] == ["r2", "r1"]

    target = reconciler.exclusively(lambda: reconciler.revisions.rollback("alpha", None, "test"))
    assert target.label == "r1"
    assert images(kube, "alpha") == first  # no build: r1's image, by digest
    settle(harness, kube)  # passes leave it where it was put
    assert images(kube, "alpha") == first
    status = function(kube, "alpha")["status"]
    assert (status["servingRevision"], status["pinned"]) == ("r1", "r1")
    assert "pinned" not in function(kube, "beta")["status"]

    # a commit that changes it unpins it: a new revision, built and deployed
    harness.repo.commit("v3", function_folder("alpha", "v3"))
    deadline = time.monotonic() + 60
    while function(kube, "alpha")["status"].get("servingRevision") != "r3":
        assert time.monotonic() < deadline, function(kube, "alpha")["status"]
        settle(harness, kube)
    status = function(kube, "alpha")["status"]
    assert status["servingRevision"] == "r3" and "pinned" not in status
    assert images(kube, "alpha") not in (first,)
