"""Which queue a server uses: SQLite by default on the local backend, none without
--queue nats:// on Kubernetes (a pod's disk is not durable), bad values refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gitops_sless.serve.config import ServeConfig
from gitops_sless.serve.queue import NO_QUEUE_ON_KUBERNETES, invocations, queue_refusal
from gitops_sless.state.routes import Declared, RouteTable


async def _no_call(_: object) -> object:
    raise AssertionError("nothing is called")


def test_the_local_backend_defaults_to_sqlite_in_the_state_folder(tmp_path: Path) -> None:
    config = ServeConfig(repo=".", state_dir=tmp_path)
    service = invocations(config, RouteTable(), _no_call)
    assert service.enabled and service.engine is not None
    assert service.engine.name == "sqlite"


def test_kubernetes_without_a_nats_queue_refuses_submissions_with_the_reason(
    tmp_path: Path,
) -> None:
    routes = RouteTable()
    routes.declare("prod", {"orders": Declared("Ready")})
    config = ServeConfig(repo=".", state_dir=tmp_path, backend="kubernetes")
    service = invocations(config, routes, _no_call)
    assert not service.enabled

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/async/prod/orders/",
        "raw_path": b"/async/prod/orders/",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 1),
    }
    asyncio.run(service.submitter(scope, receive, send))
    assert sent[0]["status"] == 503
    assert NO_QUEUE_ON_KUBERNETES.encode() in sent[1]["body"]
    assert b"--queue nats://" in sent[1]["body"]


def test_queue_values_that_cannot_work_are_refused() -> None:
    assert "pod's disk is not durable" in (queue_refusal("sqlite", "kubernetes") or "")
    assert queue_refusal("redis://x", "local") == (
        "--queue redis://x: expected sqlite or nats://HOST:PORT"
    )
    assert queue_refusal("nats://nats.sless:4222", "kubernetes") is None
    assert queue_refusal("sqlite", "local") is None
