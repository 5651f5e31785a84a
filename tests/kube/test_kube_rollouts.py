"""Revisions and rollouts on Kubernetes, through ``gitops-sless serve`` as users run it.

A kept revision, and a rollout's candidate, are a Deployment and a Service of their
own (``<name>-rev-<id>``) beside the function's; the test API server's service proxy
echoes which Service a call reached, so the split is seen call by call.
"""

from __future__ import annotations

from typing import Any

import pytest

from gitops_sless.kube.client import KubeClient

from ..gateway_schema import assert_valid
from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, make, settings
from ..kubeapi import FakeKube
from ..sless_server import SlessServer
from . import test_gateway_activator
from .test_gateway_routes import GATEWAY
from .test_kube_scaling import CRD, HANDLER, PROD, function_folder, serve, wait_for

cluster = test_gateway_activator.cluster  # the API server with the Gateway API and a Gateway
ROLLOUT = "    rollout: {steps: [20], interval: 1s, minRequests: 10, maxErrorRate: 0.5}"
REVISION_OF = "gitops-sless.dev/revision-of"


@pytest.fixture
def kube(fake_kube: FakeKube) -> FakeKube:
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    fake_kube.install_crd(CRD)
    return fake_kube


def revision_deployments(kube: FakeKube, name: str) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d
        for d in kube.objects("Deployment", PROD)
        if d["metadata"]["labels"].get(REVISION_OF) == name
    }


def at_zero(kube: FakeKube, name: str) -> bool:
    """One revision of ``name`` kept beside it, asking for no replica."""
    kept = list(revision_deployments(kube, name).values())
    return len(kept) == 1 and kept[0]["spec"].get("replicas") == 0


def status(kube: FakeKube, name: str) -> dict[str, Any]:
    found = kube.get("Function", PROD, name)
    return (found or {}).get("status") or {}


def phase(server: SlessServer, name: str) -> str | None:
    found = server.function(name)
    return None if found is None else found["phase"]


def services_reached(server: SlessServer, name: str, calls: int) -> list[str]:
    reached = []
    for i in range(calls):
        reply = server.call(name, f"/call-{i}")
        assert reply.status_code == 200, reply.text
        reached.append(reply.json()["service"])
    return reached


def test_a_rollout_shares_the_calls_then_promotes_and_keeps_the_old_revision_at_zero(
    kube, s3_server, tmp_path
):
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("v1", function_folder("alpha", ROLLOUT))
    server = serve(kube, s3_server, repo, tmp_path / "state")
    try:
        server.wait(lambda: phase(server, "alpha") == "Ready", "alpha Ready", 60)
        repo.commit("v2", {"alpha/main.py": HANDLER % "v2"})
        server.wait(lambda: phase(server, "alpha") == "Progressing", "a rollout", 60)
        (candidate,) = revision_deployments(kube, "alpha")
        assert candidate.startswith("alpha-rev-")
        wait_for(
            lambda: (
                status(kube, "alpha").get("traffic")
                == [{"revision": "r1", "percent": 80}, {"revision": "r2", "percent": 20}]
            ),
            "the Function resource shows the split",
            30,
        )
        # every 100 calls hold exactly the step's share; 50 calls: 10 to the candidate
        reached = services_reached(server, "alpha", 50)
        assert reached.count(candidate) == 10 and reached.count("alpha") == 40, reached
        assert server.call("alpha@r2", "/own").json()["service"] == candidate

        # enough calls, none failed: promoted after the step's interval
        def promoted() -> bool:
            found = server.function("alpha") or {}
            return found.get("phase") == "Ready" and found.get("servingRevision") == "r2"

        server.wait(promoted, "r2 promoted", 60)
        # the function's own Deployment runs r2; the candidate's objects go once it serves,
        # and r1 is kept beside it at zero replicas, reached at its own URL
        wait_for(lambda: candidate not in revision_deployments(kube, "alpha"), "no candidate", 30)
        (kept,) = revision_deployments(kube, "alpha")
        assert kept != candidate and kube.get("Deployment", PROD, kept)["spec"]["replicas"] == 0
        wait_for(lambda: "traffic" not in status(kube, "alpha"), "no split shown", 30)
        assert set(services_reached(server, "alpha", 10)) == {"alpha"}
        woken = server.call("alpha@r1", "/old")
        assert woken.status_code == 200 and woken.json()["service"] == kept
        assert "x-sless-cold-start" in woken.headers  # started by the call, from zero
        missing = server.call("alpha@r9", "/")
        assert missing.status_code == 404 and "r2" in missing.text and "r1" in missing.text
    finally:
        server.stop()
    assert "Traceback" not in server.output()


def test_a_candidate_that_cannot_start_is_rolled_back_and_the_function_serves_on(
    kube, s3_server, tmp_path
):
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("v1", function_folder("alpha", ROLLOUT))
    kube.crash_loop(PROD, "alpha-rev-*", "Error", 3)  # every revision's pods, not alpha's
    server = serve(kube, s3_server, repo, tmp_path / "state")
    try:
        server.wait(lambda: phase(server, "alpha") == "Ready", "alpha Ready", 60)
        image = kube.get("Deployment", PROD, "alpha")["spec"]["template"]["spec"]["containers"]
        repo.commit("v2", {"alpha/main.py": HANDLER % "v2"})
        server.wait(lambda: phase(server, "alpha") == "RolledBack", "rolled back", 90)
        found = server.function("alpha") or {}
        assert "r2 did not start" in found["message"] and "CrashLoopBackOff" in found["message"]
        assert found["servingRevision"] == "r1"
        # the function's own Deployment was never touched, and the candidate is gone
        live = kube.get("Deployment", PROD, "alpha")["spec"]["template"]["spec"]["containers"]
        assert live == image
        # r2 stays a kept revision (reached at its own URL): at zero, no pod crashes on
        wait_for(lambda: at_zero(kube, "alpha"), "the candidate at zero", 30)
        assert set(services_reached(server, "alpha", 5)) == {"alpha"}
        # the passes that follow do not try the same version again
        server.sync()
        assert phase(server, "alpha") == "RolledBack"
        assert at_zero(kube, "alpha")
    finally:
        server.stop()
    assert "Traceback" not in server.output()


