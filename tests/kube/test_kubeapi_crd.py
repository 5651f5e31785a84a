"""CustomResourceDefinitions in the fake Kubernetes API server (tests/kubeapi), and Lease
optimistic concurrency, driven through the official client."""

from __future__ import annotations

import copy
import json
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client, config, dynamic, watch
from kubernetes.client.rest import ApiException

from tests.kube.test_kubeapi import apply, call, wait_for
from tests.kubeapi import FakeKube
from tests.kubeapi.fixtures import fake_kube  # noqa: F401  (the fixture)

from ..paths import ROOT

NS = "default"
GROUP, VERSION, PLURAL = "gitops-sless.dev", "v1alpha1", "functions"
BASE = f"/apis/{GROUP}/{VERSION}"
APPLY = "application/apply-patch+yaml"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {
            "kind": "Function",
            "plural": PLURAL,
            "singular": "function",
            "shortNames": ["fn"],
        },
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"}
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "required": ["spec"],
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["runtime"],
                                "properties": {
                                    "runtime": {
                                        "type": "string",
                                        "enum": ["python3.11", "nodejs20"],
                                    },
                                    "replicas": {"type": "integer", "minimum": 0},
                                    "entrypoint": {"type": "string", "maxLength": 20},
                                    "event": {
                                        "type": "object",
                                        "x-kubernetes-preserve-unknown-fields": True,
                                    },
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {
                                    "phase": {"type": "string"},
                                    "conditions": {
                                        "type": "array",
                                        "maxItems": 4,
                                        "items": {
                                            "type": "object",
                                            "required": ["type", "status"],
                                            "properties": {
                                                "type": {"type": "string"},
                                                "status": {"type": "string"},
                                            },
                                        },
                                    },
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


@pytest.fixture
def api(fake_kube: FakeKube) -> Iterator[client.ApiClient]:  # noqa: F811
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(fake_kube.kubeconfig), client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        yield api_client


@pytest.fixture
def crd(api: client.ApiClient) -> dict[str, Any]:
    created = client.ApiextensionsV1Api(api).create_custom_resource_definition(copy.deepcopy(CRD))
    return created.to_dict()


def function(name: str, runtime: str = "python3.11", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Function",
        "metadata": {"name": name},
        "spec": {"runtime": runtime, **spec},
    }


def status_of(err: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    return json.loads(err.value.body)


def test_crd_is_established_validated_and_discovered(
    api: client.ApiClient,
    crd: dict[str, Any],
    fake_kube: FakeKube,  # noqa: F811
) -> None:
    ext = client.ApiextensionsV1Api(api)
    conds = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conds == {"NamesAccepted": "True", "Established": "True"}
    assert crd["status"]["accepted_names"]["short_names"] == ["fn"]
    assert crd["status"]["stored_versions"] == [VERSION]
    assert crd["metadata"]["generation"] == 1
    read = ext.read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    assert read.spec.names.list_kind == "FunctionList"  # defaulted
    assert read.spec.versions[0].additional_printer_columns[0].json_path == ".status.phase"
    assert [c.metadata.name for c in ext.list_custom_resource_definition().items] == [
        f"{PLURAL}.{GROUP}"
    ]
    with pytest.raises(ApiException) as err:
        ext.create_custom_resource_definition(copy.deepcopy(CRD))
    assert err.value.status == 409 and status_of(err)["reason"] == "AlreadyExists"

    # server-side apply of the same CRD changes nothing
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{PLURAL}.{GROUP}"
    code, first = apply(api, path, CRD, "kubectl", force=True)
    code, again = apply(api, path, CRD, "kubectl")
    assert code == 200
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]

    # discovery: the group, its version, the resource with its short name and status
    code, groups, _ = call(api, "GET", "/apis")
    ours = next(g for g in groups["groups"] if g["name"] == GROUP)
    assert ours["preferredVersion"] == {"groupVersion": f"{GROUP}/{VERSION}", "version": VERSION}
    code, resources, _ = call(api, "GET", BASE)
    by_name = {r["name"]: r for r in resources["resources"]}
    assert by_name[PLURAL]["shortNames"] == ["fn"] and by_name[PLURAL]["namespaced"] is True
    assert by_name[PLURAL]["kind"] == "Function" and "watch" in by_name[PLURAL]["verbs"]
    assert by_name[f"{PLURAL}/status"]["verbs"] == ["get", "patch", "update"]
    code, body, _ = call(api, "GET", "/apis/apiextensions.k8s.io/v1")
    assert "customresourcedefinitions" in {r["name"] for r in body["resources"]}
    functions = dynamic.DynamicClient(api).resources.get(
        api_version=f"{GROUP}/{VERSION}", kind="Function"
    )
    assert functions.namespaced and functions.short_names == ["fn"]

    # what the real server refuses
    def refused(change: Any) -> str:
        body = copy.deepcopy(CRD)
        body["metadata"]["name"] = f"things.{GROUP}"
        body["spec"]["names"] = {"kind": "Thing", "plural": "things"}
        change(body["spec"])
        code, out, _ = call(
            api, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", body
        )
        assert code == 422 and out["reason"] == "Invalid", out
        return out["message"]

    version = "spec.versions[0]"
    schema = f"{version}.schema.openAPIV3Schema"

    def second_storage(spec: dict) -> None:
        spec["versions"].append(dict(spec["versions"][0], name="v1beta1"))

    assert "must have exactly one version marked as storage version" in refused(second_storage)

    def untyped(spec: dict) -> None:
        del spec["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["type"]

    assert f"{schema}.properties[spec].type: Required value" in refused(untyped)

    def both(spec: dict) -> None:
        props = spec["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
        props["spec"]["additionalProperties"] = {"type": "string"}

    assert f"{schema}.properties[spec].additionalProperties: Forbidden" in refused(both)

    def no_items(spec: dict) -> None:
        props = spec["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
        del props["status"]["properties"]["conditions"]["items"]

    assert ".properties[conditions].items: Required value" in refused(no_items)
    assert 'spec.scope: Unsupported value: "Global"' in refused(
        lambda spec: spec.update(scope="Global")
    )
    assert "spec.names.shortNames[0]" in refused(
        lambda spec: spec["names"].update(shortNames=["Bad_Name"])
    )
    message = refused(lambda spec: spec.update(group="other.dev"))
    assert 'metadata.name: Invalid value: "things.gitops-sless.dev"' in message
    # the strict schema, as for built-in kinds (the typed client would not send it)
    assert "bogus" in refused(lambda spec: spec.update(bogus=True))


def test_custom_objects_crud_validation_and_pruning(
    api: client.ApiClient,
    crd: dict[str, Any],
    fake_kube: FakeKube,  # noqa: F811
) -> None:
    custom = client.CustomObjectsApi(api)
    fake_kube.reset_counts()
    first = function("one", replicas=1)
    first["metadata"]["labels"] = {"tier": "web"}
    created = custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, first)
    assert created["metadata"]["generation"] == 1 and created["metadata"]["uid"]
    assert created["apiVersion"] == f"{GROUP}/{VERSION}" and created["kind"] == "Function"
    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, function("two", "nodejs20"))
    got = custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "one")
    assert got["spec"] == {"runtime": "python3.11", "replicas": 1}
    listing = custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)
    assert listing["kind"] == "FunctionList" and listing["apiVersion"] == f"{GROUP}/{VERSION}"
    assert [(i["kind"], i["metadata"]["name"]) for i in listing["items"]] == [
        ("Function", "one"),
        ("Function", "two"),
    ]
    selected = custom.list_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, label_selector="tier=web"
    )
    assert [i["metadata"]["name"] for i in selected["items"]] == ["one"]
    everywhere = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    assert len(everywhere["items"]) == 2
    counts = fake_kube.counts()
    assert counts["requests"][("create", "Function")] == 2
    assert counts["writes"] == {("create", "Function"): 2}
    assert fake_kube.get("Function", NS, "one")["spec"]["replicas"] == 1

    # schema violations are 422 Invalid naming the field, like the real server
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, function("x", replicas="two")
        )
    assert err.value.status == 422
    assert status_of(err)["message"] == (
        'Function.gitops-sless.dev "x" is invalid: spec.replicas: Invalid value: "string": '
        'spec.replicas in body must be of type integer: "string"'
    )
    assert status_of(err)["details"]["causes"][0]["field"] == "spec.replicas"
    cases = [
        (function("x", "ruby"), 'spec.runtime: Unsupported value: "ruby": supported values: '),
        (function("x", replicas=-1), "spec.replicas in body should be greater than or equal to 0"),
        (
            function("x", entrypoint="m" * 21),
            "spec.entrypoint: Too long: may not be longer than 20",
        ),
        (dict(function("x"), spec={}), "spec.runtime: Required value"),
        (dict(function("x"), metadata={"name": "Not_Valid"}), "metadata.name: Invalid value"),
    ]
    for body, text in cases:
        with pytest.raises(ApiException) as err:
            custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
        assert err.value.status == 422 and text in status_of(err)["message"], body

    # unknown fields are pruned (with a warning) unless preserved; Strict refuses them
    body = function("pruned", bogus=True, event={"free": {"form": 1}})
    body["extra"] = 1
    code, out, headers = call(api, "POST", f"{BASE}/namespaces/{NS}/{PLURAL}", body)
    assert code == 201 and "extra" not in out
    assert out["spec"] == {"runtime": "python3.11", "event": {"free": {"form": 1}}}
    assert 'unknown field \\"spec.bogus\\"' in headers["Warning"]
    query = [("fieldValidation", "Strict")]
    code, out, _ = call(
        api, "POST", f"{BASE}/namespaces/{NS}/{PLURAL}", function("s", bogus=1), query
    )
    assert code == 400 and 'strict decoding error: unknown field "spec.bogus"' in out["message"]

    # update with resourceVersion conflicts, merge patch, delete
    stale = copy.deepcopy(got)
    got["spec"]["replicas"] = 3
    replaced = custom.replace_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "one", got)
    assert replaced["metadata"]["generation"] == 2
    with pytest.raises(ApiException) as err:
        custom.replace_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "one", stale)
    assert err.value.status == 409 and status_of(err)["reason"] == "Conflict"
    assert status_of(err)["message"].startswith(
        'Operation cannot be fulfilled on functions.gitops-sless.dev "one"'
    )
    patched = custom.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "one", {"spec": {"replicas": 0}}
    )
    assert patched["spec"]["replicas"] == 0 and patched["metadata"]["generation"] == 3
    with pytest.raises(ApiException) as err:
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, "one", {"spec": {"replicas": "x"}}
        )
    assert err.value.status == 422
    # no strategic merge patch for custom resources; injected failures work as for others
    code, out, _ = call(
        api,
        "PATCH",
        f"{BASE}/namespaces/{NS}/{PLURAL}/one",
        {"spec": {"replicas": 1}},
        ctype="application/strategic-merge-patch+json",
    )
    assert code == 415 and out["reason"] == "UnsupportedMediaType"
    fake_kube.inject("get", "Function", 500)
    with pytest.raises(ApiException) as err:
        custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "one")
    assert err.value.status == 500
    gone = custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "two")
    assert gone["status"] == "Success" and gone["details"]["kind"] == PLURAL
    with pytest.raises(ApiException) as err:
        custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "two")
    assert err.value.status == 404
    assert status_of(err)["message"] == 'functions.gitops-sless.dev "two" not found'
    with pytest.raises(ApiException) as err:
        custom.create_namespaced_custom_object(GROUP, VERSION, "nowhere", PLURAL, function("n"))
    assert err.value.status == 404


