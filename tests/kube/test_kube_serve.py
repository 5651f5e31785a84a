"""``gitops-sless serve --backend kubernetes`` as a user runs it: a process, a kubeconfig, S3.

The API server is the test double in tests/kubeapi (validating every object
strictly); S3 is a real SeaweedFS server. Outside a cluster the invoke proxy
goes through the API server's service proxy with the kubeconfig's token.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest

from gitops_sless.kube.client import KubeClient

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, kube_env
from ..kubeapi import FakeKube
from ..paths import SAMPLE
from ..sless_server import SlessServer

SERVE = (sys.executable, "-m", "gitops_sless", "serve", "--backend", "kubernetes")


@pytest.fixture
def kube(fake_kube: FakeKube) -> FakeKube:
    KubeClient.from_config(str(fake_kube.kubeconfig), calls=None).create(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    )
    return fake_kube


def wait_for(check: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_serve_converges_the_sample_repository_and_proxies_through_the_api_server(
    kube, s3_server, tmp_path
):
    repo = WorkRepo(tmp_path / "functions")
    shutil.copytree(SAMPLE, repo.path, dirs_exist_ok=True)
    repo.commit("sample")
    kube.set_job_log("sless-prod", "get-time-py-run-1", '{"utc": "2026-12-01T00:00:00Z"}\n')
    server = SlessServer(
        str(repo.path),
        tmp_path / "state",
        env=kube_env(kube.kubeconfig, s3_server),
        args=["--backend", "kubernetes"],
    ).start()
    try:
        ready = wait_for(
            lambda: (f := server.function("greeting-py")) and f["phase"] == "Ready" and f,
            "greeting-py Ready",
        )
        assert ready["buildTag"] and kube.get("Deployment", "sless-prod", "greeting-py")
        response = server.call("greeting-py", "/hello?name=kube", headers={"Authorization": "x"})
        assert response.status_code == 200, response.text
        echoed = response.json()  # the test API server's service proxy echoes the request
        assert echoed["namespace"] == "sless-prod" and echoed["service"].startswith("greeting-py")
        assert echoed["path"].endswith("/hello") and "name=kube" in echoed["query"]
        # the API server took the kubeconfig's token (else 401) and, like the real one, did
        # not pass credentials on; the caller's own Authorization never got that far
        assert "authorization" not in {name.lower() for name in echoed["headers"]}
        notes = wait_for(  # its pod is seen waiting once the view is read again
            lambda: (n := server.function("notes-py")) and "notes-db" in (n["message"] or "") and n,
            "notes-py waiting for its secret",
        )
        assert notes["phase"] == "Pending"
        assert server.call("notes-py", "/list").status_code == 503
        assert server.call("nobody", "/").status_code == 404
    finally:
        server.stop()
    assert "Traceback" not in server.output()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"SLESS_NAMESPACE": "missing-ns"}, "namespace missing-ns does not exist"),
        ({"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, "access denied"),
        ({"SLESS_S3_ENDPOINT": "http://127.0.0.1:9"}, "unreachable"),
        ({"KUBECONFIG": "/nonexistent/kubeconfig"}, "cannot load Kubernetes credentials"),
    ],
)
def test_a_missing_prerequisite_is_one_line_and_exit_2(kube, s3_server, tmp_path, change, expected):
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("empty", {"README.md": "x\n"})
    env = {**kube_env(kube.kubeconfig, s3_server, **change)}
    result = subprocess.run(
        [*SERVE, "--repo", str(repo.path), "--state-dir", str(tmp_path / "state")],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "wrong-secret" not in result.stderr and s3_server.secret_key not in result.stderr


def test_an_unreachable_api_server_is_one_line_and_exit_2(s3_server, tmp_path):
    kube = FakeKube()
    kube.start()
    config = kube.write_kubeconfig(tmp_path / "kubeconfig")
    kube.stop()  # nothing listens there now
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("empty", {"README.md": "x\n"})
    kube.kubeconfig = config
    result = subprocess.run(
        [*SERVE, "--repo", str(repo.path), "--state-dir", str(tmp_path / "state")],
        env={**os.environ, **kube_env(kube.kubeconfig, s3_server)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unreachable" in lines[0], result.stderr
