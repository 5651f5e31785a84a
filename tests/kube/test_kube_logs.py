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
from .test_runtime_load import PROD, api, served, serving  # noqa: F401 (a fixture)

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