def test_status_subresource_generation_and_apply(
    api: client.ApiClient,
    crd: dict[str, Any],
    fake_kube: FakeKube,  # noqa: F811
) -> None:
    custom = client.CustomObjectsApi(api)
    path = f"{BASE}/namespaces/{NS}/{PLURAL}/fn"
    body = dict(function("fn", replicas=1), status={"phase": "Ready"})
    code, created = apply(api, path, body, "reconciler")
    assert code == 201 and "status" not in created  # create drops status
    assert created["metadata"]["generation"] == 1
    rv = created["metadata"]["resourceVersion"]
    code, again = apply(api, path, body, "reconciler")
    assert code == 200 and again["metadata"]["resourceVersion"] == rv  # a no-op re-apply

    # a write of the main resource ignores status
    fake_kube.reset_counts()
    kept = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, NS, PLURAL, "fn", {"status": {"phase": "Building"}}
    )
    assert kept["status"] == {"phase": "Building"} and kept["metadata"]["generation"] == 1
    patched = custom.patch_namespaced_custom_object(
        GROUP,
        VERSION,
        NS,
        PLURAL,
        "fn",
        {"status": {"phase": "Hacked"}, "metadata": {"labels": {"a": "b"}}},
    )
    assert patched["status"] == {"phase": "Building"} and patched["metadata"]["generation"] == 1
    counts = fake_kube.counts()
    assert counts["writes"] == {("patch", "Function/status"): 1, ("patch", "Function"): 1}
    assert custom.get_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, "fn")[
        "status"
    ] == {"phase": "Building"}

    # generation follows spec changes only
    code, changed = apply(api, path, function("fn", replicas=2), "reconciler")
    assert changed["metadata"]["generation"] == 2 and changed["status"] == {"phase": "Building"}

    # status: PUT and server-side apply with a field manager; the schema holds there too
    current = custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "fn")
    current["status"] = {"phase": "Ready", "conditions": [{"type": "Ready", "status": "True"}]}
    current["spec"]["replicas"] = 9  # ignored by /status
    put = custom.replace_namespaced_custom_object_status(GROUP, VERSION, NS, PLURAL, "fn", current)
    assert put["spec"]["replicas"] == 2 and put["status"]["phase"] == "Ready"
    assert put["metadata"]["generation"] == 2
    status_apply = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Function",
        "metadata": {"name": "fn"},
        "status": {"phase": "Failed"},
    }

    def apply_status(force: bool = False) -> dict[str, Any]:
        return custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            NS,
            PLURAL,
            "fn",
            status_apply,
            field_manager="status-writer",
            force=force,
            _content_type=APPLY,
        )

    # the PUT's manager (the client's user agent) owns status.phase now
    with pytest.raises(ApiException) as err:
        apply_status()
    assert err.value.status == 409 and ".status.phase" in status_of(err)["message"]
    assert '"OpenAPI-Generator"' in status_of(err)["message"]
    applied = apply_status(force=True)
    assert applied["status"]["phase"] == "Failed" and applied["status"]["conditions"]
    assert applied["metadata"]["generation"] == 2
    entries = {(m["manager"], m.get("subresource")) for m in applied["metadata"]["managedFields"]}
    assert ("status-writer", "status") in entries and ("reconciler", None) in entries
    again = apply_status()
    assert again["metadata"]["resourceVersion"] == applied["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as err:
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, NS, PLURAL, "fn", {"status": {"conditions": [{"type": "Ready"}]}}
        )
    assert err.value.status == 422
    assert "status.conditions[0].status: Required value" in status_of(err)["message"]

    # server-side apply conflicts between managers, and force
    code, conflict = apply(api, path, function("fn", replicas=5), "kubectl")
    assert code == 409 and conflict["reason"] == "Conflict"
    assert '"reconciler"' in conflict["message"] and ".spec.replicas" in conflict["message"]
    code, forced = apply(api, path, function("fn", replicas=5), "kubectl", force=True)
    assert code == 200 and forced["spec"]["replicas"] == 5 and forced["metadata"]["generation"] == 3


