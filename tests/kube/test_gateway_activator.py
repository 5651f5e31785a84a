"""Issue 27 with ``--gateway``: an idle function's HTTPRoute sends its calls to the reconciler.

Knative's serverless service in proxy mode and serve mode: while an autoscaled function
has no replica that serves, its HTTPRoute sends ``/fn/{env}/{name}/...`` unchanged to the
reconciler's Service (whose proxy holds the call and wakes the function), allowed by a
ReferenceGrant in the reconciler's namespace; once a replica serves, the route is the one
the template renders, straight to the function's Service. The switch follows the watch
and keeps the route's spec hash, so a pass with no change writes nothing. Against the
test API server, which enforces the Gateway API's CRDs (tests/data/gateway-api-crds.yaml).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gitops_sless.kube import renderer
from gitops_sless.kube.activator import Grants, activator_route
from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.renderer import RenderConfig

from ..gateway_schema import assert_valid, schema_errors
from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, Harness, make, settings
from ..kubeapi import FakeKube
from ..s3server import S3Server
from .test_gateway_routes import CRDS, GATEWAY, PROD, _gateway_object
from .test_kube_scaling import function_folder, settled, wait_for, writes

AUTO = "    scale: {min: 0, max: 2, idle: 90s}"
ACTIVATOR = [{"kind": "Service", "namespace": NAMESPACE, "name": "gitops-sless", "port": 80}]


def _serving(name: str) -> list[dict[str, Any]]:
    return [{"kind": "Service", "name": name, "port": 80}]


@pytest.fixture
def cluster(fake_kube: FakeKube) -> FakeKube:
    """The test API server with the Gateway API's kinds and a Gateway."""
    for crd in yaml.safe_load_all(CRDS.read_text(encoding="utf-8")):
        fake_kube.install_crd(crd)
    fake_kube.api.admission["HTTPRoute"] = lambda obj: schema_errors([obj])[0]
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    for namespace in (NAMESPACE, GATEWAY[0]):
        client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    client.create(_gateway_object())
    return fake_kube


@pytest.fixture
def harness_for(cluster: FakeKube, s3_server: S3Server, tmp_path: Path):
    made: list[Harness] = []

    def build(repo: WorkRepo, state: str = "state") -> Harness:
        kube_settings = settings(cluster.kubeconfig, s3_server.config(), gateway=GATEWAY)
        harness = make(repo, tmp_path / state, kube_settings)
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.close()


def _route(kube: FakeKube, name: str) -> dict[str, Any]:
    route = kube.get("HTTPRoute", PROD, name)
    assert route is not None, f"no HTTPRoute {PROD}/{name}"
    return route


def _backends(kube: FakeKube, name: str) -> list[dict[str, Any]]:
    (rule,) = _route(kube, name)["spec"]["rules"]
    return rule["backendRefs"]


def _grants(kube: FakeKube) -> dict[str, dict[str, Any]]:
    return {g["metadata"]["name"]: g["spec"] for g in kube.objects("ReferenceGrant", NAMESPACE)}


def test_the_route_to_the_reconciler_is_the_rendered_one_sent_there_unchanged():
    config = RenderConfig(gateway=GATEWAY)
    serving = renderer.render_http_route("prod", "auto", 30, config)
    idle = activator_route(serving, config)
    assert_valid([serving, idle])
    (rule,) = idle["spec"]["rules"]
    # the path as the client sent it: the reconciler serves /fn/prod/auto/... itself
    assert "filters" not in rule and rule["backendRefs"] == ACTIVATOR
    assert rule["matches"] == serving["spec"]["rules"][0]["matches"]
    assert rule["timeouts"] == {"request": "30s"}
    assert idle["metadata"] == serving["metadata"]  # the spec hash of the serving route
    assert serving["spec"]["rules"][0]["backendRefs"] == _serving("auto")


def test_an_idle_functions_route_goes_to_the_reconciler_and_back_once_a_replica_serves(
    cluster, harness_for, tmp_path
):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("two", {**function_folder("auto", AUTO), **function_folder("fixed")})
    harness = harness_for(repo)
    harness.sync()
    assert _backends(cluster, "auto") == ACTIVATOR  # its first replica does not serve yet
    rendered = _route(cluster, "auto")["metadata"]["annotations"][renderer.SPEC_HASH]
    harness.sync()  # the new namespace's watches start
    # to its own Service once its replica serves (the watch, no pass)
    wait_for(lambda: _backends(cluster, "auto") == _serving("auto"), "the serving route")
    assert settled(cluster, "auto", 1)
    routes_of_prod = {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": PROD}
    assert _grants(cluster) == {
        PROD: {
            "from": [routes_of_prod],
            "to": [{"group": "", "kind": "Service", "name": "gitops-sless"}],
        }
    }

    # going to zero: to the reconciler before the replicas go
    harness.backend.scale("prod", "auto", 0)
    assert _backends(cluster, "auto") == ACTIVATOR
    wait_for(lambda: settled(cluster, "auto", 0), "no replica")
    harness.sync()
    assert harness.function("auto")["phase"] == "Idle"
    idle = _route(cluster, "auto")
    assert "filters" not in idle["spec"]["rules"][0]
    assert idle["metadata"]["annotations"][renderer.SPEC_HASH] == rendered

    # woken: back to its Service once the replica serves
    harness.backend.scale("prod", "auto", 1)
    wait_for(lambda: _backends(cluster, "auto") == _serving("auto"), "the serving route again")
    assert settled(cluster, "auto", 1)
    assert _route(cluster, "auto")["spec"]["rules"][0]["filters"]

    # idle again, and a pass with no change writes nothing
    harness.backend.scale("prod", "auto", 0)
    wait_for(lambda: settled(cluster, "auto", 0), "no replica again")
    harness.sync()
    assert _backends(cluster, "auto") == ACTIVATOR
    assert _backends(cluster, "fixed") == _serving("fixed")  # never autoscaled
    cluster.reset_counts()
    harness.sync()
    assert writes(cluster) == {}


def test_a_restart_at_zero_keeps_the_route_at_the_reconciler_and_writes_nothing(
    cluster, harness_for, tmp_path
):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("one", function_folder("auto", AUTO))
    first = harness_for(repo)
    first.sync()
    first.backend.scale("prod", "auto", 0)
    wait_for(lambda: settled(cluster, "auto", 0), "no replica")
    first.sync()
    first.close()
    cluster.reset_counts()
    again = harness_for(repo, "state-2")
    again.sync()
    again.sync()
    assert _backends(cluster, "auto") == ACTIVATOR
    assert not [key for key in writes(cluster) if key[1] in ("HTTPRoute", "ReferenceGrant")]


def test_a_grant_per_environment_written_once_and_pruned_with_it(cluster):
    config = RenderConfig(gateway=GATEWAY, controller_namespace=NAMESPACE)
    client = KubeClient.from_config(str(cluster.kubeconfig))
    grants = Grants(client, config)
    cluster.reset_counts()
    for env in ("prod", "pr-7", "prod"):
        grants.ensure(env)
    assert sorted(_grants(cluster)) == ["sless-pr-7", "sless-prod"]
    assert sum(n for (_, kind), n in writes(cluster).items() if kind == "ReferenceGrant") == 2
    grants.remove("pr-7")
    assert sorted(_grants(cluster)) == ["sless-prod"]
    assert Grants(client, config)._read() == {"sless-prod": _grants(cluster)["sless-prod"]}
