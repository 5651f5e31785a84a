"""Issue 27 on Kubernetes: every reconciler replica is an activator.

A function at zero keeps a way in: the status store says ``Idle`` and ``Ready`` as its
Deployment goes to zero and back, without waiting for a pass; a replica that does not lead
holds a call to an idle function and wakes it; with ``--gateway`` the function's HTTPRoute
sends calls to the reconciler's Service while no replica serves, and back to the
function's Service once one does. Against the test API server (tests/kubeapi).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gitops_sless.kube.client import KubeClient

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, kube_env
from ..kubeapi import FakeKube
from ..s3server import S3Server
from ..sless_server import SlessServer
from .test_kube_scaling import CRD, FAST, IDLE, deployed, function_folder


@pytest.fixture
def kube(fake_kube: FakeKube) -> FakeKube:
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    return fake_kube


def serve(
    cluster: FakeKube, s3: S3Server, repo: WorkRepo, state: Path, *args: str, **env: str
) -> SlessServer:
    """``serve --backend kubernetes`` that never polls: only what it is told starts a pass."""
    return SlessServer(
        str(repo.path),
        state,
        env=kube_env(cluster.kubeconfig, s3, **env),
        poll_interval=3600,
        args=["--backend", "kubernetes", *FAST, *args],
    ).start()


def phase(server: SlessServer, name: str) -> str | None:
    record = server.function(name)
    return record["phase"] if record else None


def test_idle_and_ready_follow_the_replicas_without_a_pass_being_asked_for(
    kube, s3_server, tmp_path
):
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("auto", function_folder("auto", "    scale: {min: 0, max: 2, idle: 2s}"))
    server = serve(kube, s3_server, repo, tmp_path / "state")
    try:
        before = max(s["id"] for s in server.syncs())
        # the first pass saw it start; nothing but the watch tells the store it went idle
        deployed(kube, server, "auto", 0, "zero")
        server.wait(lambda: phase(server, "auto") == "Idle", "Idle", 20)
        reply = server.call("auto", "/wake")
        assert reply.status_code == 200, reply.text
        server.wait(lambda: phase(server, "auto") == "Ready", "Ready", 20)
        server.wait(lambda: phase(server, "auto") == "Idle", "Idle again", 30)
        passes = [s for s in server.syncs() if s["id"] > before]
        assert passes and {p["trigger"] for p in passes} == {"follow-up"}, passes
    finally:
        server.stop()
    assert "Traceback" not in server.output()


def test_a_replica_that_does_not_lead_holds_a_call_to_an_idle_function_and_wakes_it(
    kube, s3_server, tmp_path
):
    kube.install_crd(CRD)  # what the replica that does not lead serves from
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("auto", function_folder("auto", IDLE))
    leader = serve(kube, s3_server, repo, tmp_path / "leader", POD_NAME="leader")
    follower = None
    try:
        deployed(kube, leader, "auto", 0, "zero")
        leader.wait(lambda: phase(leader, "auto") == "Idle", "Idle", 20)
        follower = SlessServer(
            str(repo.path),
            tmp_path / "follower",
            env=kube_env(kube.kubeconfig, s3_server, POD_NAME="follower"),
            args=["--backend", "kubernetes", *FAST],
        ).start(wait_for_sync=False)
        follower.wait(lambda: phase(follower, "auto") == "Idle", "Idle on the follower", 20)
        woken = kube.counts()["writes"].get(("patch", "Deployment/scale"), 0)
        reply = follower.call("auto", "/from-the-follower")
        assert reply.status_code == 200, reply.text
        assert int(reply.headers["x-sless-cold-start"]) >= 0
        assert reply.json()["path"].endswith("/from-the-follower")
        assert kube.counts()["writes"][("patch", "Deployment/scale")] == woken + 1
    finally:
        for server in (follower, leader):
            if server is not None:
                server.stop()
    assert "Traceback" not in leader.output()
    assert follower is not None and "Traceback" not in follower.output()


def _replicas_counted(server: SlessServer) -> float:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith("sless_reconciler_replicas "):
            return float(line.split()[1])
    return 0.0


def test_two_reconciler_replicas_admit_a_rate_limit_burst_between_them(kube, s3_server, tmp_path):
    kube.install_crd(CRD)
    repo = WorkRepo(tmp_path / "functions")
    limit = "    rateLimit: {rps: 0.01, burst: 4}"  # no refill to speak of during the test
    repo.commit("limited", function_folder("limited", limit))
    leader = serve(kube, s3_server, repo, tmp_path / "leader", POD_NAME="leader")
    follower = None
    try:
        leader.wait(lambda: phase(leader, "limited") == "Ready", "Ready", 30)
        follower = SlessServer(
            str(repo.path),
            tmp_path / "follower",
            env=kube_env(kube.kubeconfig, s3_server, POD_NAME="follower"),
            args=["--backend", "kubernetes", *FAST],
        ).start(wait_for_sync=False)
        follower.wait(lambda: phase(follower, "limited") == "Ready", "Ready on the follower", 30)
        for server in (leader, follower):  # each counts both (member leases, every 5 s)
            server.wait(lambda s=server: _replicas_counted(s) == 2, "two replicas counted", 30)
        statuses = [s.call("limited", "/").status_code for s in (leader, follower) * 3]
        assert sorted(statuses) == [200] * 4 + [429] * 2, statuses
    finally:
        for server in (follower, leader):
            if server is not None:
                server.stop()