def test_watch_custom_objects_and_crd_deletion(
    api: client.ApiClient,
    crd: dict[str, Any],
    fake_kube: FakeKube,  # noqa: F811
) -> None:
    custom = client.CustomObjectsApi(api)
    seen: list[tuple[str, str]] = []
    started = threading.Event()

    def watching() -> None:
        stream = watch.Watch().stream(
            custom.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, timeout_seconds=3
        )
        started.set()
        for event in stream:
            seen.append((event["type"], event["object"]["metadata"]["name"]))
            if event["type"] == "DELETED":
                break

    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, function("early"))
    thread = threading.Thread(target=watching, daemon=True)
    thread.start()
    started.wait(2)
    wait_for(lambda: seen)  # the initial ADDED of "early"
    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, function("w"))
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, "w", {"spec": {"replicas": 2}}
    )
    custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "w")
    thread.join(5)
    assert seen == [("ADDED", "early"), ("ADDED", "w"), ("MODIFIED", "w"), ("DELETED", "w")]

    # a raw watch from resourceVersion 0 starts with the objects there are
    code, text, _ = call(
        api,
        "GET",
        f"{BASE}/namespaces/{NS}/{PLURAL}",
        query=[("watch", "true"), ("timeoutSeconds", "1")],
    )
    events = [
        json.loads(line)
        for line in (text if isinstance(text, str) else json.dumps(text)).splitlines()
    ]
    assert code == 200 and [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "early")
    ]

    # deleting the CRD takes its objects (and its REST paths) with it; watches end
    last: list[tuple[str, str]] = []

    def watch_to_the_end() -> None:
        stream = watch.Watch().stream(
            custom.list_cluster_custom_object, GROUP, VERSION, PLURAL, timeout_seconds=30
        )
        last.extend((e["type"], e["object"]["metadata"]["name"]) for e in stream)

    thread = threading.Thread(target=watch_to_the_end, daemon=True)
    thread.start()
    wait_for(lambda: last)
    gone = client.ApiextensionsV1Api(api).delete_custom_resource_definition(f"{PLURAL}.{GROUP}")
    assert gone["status"] == "Success"
    thread.join(5)
    assert not thread.is_alive() and last == [("ADDED", "early"), ("DELETED", "early")]
    assert fake_kube.objects("Function") == []
    code, _, _ = call(api, "GET", f"{BASE}/namespaces/{NS}/{PLURAL}")
    assert code == 404
    code, groups, _ = call(api, "GET", "/apis")
    assert GROUP not in {g["name"] for g in groups["groups"]}
    # created again, it serves an empty kind
    client.ApiextensionsV1Api(api).create_custom_resource_definition(copy.deepcopy(CRD))
    assert custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"] == []


