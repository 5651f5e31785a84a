"""Per-request logs on Kubernetes (issue 31): the function's log is its pods' logs, each
line naming its pod (``[replica <pod>]``), and ``?request=`` / ``?trace=`` keep one
call's lines, as on the local backend. Against the test API server, whose kubelet runs
a real runtime server for each pod of the function (``FakeKube.run_runtime``) and keeps
what it prints as the container's log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gitops_sless.kube.client import KubeClient
from gitops_sless.web.logs import logs_router

from ..kubeapi import FakeKube
from ..s3server import S3Server
from .test_runtime_load import PROD, api, served, serving, wait_for  # noqa: F401 (a fixture)

TALK = (
    "def handler(event, context):\n"
    "    print('handling', event.get('word'))\n"
    "    return {'requestId': context.request_id, 'traceId': context.trace_id}\n"
)


@pytest.fixture
def harness(fake_kube: FakeKube, api: KubeClient, s3_server: S3Server, tmp_path: Path):  # noqa: F811
    with served(fake_kube, api, s3_server, tmp_path, "talk", TALK) as made:
        yield made


def call(api: KubeClient, pod: str, word: str) -> dict[str, Any]:  # noqa: F811
    path = f"/api/v1/namespaces/{PROD}/pods/{pod}:8080/proxy/"
    return json.loads(api.request("proxy", "Pod", "POST", path, body={"word": word}, attempts=1))


def test_the_logs_are_the_pods_and_one_requests_lines_read_alone(harness, fake_kube, api):  # noqa: F811
    first, second = sorted(serving(fake_kube, api))
    apple, pear = call(api, first, "apple"), call(api, second, "pear")

    text = harness.backend.function_log("prod", "talk")
    tag = f"[request_id={apple['requestId']} trace_id={apple['traceId']}]"
    assert f"[replica {first}] {tag} handling apple\n" in text
    assert f"[replica {second}] [request_id={pear['requestId']}" in text

    app = FastAPI()
    app.include_router(logs_router(harness.store, Path("/nonexistent"), harness.backend))
    client = TestClient(app)
    where = "/api/v1/environments/prod/functions/talk/logs"
    alone = client.get(where, params={"request": apple["requestId"]}).json()
    assert alone["text"] == f"[replica {first}] {tag} handling apple\n"
    by_trace = client.get(where, params={"trace": pear["traceId"]}).json()
    assert by_trace["text"].endswith("handling pear\n") and "apple" not in by_trace["text"]
    whole = client.get(where).json()["text"]
    assert "handling apple" in whole and "handling pear" in whole


def bare_pod(template: dict[str, Any], name: str, labels: dict[str, str], image: str) -> dict:
    """A pod with ``template``'s containers and ``labels`` besides its own, not owned."""
    containers = [{"name": c["name"], "image": image} for c in template["spec"]["containers"]]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": PROD, "labels": labels},
        "spec": {"containers": containers},
    }


def test_job_runs_are_not_the_functions_log_and_an_unreadable_pod_says_so(
    harness,
    fake_kube,
    api,  # noqa: F811
):
    first, _ = sorted(serving(fake_kube, api))
    template = api.get("Pod", PROD, first)
    labels = dict(template["metadata"]["labels"])
    image = template["spec"]["containers"][0]["image"]
    # a job run carries the function's labels (and the Job's): its output is the run's
    api.create(bare_pod(template, "talk-run-1", {**labels, "job-name": "talk-run-1"}, image))
    fake_kube.kubelet.logs[(PROD, "talk-run-1")] = "the run's own output\n"
    # a replica whose image cannot be pulled has no log yet
    api.create(bare_pod(template, "talk-stuck", labels, "registry.invalid/none:1"))
    call(api, first, "apple")

    def stuck_said() -> bool:
        return "[replica talk-stuck] [gitops-sless] its log cannot be read:" in (
            harness.backend.function_log("prod", "talk")
        )

    wait_for(stuck_said, "the stuck pod's line")
    text = harness.backend.function_log("prod", "talk")
    assert "handling apple" in text
    assert "the run's own output" not in text and "talk-run-1" not in text
    said = next(line for line in text.splitlines() if "talk-stuck" in line)
    assert "waiting to start" in said, said
