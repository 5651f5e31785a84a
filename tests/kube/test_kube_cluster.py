"""The Kubernetes backend's scenarios against a real cluster, when one is configured.

Set ``SLESS_TEST_KUBECONFIG`` to a kubeconfig whose user may do what
``deploy/``'s ClusterRole allows, plus ``SLESS_REGISTRY`` (a registry the
cluster's kaniko can push to and its nodes pull from) and the S3 settings
(``SLESS_S3_ENDPOINT``, ``SLESS_S3_BUCKET``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``) reachable from both this machine and the cluster (build pods
hold no key: they fetch their context by a presigned URL, with ``SLESS_FETCH_IMAGE``).
Each test uses its own environment (namespace ``sless-t<random>``) and deletes
it at the end. Without ``SLESS_TEST_KUBECONFIG`` these tests are skipped.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.storage import S3Config

from ..gitserver import WorkRepo
from ..kube_harness import Harness, make, settings
from .test_kube_backend import function_folder

KUBECONFIG = os.environ.get("SLESS_TEST_KUBECONFIG")
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not KUBECONFIG, reason="SLESS_TEST_KUBECONFIG is not set"),
]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    env = "t" + secrets.token_hex(4)
    made: list[Harness] = []

    def build(repo: WorkRepo, state: str = "state") -> Harness:
        kube_settings = settings(
            KUBECONFIG or "",
            S3Config.from_env(os.environ),
            namespace=os.environ.get("SLESS_NAMESPACE", "gitops-sless"),
            registry=os.environ["SLESS_REGISTRY"],
            build_timeout=900,
        )
        harness = make(repo, tmp_path / state, kube_settings, env=env)
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.close()
    client = KubeClient.from_config(KUBECONFIG)
    client.delete("Namespace", None, f"sless-{env}")


def wait_ready(harness: Harness, name: str, timeout: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        harness.reconciler.sync("test")
        record = harness.function(name)
        if record["phase"] == "Ready":
            return record
        time.sleep(2)
    raise AssertionError(f"{name} never became Ready: {harness.function(name)}")


def test_first_sync_then_a_no_change_sync_that_writes_nothing(cluster, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**function_folder("alpha"), **function_folder("beta")})
    harness = cluster(repo)
    wait_ready(harness, "alpha")
    wait_ready(harness, "beta")
    client = harness.backend.client
    deployment = client.get("Deployment", f"sless-{harness.reconciler.env}", "alpha") or {}
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert "@sha256:" in image  # the digest kaniko pushed, read from its termination message
    for job in client.list("Job", harness.backend.config.controller_namespace):
        pod = job["spec"]["template"]["spec"]
        names = [e["name"] for c in pod["containers"] for e in c.get("env") or []]
        assert not [n for n in names if n.startswith("AWS_")]
    before = harness.writes()
    harness.reconciler.sync("test")
    assert harness.writes() == before


def test_a_removed_function_is_pruned_and_an_empty_state_folder_changes_nothing(cluster, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**function_folder("alpha"), **function_folder("beta")})
    first = cluster(repo, "first")
    wait_ready(first, "alpha")
    repo.commit("drop beta", {"beta/sless.yaml": None, "beta/main.py": None})
    first.reconciler.sync("test")
    assert first.store.function(first.reconciler.env, "beta") is None
    first.close()
    second = cluster(repo, "empty")
    result = second.reconciler.sync("test")
    assert second.writes() == 0
    assert result.plan is not None and not result.plan.builds