def test_cluster_scoped_versions_and_namespace_deletion(
    api: client.ApiClient,
    fake_kube: FakeKube,  # noqa: F811
) -> None:
    custom = client.CustomObjectsApi(api)
    body = copy.deepcopy(CRD)
    v1 = copy.deepcopy(body["spec"]["versions"][0])
    body["spec"]["versions"][0]["storage"] = False
    body["spec"]["versions"].append(dict(v1, name="v1"))
    client.ApiextensionsV1Api(api).create_custom_resource_definition(body)
    code, group, _ = call(api, "GET", f"/apis/{GROUP}")
    assert [v["version"] for v in group["versions"]] == ["v1", VERSION]
    # written as one version, read as another (conversion None: only apiVersion differs)
    custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, function("old"))
    read = custom.get_namespaced_custom_object(GROUP, "v1", NS, PLURAL, "old")
    assert read["apiVersion"] == f"{GROUP}/v1"
    assert fake_kube.get("Function", NS, "old")["apiVersion"] == f"{GROUP}/v1"  # storage

    # a namespace's deletion takes its custom objects
    client.CoreV1Api(api).create_namespace(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}}
    )
    custom.create_namespaced_custom_object(GROUP, VERSION, "team", PLURAL, function("t"))
    client.CoreV1Api(api).delete_namespace("team")
    assert fake_kube.objects("Function", "team") == []

    # a cluster-scoped kind
    cluster = copy.deepcopy(CRD)
    cluster["metadata"]["name"] = f"runtimes.{GROUP}"
    cluster["spec"].update(
        scope="Cluster", names={"kind": "Runtime", "plural": "runtimes", "shortNames": ["rt"]}
    )
    fake_kube.install_crd(cluster)
    runtime = dict(function("py"), kind="Runtime")
    created = custom.create_cluster_custom_object(GROUP, VERSION, "runtimes", runtime)
    assert "namespace" not in created["metadata"]
    assert custom.get_cluster_custom_object(GROUP, VERSION, "runtimes", "py")["spec"]["runtime"]
    # a kind already served is not accepted
    clash = copy.deepcopy(cluster)
    clash["metadata"]["name"] = f"deployments.{GROUP}"
    clash["spec"]["names"] = {"kind": "Deployment", "plural": "deployments"}
    out = fake_kube.install_crd(clash)
    conds = {c["type"]: (c["status"], c["reason"]) for c in out["status"]["conditions"]}
    assert conds["NamesAccepted"] == ("False", "KindConflict")
    code, body, _ = call(api, "GET", f"{BASE}/deployments")
    assert code == 404


