"""The fake Kubernetes API server (tests/kubeapi), driven through the official client."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, dynamic, watch
from kubernetes.client.rest import ApiException

from tests.kubeapi import FakeKube
from tests.kubeapi.fixtures import fake_kube  # noqa: F401  (the fixture)
from tests.s3server import s3_server  # noqa: F401  (the fixture: a real S3, SeaweedFS)

from ..paths import ROOT

NS = "default"
IMAGE = "registry.local/app:v1"


@pytest.fixture
def api(fake_kube: FakeKube) -> Iterator[client.ApiClient]:  # noqa: F811
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(fake_kube.kubeconfig), client_configuration=cfg)
    with client.ApiClient(cfg) as api_client:
        yield api_client


def call(
    api: client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    query: Any = (),
    ctype: str = "application/json",
) -> tuple[int, Any, Any]:
    """A raw request through ``ApiClient.call_api``: (status, decoded body, headers)."""
    headers = {"Accept": "application/json", "Content-Type": ctype}
    request = api.param_serialize(
        method,
        path,
        query_params=list(query),
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    resp = api.call_api(*request)
    resp.read()
    try:
        data = json.loads(resp.data)
    except ValueError:
        data = resp.data.decode()
    return resp.status, data, resp.headers


def apply(
    api: client.ApiClient, path: str, body: dict, manager: str, force: bool = False
) -> tuple[int, Any]:
    query = [("fieldManager", manager)] + ([("force", "true")] if force else [])
    status, data, _ = call(api, "PATCH", path, body, query, "application/apply-patch+yaml")
    return status, data


def wait_for(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > end:
            assert value, "timed out waiting"
            return value
        time.sleep(0.02)


def deployment(name: str, image: str = IMAGE, replicas: int = 1, **container: Any) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "app", "image": image, **container}]},
            },
        },
    }


def job(name: str, image: str = IMAGE, **extra: Any) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            **extra,
            "template": {
                "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": image}]}
            },
        },
    }


def waiting(core: client.CoreV1Api, label: str) -> Any:
    pods = core.list_namespaced_pod(NS, label_selector=label).items
    states = [s.state.waiting for p in pods for s in p.status.container_statuses or ()]
    return states[0] if states and states[0] else None


def test_create_get_list_selectors_and_errors(api: client.ApiClient, fake_kube: FakeKube) -> None:  # noqa: F811
    core = client.CoreV1Api(api)
    for name, labels in [("a", {"tier": "web", "env": "prod"}), ("b", {"tier": "db"}), ("c", {})]:
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "labels": labels},
            "data": {"k": name},
        }
        created = core.create_namespaced_config_map(NS, body)
        assert created.metadata.uid and created.metadata.resource_version
        assert created.metadata.creation_timestamp is not None
    assert core.read_namespaced_config_map("b", NS).data == {"k": "b"}

    def names(**kw: str) -> list[str]:
        return [c.metadata.name for c in core.list_namespaced_config_map(NS, **kw).items]

    assert names(label_selector="tier=web") == ["a"]
    assert names(label_selector="tier==db") == ["b"]
    assert names(label_selector="tier!=web") == ["b", "c"]
    assert names(label_selector="tier in (web, db)") == ["a", "b"]
    assert names(label_selector="tier notin (web)") == ["b", "c"]
    assert names(label_selector="tier") == ["a", "b"]
    assert names(label_selector="!tier") == ["c"]
    assert names(label_selector="tier,env=prod") == ["a"]
    assert names(field_selector="metadata.name=c") == ["c"]
    listing = core.list_namespaced_config_map(NS)
    assert listing.kind == "ConfigMapList" and int(listing.metadata.resource_version) > 0

    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(
            NS, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a"}}
        )
    assert err.value.status == 409 and json.loads(err.value.body)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as err:
        core.read_namespaced_config_map("nope", NS)
    status = json.loads(err.value.body)
    assert (status["kind"], status["reason"], status["code"]) == ("Status", "NotFound", 404)
    assert status["message"] == 'configmaps "nope" not found'
    with pytest.raises(ApiException) as err:
        core.create_namespaced_secret(
            "missing-ns", {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}
        )
    assert (
        err.value.status == 404
        and json.loads(err.value.body)["message"] == 'namespaces "missing-ns" not found'
    )

    # strict schema: an unknown field is 422 Invalid (the typed client would refuse to send it)
    bad = deployment("bad")
    bad["spec"]["bogus"] = True
    code, body, _ = call(api, "POST", f"/apis/apps/v1/namespaces/{NS}/deployments", bad)
    assert code == 422 and body["reason"] == "Invalid" and "bogus" in body["message"]
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(
            NS, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "Bad_Name"}}
        )
    assert err.value.status == 422 and "RFC 1123" in json.loads(err.value.body)["message"]

    # no token, unknown path
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(f"{fake_kube.url}/api/v1/namespaces")
    assert http_err.value.code == 401
    http_err.value.close()
    code, body, _ = call(api, "GET", "/apis/nothing/v1/things")
    assert code == 404 and body["kind"] == "Status"


def test_server_side_apply(api: client.ApiClient) -> None:
    apps = client.AppsV1Api(api)
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/web"
    config_a = deployment("web", replicas=2)
    code, created = apply(api, path, config_a, "deployer")
    assert code == 201
    assert [(m["manager"], m["operation"]) for m in created["metadata"]["managedFields"]] == [
        ("deployer", "Apply")
    ]
    live = apps.read_namespaced_deployment("web", NS)
    code, again = apply(api, path, config_a, "deployer")
    assert code == 200 and again["metadata"]["resourceVersion"] == live.metadata.resource_version
    assert again["metadata"]["generation"] == 1

    # another manager changing a field the first one owns: conflict, unless forced
    scaler = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {"replicas": 3},
    }
    code, body = apply(api, path, scaler, "scaler")
    assert code == 409 and body["reason"] == "Conflict"
    assert (
        body["message"]
        == 'Apply failed with 1 conflict: conflict with "deployer" using apps/v1: .spec.replicas'
    )
    code, body = apply(api, path, scaler, "scaler", force=True)
    assert code == 200 and body["spec"]["replicas"] == 3 and body["metadata"]["generation"] == 2
    # the deployer no longer owns replicas: applying without it keeps the scaler's value
    config_b = deployment("web", replicas=2)
    del config_b["spec"]["replicas"]
    config_b["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "A", "value": "1"}]
    code, body = apply(api, path, config_b, "deployer")
    assert code == 200 and body["spec"]["replicas"] == 3
    # fields a manager stops applying are removed
    code, body = apply(
        api, path, deployment("web", replicas=3) | {"metadata": {"name": "web"}}, "deployer"
    )
    assert code == 200, body["message"]
    assert "env" not in body["spec"]["template"]["spec"]["containers"][0]
    assert body["metadata"].get("labels", {}) == {}
    # a label change is not a spec change: no generation bump, but a new resourceVersion
    before = apps.read_namespaced_deployment("web", NS)
    patched = apps.patch_namespaced_deployment("web", NS, {"metadata": {"labels": {"x": "y"}}})
    assert patched.metadata.generation == before.metadata.generation
    assert int(patched.metadata.resource_version) > int(before.metadata.resource_version)
    managers = {(m.manager, m.operation) for m in patched.metadata.managed_fields}
    assert ("OpenAPI-Generator", "Update") in managers
    code, body = apply(api, path, scaler, "")
    assert code == 400


def test_deployment_becomes_available_and_proxy(api: client.ApiClient, fake_kube: FakeKube) -> None:  # noqa: F811
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    fake_kube.preloaded_images.add(IMAGE)
    apps.create_namespaced_deployment(NS, deployment("web", replicas=2))
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {
            "selector": {"app": "web"},
            "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
        },
    }
    core.create_namespaced_service(NS, service)

    def available() -> Any:
        dep = apps.read_namespaced_deployment("web", NS)
        conds = {c.type: (c.status, c.reason) for c in dep.status.conditions or ()}
        return dep if conds.get("Available") == ("True", "MinimumReplicasAvailable") else None

    dep = wait_for(available)
    assert (
        dep.status.ready_replicas,
        dep.status.updated_replicas,
        dep.status.observed_generation,
    ) == (2, 2, 1)
    pods = core.list_namespaced_pod(NS, label_selector="app=web").items
    assert len(pods) == 2 and all(p.status.phase == "Running" for p in pods)
    assert all(p.metadata.owner_references[0].kind == "Deployment" for p in pods)

    code, echo, _ = call(
        api,
        "POST",
        f"/api/v1/namespaces/{NS}/services/web:http/proxy/hello/x",
        {"a": 1},
        [("q", "1")],
    )
    assert code == 200
    assert (echo["service"], echo["method"], echo["path"], echo["query"]) == (
        "web",
        "POST",
        "/hello/x",
        "q=1",
    )
    assert json.loads(echo["body"]) == {"a": 1}
    apps.patch_namespaced_deployment("web", NS, {"spec": {"replicas": 0}})
    wait_for(lambda: not core.list_namespaced_pod(NS, label_selector="app=web").items)
    code, body, _ = call(api, "GET", f"/api/v1/namespaces/{NS}/services/web/proxy/")
    assert code == 503 and body["reason"] == "ServiceUnavailable"
    assert fake_kube.counts()["requests"][("proxy", "Service")] == 2


def test_pods_that_cannot_start(api: client.ApiClient, fake_kube: FakeKube) -> None:  # noqa: F811
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_deployment(NS, deployment("nopull", image="registry.local/never:1"))
    state = wait_for(lambda: waiting(core, "app=nopull"))
    assert (state.reason, state.message) == (
        "ErrImagePull",
        'failed to pull image "registry.local/never:1": not found',
    )

    fake_kube.preloaded_images.add(IMAGE)
    env = [
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "notes-db", "key": "password"}}}
    ]
    apps.create_namespaced_deployment(NS, deployment("notes", env=env))
    state = wait_for(lambda: waiting(core, "app=notes"))
    assert (state.reason, state.message) == (
        "CreateContainerConfigError",
        'secret "notes-db" not found',
    )
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "notes-db"},
        "stringData": {"user": "u"},
    }
    core.create_namespaced_secret(NS, secret)
    state = wait_for(lambda: waiting(core, "app=notes"))
    assert state.message == "couldn't find key password in Secret default/notes-db"
    core.patch_namespaced_secret("notes-db", NS, {"stringData": {"password": "pw"}})
    wait_for(
        lambda: (apps.read_namespaced_deployment("notes", NS).status.available_replicas or 0) == 1
    )

    fake_kube.crash_loop(NS, "notes", reason="Error", exit_code=3)
    pod = core.list_namespaced_pod(NS, label_selector="app=notes").items[0]
    status = pod.status.container_statuses[0]
    assert status.state.waiting.reason == "CrashLoopBackOff" and status.restart_count > 0
    assert status.last_state.terminated.exit_code == 3


def test_progress_deadline(api: client.ApiClient, fake_kube: FakeKube) -> None:  # noqa: F811
    apps = client.AppsV1Api(api)
    fake_kube.preloaded_images.add(IMAGE)
    fake_kube.stall(NS, "slow")
    body = deployment("slow")
    body["spec"]["progressDeadlineSeconds"] = 1
    apps.create_namespaced_deployment(NS, body)

    def reason() -> str | None:
        conds = apps.read_namespaced_deployment("slow", NS).status.conditions or ()
        prog = [c for c in conds if c.type == "Progressing"]
        return prog[0].reason if prog and prog[0].status == "False" else None

    assert wait_for(reason, timeout=4) == "ProgressDeadlineExceeded"


def test_jobs_logs_and_cronjobs(api: client.ApiClient, fake_kube: FakeKube) -> None:  # noqa: F811
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    fake_kube.preloaded_images.add(IMAGE)
    fake_kube.set_job_log(NS, "task", '{"answer": 42}\n')
    fake_kube.set_job_log(NS, "broken", "boom\n", succeed=False)
    batch.create_namespaced_job(NS, job("task"))
    batch.create_namespaced_job(NS, job("broken"))
    done = wait_for(lambda: (j := batch.read_namespaced_job("task", NS)).status.succeeded and j)
    assert [c.type for c in done.status.conditions] == ["Complete"] and done.status.completion_time
    pod = core.list_namespaced_pod(NS, label_selector="job-name=task").items[0]
    assert pod.status.phase == "Succeeded"
    assert pod.status.container_statuses[0].state.terminated.reason == "Completed"
    assert core.read_namespaced_pod_log(pod.metadata.name, NS) == '{"answer": 42}\n'
    failed = wait_for(lambda: (j := batch.read_namespaced_job("broken", NS)).status.failed and j)
    assert [(c.type, c.reason) for c in failed.status.conditions] == [
        ("Failed", "BackoffLimitExceeded")
    ]

    # deleting a Job keeps its pods by default (as batch/v1 does), Background removes them
    batch.delete_namespaced_job("task", NS)
    assert core.list_namespaced_pod(NS, label_selector="job-name=task").items
    batch.delete_namespaced_job("broken", NS, propagation_policy="Background")
    assert not core.list_namespaced_pod(NS, label_selector="job-name=broken").items

    cron = {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": "nightly"},
        "spec": {
            "schedule": "0 3 * * *",
            "jobTemplate": {
                "metadata": {"labels": {"fn": "nightly"}},
                "spec": job("x", ttlSecondsAfterFinished=1)["spec"],
            },
        },
    }
    batch.create_namespaced_cron_job(NS, cron)
    fired = fake_kube.fire_cronjob(NS, "nightly")
    assert fired["metadata"]["name"].startswith("nightly-")
    assert fired["metadata"]["ownerReferences"][0]["kind"] == "CronJob"
    listed = batch.list_namespaced_job(NS, label_selector="fn=nightly").items
    assert [j.metadata.name for j in listed] == [fired["metadata"]["name"]]
    wait_for(
        lambda: not batch.list_namespaced_job(NS, label_selector="fn=nightly").items, timeout=4
    )


def test_updates_patches_deletes(api: client.ApiClient, fake_kube: FakeKube) -> None:  # noqa: F811
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    fake_kube.preloaded_images.add(IMAGE)
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}})
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"generateName": "cfg-"},
        "data": {"a": "1"},
    }
    created = core.create_namespaced_config_map("team", cm)
    name = created.metadata.name
    assert name.startswith("cfg-") and len(name) == len("cfg-") + 5

    # PUT with the current resourceVersion works once; the stale one is a 409 Conflict
    body = created.to_dict()
    body["data"] = {"a": "2"}
    replaced = core.replace_namespaced_config_map(name, "team", body)
    assert replaced.data == {"a": "2"}
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_config_map(name, "team", body)
    assert (
        err.value.status == 409
        and "the object has been modified" in json.loads(err.value.body)["message"]
    )
    unchanged = core.replace_namespaced_config_map(name, "team", replaced.to_dict())
    assert unchanged.metadata.resource_version == replaced.metadata.resource_version

    path = f"/api/v1/namespaces/team/configmaps/{name}"
    ops = [{"op": "add", "path": "/data/b", "value": "3"}, {"op": "remove", "path": "/data/a"}]
    code, patched, _ = call(api, "PATCH", path, ops, ctype="application/json-patch+json")
    assert code == 200 and patched["data"] == {"b": "3"}
    code, patched, _ = call(
        api, "PATCH", path, {"data": {"b": None, "c": "4"}}, ctype="application/merge-patch+json"
    )
    assert code == 200 and patched["data"] == {"c": "4"}

    # the status subresource of a Deployment, and cascading deletes
    apps.create_namespaced_deployment("team", deployment("web", replicas=2))
    status = apps.read_namespaced_deployment_status("web", "team")
    assert status.status.observed_generation == 1
    assert len(core.list_namespaced_pod("team").items) == 2
    code, body, _ = call(api, "DELETE", "/apis/apps/v1/namespaces/team/deployments/web")
    assert code == 200 and (body["kind"], body["status"]) == ("Status", "Success")
    assert not core.list_namespaced_pod("team").items
    apps.create_namespaced_deployment("team", deployment("api"))
    assert len(fake_kube.objects("Pod", "team")) == 1
    core.delete_namespace("team")
    with pytest.raises(ApiException) as err:
        core.read_namespace("team")
    assert err.value.status == 404
    assert not fake_kube.objects("Pod", "team") and not fake_kube.objects("Deployment", "team")
    assert not fake_kube.objects("ConfigMap", "team")


def test_counts_inject_watch_and_discovery(api: client.ApiClient, fake_kube: FakeKube) -> None:  # noqa: F811
    core = client.CoreV1Api(api)
    fake_kube.reset_counts()
    # urllib3 under the client retries a 429 that has Retry-After (3 times by default) ...
    fake_kube.inject("list", "Secret", 429, retry_after=0)
    assert core.list_namespaced_secret(NS).kind == "SecretList"
    # ... and the client sees it when retries are off
    api.configuration.retries = False
    api.rest_client = client.rest.RESTClientObject(api.configuration)
    fake_kube.inject("list", "Secret", 429, retry_after=2)
    with pytest.raises(ApiException) as err:
        core.list_namespaced_secret(NS)
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "2"
    assert json.loads(err.value.body)["reason"] == "TooManyRequests"
    fake_kube.inject("create", "Secret", 500)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}
    with pytest.raises(ApiException) as err:
        core.create_namespaced_secret(NS, secret)
    assert err.value.status == 500 and json.loads(err.value.body)["reason"] == "InternalError"
    core.create_namespaced_secret(NS, secret)
    counts = fake_kube.counts()
    assert counts["requests"] == {("list", "Secret"): 3, ("create", "Secret"): 2}
    assert counts["writes"] == {("create", "Secret"): 1}

    # retries on again, as the client runs: a pooled connection the server closed after
    # the watch is retried, not a RemoteDisconnected (a clean-clone run saw one)
    api.configuration.retries = None
    api.rest_client = client.rest.RESTClientObject(api.configuration)
    stream = watch.Watch().stream(core.list_namespaced_secret, NS, timeout_seconds=1)
    events = [(e["type"], e["object"].metadata.name) for e in stream]
    assert ("ADDED", "s") in events

    dyn = dynamic.DynamicClient(api)
    deployments = dyn.resources.get(api_version="apps/v1", kind="Deployment")
    assert deployments.namespaced and dyn.resources.get(api_version="batch/v1", kind="CronJob")
    assert client.VersionApi(api).get_code().minor == "30"


def _tarball(files: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue())


@pytest.fixture
def s3(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, dict[str, str]]]:
    """(endpoint, boto3 client, keys) of a real S3: the team's SeaweedFS (weed must be
    installed: a missing part fails the test, it never quietly swaps in a double)."""
    server = request.getfixturevalue("s3_server")
    yield (
        server.endpoint,
        server.client(),
        {"id": server.access_key, "secret": server.secret_key},
    )


def test_kaniko_build_reads_s3(api: client.ApiClient, fake_kube: FakeKube, s3: Any) -> None:  # noqa: F811
    endpoint, s3_client, keys = s3
    bucket = f"ctx-{time.monotonic_ns()}"
    s3_client.create_bucket(Bucket=bucket)
    good = _tarball({"Dockerfile": b"FROM python:3.12\n", "app.py": b""})
    s3_client.put_object(Bucket=bucket, Key="good.tar.gz", Body=good)
    s3_client.put_object(Bucket=bucket, Key="nodockerfile.tar.gz", Body=_tarball({"app.py": b""}))
    _run_builds(api, fake_kube, endpoint, bucket, keys)


def _run_builds(
    api: client.ApiClient,
    fake_kube: FakeKube,  # noqa: F811
    endpoint: str,
    bucket: str,
    keys: dict[str, str],
) -> None:
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)

    def build(name: str, key: str, dest: str) -> None:
        env = [
            {"name": "S3_ENDPOINT", "value": endpoint},
            {"name": "AWS_REGION", "value": "us-east-1"},
            {"name": "S3_FORCE_PATH_STYLE", "value": "true"},
            {
                "name": "AWS_ACCESS_KEY_ID",
                "valueFrom": {"secretKeyRef": {"name": "s3", "key": "id"}},
            },
            {
                "name": "AWS_SECRET_ACCESS_KEY",
                "valueFrom": {"secretKeyRef": {"name": "s3", "key": "secret"}},
            },
        ]
        body = job(name, image="gcr.io/kaniko-project/executor:v1.23.0")
        container = body["spec"]["template"]["spec"]["containers"][0]
        container["args"] = [f"--context=s3://{bucket}/{key}", f"--destination={dest}"]
        container["env"] = env
        batch.create_namespaced_job(NS, body)

    def finished(name: str) -> Any:
        j = batch.read_namespaced_job(name, NS)
        return j if (j.status.succeeded or j.status.failed) else None

    def log(name: str) -> str:
        pod = core.list_namespaced_pod(NS, label_selector=f"job-name={name}").items[0]
        return core.read_namespaced_pod_log(pod.metadata.name, NS)

    build("b-nosecret", "good.tar.gz", "registry.local/app:ok")
    state = wait_for(lambda: waiting(core, "job-name=b-nosecret"))
    assert (state.reason, state.message) == ("CreateContainerConfigError", 'secret "s3" not found')
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s3"},
        "stringData": keys,
    }
    core.create_namespaced_secret(NS, secret)
    assert wait_for(lambda: finished("b-nosecret")).status.succeeded == 1
    assert log("b-nosecret").rstrip().endswith("INFO[0001] Pushed registry.local/app:ok")
    assert "registry.local/app:ok" in fake_kube.pushed_images
    assert fake_kube.build_contexts["good.tar.gz"] == ["Dockerfile", "app.py"]

    fake_kube.fail_build(":bad", "error building image: step 3 failed")
    for name, key, dest, expected in [
        (
            "b-missing",
            "absent.tar.gz",
            "registry.local/app:x",
            f"error resolving source context: NoSuchKey: s3://{bucket}/absent.tar.gz",
        ),
        (
            "b-nodf",
            "nodockerfile.tar.gz",
            "registry.local/app:y",
            "error: Dockerfile not found in build context",
        ),
        ("b-fail", "good.tar.gz", "registry.local/app:bad", "error building image: step 3 failed"),
    ]:
        build(name, key, dest)
        assert wait_for(lambda n=name: finished(n)).status.failed == 1
        assert expected in log(name)
    # pushed: the tag, and the image by the digest the tag names
    digest = fake_kube.registry_digest("registry.local/app:ok")
    assert fake_kube.pushed_images == {"registry.local/app:ok", f"registry.local/app@{digest}"}


def test_standalone_process(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.kubeapi", "--port", "0", "--kubeconfig", str(kubeconfig)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening http://127.0.0.1:")
        url = line.split()[1]
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
        with client.ApiClient(cfg) as api_client:
            client.CoreV1Api(api_client).create_namespace(
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bench"}}
            )
        counts = json.loads(urllib.request.urlopen(f"{url}/_test/counts").read())
        assert counts["writes"] == {"create Namespace": 1}
        objects = json.loads(urllib.request.urlopen(f"{url}/_test/objects?kind=Namespace").read())
        assert "bench" in [o["metadata"]["name"] for o in objects]
        request = urllib.request.Request(f"{url}/_test/reset", data=b"{}", method="POST")
        urllib.request.urlopen(request).read()
        assert json.loads(urllib.request.urlopen(f"{url}/_test/counts").read())["requests"] == {}
    finally:
        proc.terminate()
        assert proc.wait(timeout=5) == 0
        proc.stdout.close()
