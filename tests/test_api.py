"""The API's refusals, in process: the forge list, missing secrets and tokens, bad bodies."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from typing import Any

import httpx
import pytest

from gitops_sless.api import create_api
from gitops_sless.store import Store


class RecordingReconciler:
    """Stands in for the reconciler: records sync requests instead of running passes."""

    env = "prod"
    passes = 0

    def __init__(self) -> None:
        self.requests: list[str] = []

    def request_sync(self, trigger: str) -> None:
        self.requests.append(trigger)

    def wait_for_pass(self, after: int, timeout: float) -> bool:
        return False


class Client:
    """Calls the ASGI app in process, over httpx's ASGI transport."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        async def call() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
                return await http.request(method, url, **kwargs)

        return asyncio.run(call())

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)


def client(tmp_path, token="t", secret="s") -> tuple[Client, RecordingReconciler]:
    reconciler = RecordingReconciler()
    store = Store(tmp_path / "status.db")
    app = create_api(reconciler, store, "main", "repo", api_token=token, webhook_secret=secret)
    return Client(app), reconciler


def signed(body: bytes, secret: str = "s") -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"X-Gitea-Signature": digest, "X-Gitea-Event": "push"}


def test_unknown_forge_is_404(tmp_path):
    http, _ = client(tmp_path)
    response = http.post("/api/v1/webhooks/bitbucket", content=b"{}")
    assert response.status_code == 404
    assert "use one of github, gitea, gitlab" in response.json()["error"]


def test_webhooks_without_a_secret_are_refused(tmp_path):
    http, reconciler = client(tmp_path, secret=None)
    response = http.post("/api/v1/webhooks/gitea", content=b"{}", headers=signed(b"{}"))
    assert response.status_code == 403
    assert "no webhook secret" in response.json()["error"]
    assert reconciler.requests == []


@pytest.mark.parametrize(
    ("body", "status", "requests"),
    [
        pytest.param(b'{"ref": "refs/heads/main"}', 202, ["webhook:gitea"], id="push-to-main"),
        pytest.param(b'{"ref": "refs/heads/dev"}', 200, [], id="push-elsewhere"),
        pytest.param(b"[]", 400, [], id="not-an-object"),
    ],
)
def test_gitea_push(tmp_path, body, status, requests):
    http, reconciler = client(tmp_path)
    response = http.post("/api/v1/webhooks/gitea", content=body, headers=signed(body))
    assert response.status_code == status
    assert reconciler.requests == requests


def test_gitlab_token(tmp_path):
    http, reconciler = client(tmp_path)
    body = b'{"ref": "refs/heads/main"}'
    headers = {"X-Gitlab-Event": "Push Hook"}
    bad = http.post(
        "/api/v1/webhooks/gitlab", content=body, headers={**headers, "X-Gitlab-Token": "x"}
    )
    assert bad.status_code == 401
    good = http.post(
        "/api/v1/webhooks/gitlab", content=body, headers={**headers, "X-Gitlab-Token": "s"}
    )
    assert good.status_code == 202
    assert reconciler.requests == ["webhook:gitlab"]


def test_sync_with_the_token_is_accepted(tmp_path):
    http, reconciler = client(tmp_path)
    response = http.post("/api/v1/sync", headers={"Authorization": "Bearer t"})
    assert response.status_code == 202
    assert response.json()["accepted"] is True
    assert reconciler.requests == ["api"]


def test_unknown_function_is_404(tmp_path):
    http, _ = client(tmp_path)
    response = http.get("/api/v1/environments/prod/functions/nope")
    assert response.status_code == 404
    assert http.get("/api/v1/environments/prod/functions").json() == []
    assert http.get("/docs").status_code == 200
