"""Issue 27 on Kubernetes: autoscaled Deployments, the scale subresource, scale to zero.

An autoscaled function's Deployment is applied without ``spec.replicas``; its
replicas are written through ``deployments/{name}/scale`` by the field
manager ``gitops-sless-autoscaler``, and only when they change. At zero it is
``Idle`` and keeps a route with no upstream, so the proxy holds a call while
``Backend.scale(..., 1)`` starts a replica, and sends it on when the watch
reports the replica ready. Against the test API server (tests/kubeapi).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from gitops_sless.kube import renderer
from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.policy import AUTOSCALER, ROUTE_ANNOTATION, RoutePolicy
from gitops_sless.kube.renderer import FUNCTION_LABEL as FUNCTION
from gitops_sless.manifests import load as manifest
from gitops_sless.manifests.model import RateLimit, Scale, Warm
from gitops_sless.source.snapshot import DirectorySnapshot

from ..gitserver import WorkRepo
from ..kube_harness import NAMESPACE, Harness, kube_env, make, settings
from ..kubeapi import FakeKube
from ..paths import ROOT
from ..s3server import S3Server
from ..sless_server import SlessServer

HANDLER = "def handler(event, context):\n    return {'from': %r}\n"
APPLY = "application/apply-patch+yaml"


def wait_for(check: Any, what: str, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def function_folder(name: str, *extra: str) -> dict[str, str]:
    manifest_text = (
        "functions:\n"
        f"  - name: {name}\n"
        "    runtime: python3.11\n"
        "    entrypoint: main.handler\n"
        "    triggers:\n"
        "      - type: http\n"
    ) + "".join(f"{line}\n" for line in extra)
    return {f"{name}/sless.yaml": manifest_text, f"{name}/main.py": HANDLER % "v1"}


def _objects(root: Path, files: dict[str, str], env: str = "prod") -> dict[str, dict]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    state = manifest.load(DirectorySnapshot(root))
    assert not state.invalid, state.problems
    objects = renderer.render_environment(state, env, builds=False).objects
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}


# --- the renderer -------------------------------------------------------------------------------


def test_a_function_without_scale_renders_byte_for_byte_as_before(tmp_path):
    """Upgrading rewrites no Deployment of a fixed count: this digest was taken at 41d72eb,
    before autoscaling existed (change it only with a deliberate change of the templates)."""
    files = {
        **function_folder("alpha"),
        **function_folder("pair", "    replicas: 2"),
        **function_folder("paused", "    enabled: false"),
    }
    objects = _objects(tmp_path, files)
    kept = [o for o in objects.values() if o["kind"] in ("Deployment", "Service")]
    # the build tag (and the spec hash over it) moves with the runtime's own files, which
    # change on their own: the shape of the objects is what must not
    text = re.sub(r"python3\.11-[0-9a-f]{24}", "python3.11-TAG", renderer.dump(kept))
    text = re.sub(r"(spec-hash: )[0-9a-f]{32}", r"\1HASH", text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert digest == "2be09928e10eed90c9104a57bf8134777062fd22407784524a6bba453b9d3c4e"
    assert [objects[f"Deployment/{n}"]["spec"]["replicas"] for n in ("alpha", "pair")] == [1, 2]
    assert all(ROUTE_ANNOTATION not in o["metadata"]["annotations"] for o in kept)


def test_an_autoscaled_deployment_has_no_replicas_and_carries_its_policy(tmp_path):
    files = {
        **function_folder(
            "auto",
            "    scale: {min: 1, max: 4, target: 5, idle: 90s, warm: "
            "[{cron: '0 8 * * 1-5', for: 1h, min: 2}]}",
            "    concurrency: 3",
            "    rateLimit: {rps: 2.5, burst: 5}",
            "    maxBodyBytes: 1000",
        ),
        **function_folder("fixed", "    scale: {min: 2, max: 2}"),
        **function_folder("limited", "    concurrency: 8"),
    }
    objects = _objects(tmp_path, files)
    auto = objects["Deployment/auto"]
    assert "replicas" not in auto["spec"]
    policy = RoutePolicy.decode(auto)
    assert policy == RoutePolicy(
        Scale(1, 4, 5, 90.0, (Warm("0 8 * * 1-5", 3600.0, 2),)),
        3,
        RateLimit(2.5, 5),
        1000,
        "python3.11",
    )
    assert auto["metadata"]["annotations"][renderer.SPEC_HASH] == renderer.spec_hash(auto)
    # min = max is a fixed count: written, as replicas is
    assert objects["Deployment/fixed"]["spec"]["replicas"] == 2
    assert RoutePolicy.decode(objects["Deployment/fixed"]) is None
    # call limits alone: a fixed count, and a route that knows them
    limited = objects["Deployment/limited"]
    assert limited["spec"]["replicas"] == 1
    assert RoutePolicy.decode(limited) == RoutePolicy(None, 8, None, None, "python3.11")


def test_a_preview_scales_to_zero_unless_replicas_are_written(tmp_path):
    files = {**function_folder("alpha"), **function_folder("pair", "    replicas: 2")}
    objects = _objects(tmp_path, files, env="pr-3")
    alpha = objects["Deployment/alpha"]
    assert "replicas" not in alpha["spec"]
    decoded = RoutePolicy.decode(alpha)
    assert decoded is not None and decoded.scale == Scale(0, 1)
    assert objects["Deployment/pair"]["spec"]["replicas"] == 2


def test_a_disabled_autoscaled_function_runs_nothing(tmp_path):
    objects = _objects(tmp_path, function_folder("auto", "    enabled: false", "    scale: {}"))
    assert objects["Deployment/auto"]["spec"]["replicas"] == 0
    assert RoutePolicy.decode(objects["Deployment/auto"]) is None


# --- the test API server's scale subresource ----------------------------------------------------

NS = "default"
IMAGE = "registry.local/app:v1"


def deployment_body(name: str, replicas: int | None = 1) -> dict[str, Any]:
    labels = {"app": name}
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels},
        "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "app", "image": IMAGE}]},
        },
    }
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name}, "spec": spec}


@pytest.fixture
def apps(fake_kube: FakeKube) -> Iterator[client.AppsV1Api]:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(fake_kube.kubeconfig), client_configuration=cfg)
    fake_kube.preloaded_images.add(IMAGE)
    with client.ApiClient(cfg) as api_client:
        yield client.AppsV1Api(api_client)


def pods(kube: FakeKube, name: str) -> list[dict[str, Any]]:
    return [p for p in kube.objects("Pod", NS) if p["metadata"]["labels"].get("app") == name]


def test_the_scale_subresource_reads_and_writes_a_deployments_replicas(apps, fake_kube):
    apps.create_namespaced_deployment(NS, deployment_body("web", replicas=2))
    scale = apps.read_namespaced_deployment_scale("web", NS)
    live = apps.read_namespaced_deployment("web", NS)
    assert (scale.kind, scale.api_version) == ("Scale", "autoscaling/v1")
    assert scale.metadata.uid == live.metadata.uid
    assert scale.metadata.resource_version == live.metadata.resource_version
    assert (scale.spec.replicas, scale.status.replicas, scale.status.selector) == (2, 2, "app=web")

    stream = fake_kube.store.resource_version
    answer = apps.patch_namespaced_deployment_scale(
        "web", NS, {"spec": {"replicas": 0}}, field_manager="scaler"
    )
    assert answer.spec.replicas == 0
    after = apps.read_namespaced_deployment("web", NS)
    assert after.spec.replicas == 0 and after.metadata.generation == live.metadata.generation + 1
    assert int(answer.metadata.resource_version) > int(stream)  # (the controller's come after)
    entries = [
        (m.manager, m.operation, m.subresource, m.fields_v1) for m in after.metadata.managed_fields
    ]
    assert ("scaler", "Update", "scale", {"f:spec": {"f:replicas": {}}}) in entries
    # the creator no longer owns replicas
    creator = next(e for e in entries if e[2] is None and e[1] == "Update")
    assert "f:replicas" not in creator[3]["f:spec"]
    # the controller removed the pods; a watch saw the Deployment change
    assert pods(fake_kube, "web") == []
    events = fake_kube.store.events_after(int(stream), ["Deployment"])
    assert any(e[1] == "MODIFIED" and e[3]["spec"]["replicas"] == 0 for e in events)

    # PUT, with the version it read: stale answers 409
    scale = apps.read_namespaced_deployment_scale("web", NS)
    scale.spec.replicas = 1
    assert apps.replace_namespaced_deployment_scale("web", NS, scale).spec.replicas == 1
    wait_for(lambda: [p for p in pods(fake_kube, "web") if _ready(p)], "a ready pod")
    with pytest.raises(ApiException) as stale:
        apps.replace_namespaced_deployment_scale("web", NS, scale)
    assert stale.value.status == 409
    # the same replicas again: no new version, no event
    before = apps.read_namespaced_deployment("web", NS).metadata.resource_version
    apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": 1}})
    assert apps.read_namespaced_deployment("web", NS).metadata.resource_version == before
    with pytest.raises(ApiException) as negative:
        apps.patch_namespaced_deployment_scale("web", NS, {"spec": {"replicas": -1}})
    assert negative.value.status == 422 and "greater than or equal to 0" in negative.value.body
    with pytest.raises(ApiException) as missing:
        apps.read_namespaced_deployment_scale("nobody", NS)
    assert missing.value.status == 404


def test_an_apply_without_replicas_leaves_the_scale_writers_count(apps, fake_kube):
    path_apply = {"field_manager": "deployer", "force": True}
    body = deployment_body("web", replicas=None)
    apps.patch_namespaced_deployment("web", NS, body, **path_apply, _content_type=APPLY)
    assert apps.read_namespaced_deployment("web", NS).spec.replicas == 1  # defaulted
    apps.patch_namespaced_deployment_scale(
        "web", NS, {"spec": {"replicas": 3}}, field_manager=AUTOSCALER
    )
    body["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "A", "value": "1"}]
    apps.patch_namespaced_deployment("web", NS, body, **path_apply, _content_type=APPLY)
    assert apps.read_namespaced_deployment("web", NS).spec.replicas == 3
    # a fixed count applied again takes replicas back from the autoscaler
    apps.patch_namespaced_deployment(
        "web", NS, deployment_body("web", replicas=2), **path_apply, _content_type=APPLY
    )
    live = apps.read_namespaced_deployment("web", NS)
    assert live.spec.replicas == 2
    assert AUTOSCALER not in {m.manager for m in live.metadata.managed_fields}


def test_discovery_lists_the_scale_subresource(apps, fake_kube):
    found = apps.get_api_resources()
    scale = next(r for r in found.resources if r.name == "deployments/scale")
    assert (scale.kind, scale.group, scale.version) == ("Scale", "autoscaling", "v1")
    assert sorted(scale.verbs) == ["get", "patch", "update"]


# --- the backend: apply and scale ---------------------------------------------------------------

PROD = "sless-prod"
CRD = ROOT / "deploy" / "crd-functions.yaml"


@pytest.fixture
def kube(fake_kube: FakeKube) -> FakeKube:
    client = KubeClient.from_config(str(fake_kube.kubeconfig), calls=None)
    client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    return fake_kube


@pytest.fixture
def harness_for(kube: FakeKube, s3_server: S3Server, tmp_path: Path):
    made: list[Harness] = []

    def build(repo: WorkRepo, state: str = "state") -> Harness:
        harness = make(repo, tmp_path / state, settings(kube.kubeconfig, s3_server.config()))
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.close()


def writes(kube: FakeKube) -> dict[tuple[str, str], int]:
    return {key: n for key, n in kube.counts()["writes"].items() if n}


def requests(kube: FakeKube) -> int:
    return sum(kube.counts()["requests"].values())


def owners(obj: dict[str, Any]) -> dict[tuple[str, str | None], dict[str, Any]]:
    """(manager, subresource) -> the spec fields it owns."""
    return {
        (m["manager"], m.get("subresource")): m["fieldsV1"].get("f:spec", {})
        for m in obj["metadata"]["managedFields"]
    }


def phase_after_passes(harness: Any, name: str, phase: str) -> None:
    """Passes until ``name``'s record says ``phase``: the reconciler's view of the cluster
    follows its watch, which may lag behind what the test reads from the cluster itself."""
    wait_for(lambda: harness.sync() and harness.function(name)["phase"] == phase, phase, 30)


def settled(kube: FakeKube, name: str, replicas: int) -> bool:
    live = kube.get("Deployment", PROD, name) or {}
    status = live.get("status") or {}
    return (
        live.get("spec", {}).get("replicas") == replicas
        and status.get("observedGeneration") == live["metadata"]["generation"]
        and int(status.get("availableReplicas") or 0) == replicas
        and int(status.get("replicas") or 0) == replicas
    )


def test_scale_writes_replicas_through_the_subresource_and_only_when_they_change(
    kube, harness_for, tmp_path
):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("auto", function_folder("auto", "    scale: {max: 3}"))
    harness = harness_for(repo)
    harness.sync()  # creates the namespace; the next pass watches what is in it
    harness.sync()
    live = kube.get("Deployment", PROD, "auto")
    # applied without replicas: the API server's default (one) is the initial scale
    assert "f:replicas" not in owners(live)[("gitops-sless", None)]
    assert live["spec"]["replicas"] == 1
    kube.reset_counts()
    harness.backend.scale("prod", "auto", 3)
    assert writes(kube) == {("patch", "Deployment/scale"): 1}
    live = kube.get("Deployment", PROD, "auto")
    assert live["spec"]["replicas"] == 3
    assert owners(live)[(AUTOSCALER, "scale")] == {"f:replicas": {}}
    kube.reset_counts()
    harness.backend.scale("prod", "auto", 3)  # before or after the watch brought it back
    assert requests(kube) == 0, kube.counts()["requests"]
    wait_for(lambda: settled(kube, "auto", 3), "three replicas")
    harness.backend.scale("prod", "auto", 3)
    assert requests(kube) == 0
    # the next pass sees no drift in the autoscaler's replicas: nothing is applied again
    harness.sync()
    assert writes(kube) == {}
    assert kube.get("Deployment", PROD, "auto")["spec"]["replicas"] == 3


def test_a_new_autoscaled_deployment_starts_its_minimum(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("auto", function_folder("auto", "    scale: {min: 2, max: 5}"))
    harness = harness_for(repo)
    kube.reset_counts()
    harness.sync()
    assert kube.counts()["writes"][("patch", "Deployment/scale")] == 1
    live = kube.get("Deployment", PROD, "auto")
    assert live["spec"]["replicas"] == 2
    assert owners(live)[(AUTOSCALER, "scale")] == {"f:replicas": {}}
    # a new version keeps what the autoscaler set: no initial scale for a Deployment that exists
    harness.backend.scale("prod", "auto", 4)
    repo.commit("v2", {"auto/main.py": HANDLER % "v2"})
    kube.reset_counts()
    harness.sync()
    # its own, and the previous revision's, kept runnable beside it (created at zero)
    assert kube.counts()["writes"][("apply", "Deployment")] == 2
    assert ("patch", "Deployment/scale") not in writes(kube)
    assert kube.get("Deployment", PROD, "auto")["spec"]["replicas"] == 4


def test_a_fixed_count_that_becomes_autoscaled_keeps_its_replicas(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("fixed", function_folder("fn", "    replicas: 3"))
    harness = harness_for(repo)
    harness.sync()
    repo.commit("auto", function_folder("fn", "    scale: {min: 0, max: 5}"))
    harness.sync()
    live = kube.get("Deployment", PROD, "fn")
    assert live["spec"]["replicas"] == 3
    assert owners(live)[(AUTOSCALER, "scale")] == {"f:replicas": {}}
    # and back: the fixed count is applied again, the autoscaler's ownership gone
    repo.commit("fixed again", function_folder("fn", "    replicas: 2"))
    harness.sync()
    live = kube.get("Deployment", PROD, "fn")
    assert live["spec"]["replicas"] == 2 and (AUTOSCALER, "scale") not in owners(live)


def test_at_zero_replicas_a_function_is_idle_and_a_pass_with_no_change_writes_nothing(
    kube, harness_for, tmp_path
):
    kube.install_crd(CRD)  # the Function resources say Idle too
    repo = WorkRepo(tmp_path / "repo")
    repo.commit(
        "two",
        {**function_folder("auto", "    scale: {idle: 90s}"), **function_folder("fixed")},
    )
    harness = harness_for(repo)
    harness.sync()
    harness.backend.scale("prod", "auto", 0)
    wait_for(lambda: settled(kube, "auto", 0) and settled(kube, "fixed", 1), "settled")
    phase_after_passes(harness, "auto", "Idle")  # the view follows the cluster's watch
    record = harness.function("auto")
    assert record["message"] == "no calls for 90s: no replica runs; a call starts one"
    status = kube.get("Function", PROD, "auto")["status"]
    assert status["phase"] == "Idle"
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("True", "Idle")  # it takes calls
    kube.reset_counts()
    harness.sync()
    assert writes(kube) == {}
    assert requests(kube) == 0, kube.counts()["requests"]
    assert kube.get("Deployment", PROD, "auto")["spec"]["replicas"] == 0
    # woken, it is Ready once its replica serves, and no rollout while the autoscaler scales
    harness.backend.scale("prod", "auto", 1)
    wait_for(lambda: settled(kube, "auto", 1), "one replica")
    phase_after_passes(harness, "auto", "Ready")
    harness.backend.scale("prod", "auto", 3)
    kube.stall(PROD, "auto")  # the new replicas do not start: the first one still serves
    # Ready while they never start (a rollout would stay Pending): passes until the view
    # has the controller's answer to the scale (its watch may lag on a loaded machine)
    phase_after_passes(harness, "auto", "Ready")


def test_a_replica_that_does_not_lead_may_wake_a_function(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("auto", function_folder("auto", "    scale: {}"))
    leader = harness_for(repo)
    leader.sync()
    leader.backend.scale("prod", "auto", 0)
    follower = harness_for(repo, "follower")  # watches nothing of prod: it reads the Scale
    follower.backend.client.may_write = lambda: False
    kube.reset_counts()
    follower.backend.scale("prod", "auto", 1)
    assert kube.counts()["requests"] == {
        ("get", "Deployment/scale"): 1,
        ("patch", "Deployment/scale"): 1,
    }
    assert kube.get("Deployment", PROD, "auto")["spec"]["replicas"] == 1
    kube.reset_counts()
    follower.backend.scale("prod", "auto", 1)
    assert writes(kube) == {}


# --- routes -------------------------------------------------------------------------------------


def test_an_autoscaled_function_keeps_a_route_at_zero_and_gets_its_upstream_from_the_watch(
    kube, harness_for, tmp_path
):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit(
        "auto",
        function_folder(
            "auto",
            "    scale: {max: 4, target: 2}",
            "    concurrency: 3",
            "    rateLimit: {rps: 5, burst: 10}",
            "    maxBodyBytes: 2048",
        ),
    )
    harness = harness_for(repo)
    harness.sync()
    harness.sync()
    route = wait_for(lambda: harness.routes.get("prod", "auto"), "a route")
    assert (route.scale, route.concurrency) == (Scale(0, 4, 2), 3)
    assert (route.rate_limit, route.max_body_bytes) == (RateLimit(5.0, 10), 2048)
    assert route.runtime == "python3.11"
    harness.backend.scale("prod", "auto", 0)
    # no upstream from the moment it goes to zero; the route stays, so calls wait
    route = harness.routes.get("prod", "auto")
    assert route is not None and route.upstreams == () and route.scale is not None
    wait_for(lambda: settled(kube, "auto", 0), "zero")
    # no pass from here on: the watch alone brings the started replica to the route
    harness.backend.scale("prod", "auto", 1)
    served = wait_for(lambda: (r := harness.routes.get("prod", "auto")) and r.upstreams and r, "up")
    assert served.available == 1 and served.failed is None


def test_a_start_that_fails_is_on_the_route_until_a_replica_serves(kube, harness_for, tmp_path):
    repo = WorkRepo(tmp_path / "repo")
    repo.commit("auto", function_folder("auto", "    scale: {}"))
    harness = harness_for(repo)
    harness.sync()
    harness.sync()
    harness.backend.scale("prod", "auto", 0)
    wait_for(lambda: settled(kube, "auto", 0), "zero")
    kube.crash_loop(PROD, "auto", reason="OOMKilled", exit_code=137)
    before = time.monotonic()
    harness.backend.scale("prod", "auto", 1)
    failed = wait_for(lambda: (r := harness.routes.get("prod", "auto")) and r.failed and r, "502")
    assert failed.failed == "CrashLoopBackOff: last exit OOMKilled: exit code 137"
    assert before + 10 <= failed.retry_at <= time.monotonic() + 10  # the kubelet's back-off
    assert failed.upstreams == ()
    kube.heal(PROD, "auto")
    served = wait_for(lambda: (r := harness.routes.get("prod", "auto")) and r.upstreams and r, "up")
    assert served.failed is None


# --- scale to zero through the reconciler's proxy -----------------------------------------------

# the autoscaler's windows in seconds, as tests/local/test_scale_to_zero.py runs them
FAST = ["--scale-window", "3s", "--scale-panic-window", "1s", "--scale-tick", "0.2s"]
IDLE = "    scale: {min: 0, max: 2, idle: 1s}"


def replicas(kube: FakeKube, name: str) -> int | None:
    live = kube.get("Deployment", PROD, name)
    return None if live is None else int(live["spec"].get("replicas", 1))


def running(kube: FakeKube, name: str) -> list[dict[str, Any]]:
    return [p for p in kube.objects("Pod", PROD) if p["metadata"]["labels"].get(FUNCTION) == name]


def deployed(kube: FakeKube, server: SlessServer, name: str, count: int, what: str) -> None:
    """Wait until ``name`` runs ``count`` replicas and no other pod (the server's log else)."""

    def done() -> bool:
        return replicas(kube, name) == count and len(running(kube, name)) == count

    try:
        wait_for(done, what, 60)
    except AssertionError as exc:
        state = (replicas(kube, name), len(running(kube, name)))
        output = server.output()[-3000:]
        raise AssertionError(f"{exc} (replicas, pods: {state}):\n{output}") from None


def serve(kube: FakeKube, s3: S3Server, repo: WorkRepo, state: Path) -> SlessServer:
    return SlessServer(
        str(repo.path),
        state,
        env=kube_env(kube.kubeconfig, s3),
        poll_interval=1,
        args=["--backend", "kubernetes", *FAST],
    ).start()


def test_a_call_wakes_a_function_at_zero_and_a_restart_leaves_it_there(kube, s3_server, tmp_path):
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("auto", function_folder("auto", IDLE))
    server = serve(kube, s3_server, repo, tmp_path / "state")
    try:
        # one replica to start with (the deploy shows it runs), then idle: zero
        deployed(kube, server, "auto", 0, "zero")
        assert kube.get("Deployment", PROD, "auto")["metadata"]["generation"] == 2
        server.wait(lambda: server.function("auto")["phase"] == "Idle", "Idle", 30)
        woken = kube.counts()["writes"].get(("patch", "Deployment/scale"), 0)
        reply = server.call("auto", "/hello?x=1")
        assert reply.status_code == 200, reply.text
        # held while the wake raised the Deployment and the watch saw its replica ready
        assert int(reply.headers["x-sless-cold-start"]) >= 0
        echoed = reply.json()  # the test API server's service proxy echoes the call
        assert echoed["service"] == "auto" and echoed["path"].endswith("/hello")
        assert kube.counts()["writes"][("patch", "Deployment/scale")] == woken + 1
        warm = server.call("auto", "/again")
        assert warm.status_code == 200 and "x-sless-cold-start" not in warm.headers
        deployed(kube, server, "auto", 0, "zero again")
    finally:
        server.stop()
    assert "Traceback" not in server.output()

    kube.reset_counts()
    again = serve(kube, s3_server, repo, tmp_path / "state-2")  # an empty state folder
    try:
        again.sync()
        time.sleep(1)  # ticks of the new autoscaler: nothing to decide at zero
        assert ("patch", "Deployment/scale") not in writes(kube), writes(kube)
        assert ("apply", "Deployment") not in writes(kube), writes(kube)
        assert replicas(kube, "auto") == 0
        assert again.function("auto")["phase"] == "Idle"
        reply = again.call("auto", "/after-restart")
        assert reply.status_code == 200, reply.text
        assert "x-sless-cold-start" in reply.headers
        assert writes(kube)[("patch", "Deployment/scale")] == 1
    finally:
        again.stop()
    assert "Traceback" not in again.output()


def test_a_replica_that_cannot_start_answers_the_waiting_call_502_naming_why(
    kube, s3_server, tmp_path
):
    repo = WorkRepo(tmp_path / "functions")
    repo.commit("auto", function_folder("auto", IDLE))
    server = serve(kube, s3_server, repo, tmp_path / "state")
    try:
        deployed(kube, server, "auto", 0, "zero")
        # and the server has seen it (its view follows the watch): a route it still thinks
        # ready would send the call on, to a Service without endpoints (503)
        server.wait(lambda: server.function("auto")["phase"] == "Idle", "Idle", 30)
        kube.crash_loop(PROD, "auto", reason="Error", exit_code=3)
        reply = server.call("auto", "/hello")
        assert reply.status_code == 502, reply.text
        error = reply.json()["error"]
        assert error.startswith("function failed to start: CrashLoopBackOff")
        assert "exit code 3" in error
        wakes = kube.counts()["writes"][("patch", "Deployment/scale")]
        again = server.call("auto", "/hello")  # within the back-off: at once, no new wake
        assert again.status_code == 502
        assert kube.counts()["writes"][("patch", "Deployment/scale")] == wakes
    finally:
        server.stop()
    assert "Traceback" not in server.output()