def test_a_restart_in_the_middle_of_a_rollout_resumes_it_from_the_cluster(
    kube, s3_server, tmp_path
):
    repo = WorkRepo(tmp_path / "functions")
    slow = "    rollout: {steps: [20, 50], interval: 1s, minRequests: 10, maxErrorRate: 0.5}"
    repo.commit("v1", function_folder("alpha", slow))
    server = serve(kube, s3_server, repo, tmp_path / "state")
    try:
        server.wait(lambda: phase(server, "alpha") == "Ready", "alpha Ready", 60)
        repo.commit("v2", {"alpha/main.py": HANDLER % "v2"})
        server.wait(lambda: phase(server, "alpha") == "Progressing", "a rollout", 60)
        services_reached(server, "alpha", 50)  # enough for step 1's verdict
        server.wait(
            lambda: "50%" in ((server.function("alpha") or {}).get("message") or ""),
            "step 2",
            30,
        )
    finally:
        server.stop()
    (candidate,) = revision_deployments(kube, "alpha")
    uid = kube.get("Deployment", PROD, candidate)["metadata"]["uid"]

    kube.reset_counts()
    again = serve(kube, s3_server, repo, tmp_path / "state")
    try:
        again.wait(lambda: phase(again, "alpha") == "Progressing", "resumed", 60)
        again.sync()  # its routes are the cluster's as the first pass read them
        # the candidate as it ran: not written again, and it takes step 2's share at once
        assert kube.get("Deployment", PROD, candidate)["metadata"]["uid"] == uid
        assert ("apply", "Deployment") not in kube.counts()["writes"]
        reached = services_reached(again, "alpha", 20)
        assert reached.count(candidate) == 10, reached
        services_reached(again, "alpha", 20)

        def promoted() -> bool:
            found = again.function("alpha") or {}
            return found.get("phase") == "Ready" and found.get("servingRevision") == "r2"

        again.wait(promoted, "r2 promoted", 60)
    finally:
        again.stop()
    assert "Traceback" not in again.output()


# --- with --gateway ---------------------------------------------------------------------


def test_with_a_gateway_the_route_carries_the_split_and_a_warm_revision_has_a_route(
    cluster, s3_server, tmp_path
):
    kube = cluster  # with the Gateway API's kinds, and a Gateway
    repo = WorkRepo(tmp_path / "functions")
    no_data = "    rollout: {steps: [30], interval: 1s, minRequests: 0, maxErrorRate: 0.5}"
    repo.commit("v1", function_folder("alpha", no_data))
    settings_ = settings(kube.kubeconfig, s3_server.config(), gateway=GATEWAY)
    harness = make(repo, tmp_path / "state", settings_)
    try:
        wait_for(lambda: harness.sync() and backends(kube, "alpha") == own("alpha"), "v1", 60)
        repo.commit("v2", {"alpha/main.py": HANDLER % "v2"})
        wait_for(lambda: harness.sync() and len(backends(kube, "alpha")) == 2, "a split", 60)
        (candidate,) = revision_deployments(kube, "alpha")
        assert backends(kube, "alpha") == [
            {"kind": "Service", "name": "alpha", "port": 80, "weight": 70},
            {"kind": "Service", "name": candidate, "port": 80, "weight": 30},
        ]
        # the next passes leave the split alone; after the interval the candidate is promoted,
        # and the route goes straight to the function's Service again
        wait_for(
            lambda: harness.sync() and harness.function("alpha")["serving_revision"] == "r2",
            "promoted",
            30,
        )
        wait_for(lambda: harness.sync() and backends(kube, "alpha") == own("alpha"), "one", 30)
        (kept,) = revision_deployments(kube, "alpha")
        # r1, kept at zero, has no route of its own: the reconciler's URL starts it
        assert kube.get("HTTPRoute", PROD, kept) is None
        harness.backend.scale("prod", f"alpha@{kept.rpartition('-')[2]}", 1)
        wait_for(lambda: kube.get("HTTPRoute", PROD, kept) is not None, "a warm route", 30)
        rules = kube.get("HTTPRoute", PROD, kept)["spec"]["rules"]
        prefixes = [rule["matches"][0]["path"]["value"] for rule in rules]
        assert prefixes == ["/fn/prod/alpha@r1", f"/fn/prod/alpha@{kept.rpartition('-')[2]}"]
        assert {r["backendRefs"][0]["name"] for r in rules} == {kept}
        assert_valid([kube.get("HTTPRoute", PROD, "alpha"), kube.get("HTTPRoute", PROD, kept)])
    finally:
        harness.close()


def backends(kube: FakeKube, name: str) -> list[dict[str, Any]]:
    route = kube.get("HTTPRoute", PROD, name)
    if route is None:
        return []
    (rule,) = route["spec"]["rules"]
    return rule["backendRefs"]


def own(name: str) -> list[dict[str, Any]]:
    return [{"kind": "Service", "name": name, "port": 80}]