def test_the_projects_function_crd_is_accepted(fake_kube: FakeKube) -> None:  # noqa: F811
    path = ROOT / "deploy" / "crd-functions.yaml"
    crd = fake_kube.install_crd(path)
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]} == {
        "NamesAccepted": "True",
        "Established": "True",
    }
    # the same over HTTP (for a fake run as its own process): a no-op re-apply
    request = urllib.request.Request(
        f"{fake_kube.url}/_test/crd",
        json.dumps(yaml.safe_load(path.read_text())).encode(),
        method="POST",
    )
    with urllib.request.urlopen(request) as answer:
        again = json.loads(answer.read())
    assert again["metadata"]["resourceVersion"] == crd["metadata"]["resourceVersion"]
    assert fake_kube.store.kinds.custom["Function"].status


def test_lease_optimistic_concurrency(api: client.ApiClient) -> None:
    coordination = client.CoordinationV1Api(api)
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "leader"},
        "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15},
    }
    created = coordination.create_namespaced_lease(NS, lease)
    with pytest.raises(ApiException) as err:
        coordination.create_namespaced_lease(NS, lease)
    assert err.value.status == 409 and status_of(err)["reason"] == "AlreadyExists"
    assert status_of(err)["message"] == 'leases.coordination.k8s.io "leader" already exists'
    # two candidates read the same version; the first renewal wins, the second is refused
    first = coordination.read_namespaced_lease("leader", NS)
    second = coordination.read_namespaced_lease("leader", NS)
    first.spec.holder_identity = "a"
    first.spec.renew_time = "2024-01-01T00:00:00.000000Z"
    renewed = coordination.replace_namespaced_lease("leader", NS, first)
    assert renewed.metadata.resource_version != created.metadata.resource_version
    second.spec.holder_identity = "b"
    with pytest.raises(ApiException) as err:
        coordination.replace_namespaced_lease("leader", NS, second)
    assert err.value.status == 409 and status_of(err)["reason"] == "Conflict"
    assert coordination.read_namespaced_lease("leader", NS).spec.holder_identity == "a"
    # with the current version the takeover goes through
    current = coordination.read_namespaced_lease("leader", NS)
    current.spec.holder_identity = "b"
    assert coordination.replace_namespaced_lease("leader", NS, current).spec.holder_identity == "b"
