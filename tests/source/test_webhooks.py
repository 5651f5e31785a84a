"""Webhook signatures for GitHub, Gitea and GitLab, push parsing, and hostile clients."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

from gitops_sless import proxy
from gitops_sless.source import webhooks
from gitops_sless.state.routes import RouteTable
from gitops_sless.state.store import Store
from gitops_sless.web.api import create_api

from ..paths import DATA
from ..web.test_api import Api, Client, RecordingReconciler, make_api

SECRET = "s3cret"
BODY = json.dumps({"ref": "refs/heads/main", "after": "abc"}).encode()
PAYLOADS = DATA / "webhooks"


def signed(forge: str, body: bytes = BODY, secret: str = SECRET) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {
        "github": {"x-hub-signature-256": f"sha256={digest}", "x-github-event": "push"},
        "gitea": {"x-gitea-signature": digest, "x-gitea-event": "push"},
        "gitlab": {"x-gitlab-token": secret, "x-gitlab-event": "Push Hook"},
    }[forge]


@pytest.mark.parametrize("forge", webhooks.FORGES)
def test_good_signature_is_accepted_and_push_parsed(forge):
    headers = signed(forge)
    webhooks.verify(forge, headers, BODY, SECRET)
    assert webhooks.parse_push(forge, headers, BODY) == webhooks.Push("push", "main")


@pytest.mark.parametrize("forge", webhooks.FORGES)
def test_wrong_secret_is_refused(forge):
    with pytest.raises(webhooks.SignatureError, match="does not match"):
        webhooks.verify(forge, signed(forge, secret="other"), BODY, SECRET)


@pytest.mark.parametrize("forge", ["github", "gitea"])
def test_tampered_body_is_refused(forge):
    with pytest.raises(webhooks.SignatureError, match="does not match"):
        webhooks.verify(forge, signed(forge), BODY + b" ", SECRET)


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        ("github", "missing X-Hub-Signature-256"),
        ("gitea", "missing X-Gitea-Signature"),
        ("gitlab", "missing X-Gitlab-Token"),
    ],
)
def test_missing_signature_is_refused(forge, message):
    with pytest.raises(webhooks.SignatureError, match=message):
        webhooks.verify(forge, {}, BODY, SECRET)


def test_github_signature_needs_its_prefix():
    digest = signed("gitea")["x-gitea-signature"]
    with pytest.raises(webhooks.SignatureError, match="sha256="):
        webhooks.verify("github", {"x-hub-signature-256": digest}, BODY, SECRET)


def test_other_events_and_tags_are_not_branch_pushes():
    assert webhooks.parse_push("github", {"x-github-event": "ping"}, b"{}").event == "ping"
    tag = json.dumps({"ref": "refs/tags/v1"}).encode()
    assert webhooks.parse_push("gitea", {"x-gitea-event": "push"}, tag).branch is None
    mr = webhooks.parse_push("gitlab", {"x-gitlab-event": "Merge Request Hook"}, b"{}")
    assert mr.event == "merge_request"


def test_push_that_is_not_an_object_is_a_clear_error():
    with pytest.raises(webhooks.PayloadError, match="must be a JSON object, not an array"):
        webhooks.parse_push("github", {"x-github-event": "push"}, b"[1]")


# --- through the app -----------------------------------------------------------------------


def app_with_secret(tmp_path: Path) -> Api:
    return make_api(tmp_path, secret=SECRET)


@pytest.mark.parametrize("forge", webhooks.FORGES)
def test_a_real_push_payload_starts_a_sync(tmp_path, forge):
    api = app_with_secret(tmp_path)
    body = (PAYLOADS / f"{forge}-push.json").read_bytes()
    response = api.http.post(f"/api/v1/webhooks/{forge}", content=body, headers=signed(forge, body))
    assert (response.status_code, response.json()) == (202, {"accepted": True, "ignored": None})
    assert api.reconciler.requests == [f"webhook:{forge}"]


@pytest.mark.parametrize("forge", webhooks.FORGES)
def test_a_push_to_another_branch_is_acknowledged_and_ignored(tmp_path, forge):
    api = app_with_secret(tmp_path)
    payload = json.loads((PAYLOADS / f"{forge}-push.json").read_bytes())
    body = json.dumps({**payload, "ref": "refs/heads/dev"}).encode()
    response = api.http.post(f"/api/v1/webhooks/{forge}", content=body, headers=signed(forge, body))
    assert (response.status_code, response.json()) == (
        200,
        {"accepted": False, "ignored": "push to dev"},
    )
    assert api.reconciler.requests == []


MALFORMED = [
    pytest.param(b"[" * 10_000 + b"]" * 10_000, "recursion limit", id="arrays-10000-deep"),
    pytest.param(
        b'{"ref": "refs/heads/main", "x": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001,
        "recursion limit",
        id="objects-10000-deep",
    ),
    pytest.param(b'{"ref": 5}', "field 'ref' must be a string, not a number", id="ref-number"),
    pytest.param(b'{"ref": null}', "field 'ref' must be a string, not null", id="ref-null"),
    pytest.param(b'{"ref": ["main"]}', "field 'ref' must be a string, not an array", id="ref-list"),
    pytest.param(b'["refs/heads/main"]', "must be a JSON object, not an array", id="top-array"),
    pytest.param(b'"refs/heads/main"', "must be a JSON object, not a string", id="top-string"),
    pytest.param(b"null", "must be a JSON object, not null", id="top-null"),
    pytest.param(b'{"after": "abc"}', "push payload has no 'ref' field", id="no-ref"),
    pytest.param(b"", "not valid JSON", id="empty"),
    pytest.param(b'{"ref": "refs/heads/main"', "not valid JSON", id="cut-short"),
    pytest.param(b"\xff\xfe{}", "not valid JSON", id="not-utf8"),
]


@pytest.mark.parametrize("forge", webhooks.FORGES)
@pytest.mark.parametrize(("body", "reason"), MALFORMED)
def test_a_signed_but_malformed_push_is_400_with_the_reason(tmp_path, forge, body, reason):
    api = app_with_secret(tmp_path)
    response = api.http.post(f"/api/v1/webhooks/{forge}", content=body, headers=signed(forge, body))
    assert response.status_code == 400
    assert reason in response.json()["error"]
    assert response.json()["error"].startswith("push payload")
    assert api.reconciler.requests == []


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def shared_api(tmp_path_factory) -> Api:
    return app_with_secret(tmp_path_factory.mktemp("webhooks"))


@settings(max_examples=60, deadline=None, database=None)
@given(
    forge=st.sampled_from(webhooks.FORGES),
    payload=JSON | st.dictionaries(st.sampled_from(["ref", "after"]), JSON),
)
def test_no_signed_json_body_is_a_server_error(shared_api, forge, payload):
    body = json.dumps(payload).encode()
    response = shared_api.http.post(
        f"/api/v1/webhooks/{forge}", content=body, headers=signed(forge, body)
    )
    is_push = isinstance(payload, dict) and isinstance(payload.get("ref"), str)
    assert response.status_code == (
        (202 if payload["ref"] == "refs/heads/main" else 200) if is_push else 400
    ), response.text


# --- a client that goes away ------------------------------------------------------------------


def uvicorn_config(app, http: str) -> uvicorn.Config:
    """Plain h11 or httptools, or what ``serve`` runs: uvloop and the /fn/ fast path."""
    if http == "serve":
        return proxy.config(app, proxy=proxy.ProxyApp(RouteTable()), log_config=None)
    return uvicorn.Config(app, host="127.0.0.1", port=0, http=http, loop="asyncio", log_config=None)


class LoopbackServer:
    """The app under a real uvicorn on 127.0.0.1, in a thread, logging to the test's caplog."""

    def __init__(self, app, http: str) -> None:
        self.server = uvicorn.Server(uvicorn_config(app, http))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def wait_for(predicate, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def logged(caplog) -> list[logging.LogRecord]:
    """What the API logged, or anything logged as an error."""
    return [
        r for r in caplog.records if r.name == "gitops_sless.web.api" or r.levelno >= logging.ERROR
    ]


@pytest.mark.parametrize("http", ["h11", "httptools", "serve"])
def test_a_client_that_disconnects_mid_body_leaves_no_traceback(tmp_path, caplog, http):
    caplog.set_level(logging.DEBUG)
    api = app_with_secret(tmp_path)
    headers = signed("github", b"x" * 1000)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    with LoopbackServer(api.http.app, http) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
            conn.sendall(
                f"POST /api/v1/webhooks/github HTTP/1.1\r\nHost: sless\r\n{head}"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode()
                + b'{"ref": "r'
            )
        wait_for(lambda: logged(caplog), "the server to log the disconnect")
        # the server still answers after it
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: sless\r\nConnection: close\r\n\r\n")
            assert conn.recv(100).startswith(b"HTTP/1.1 200")
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert [f"{r.levelname} {r.name}: {r.getMessage()}" for r in loud] == []
    gone = [r for r in caplog.records if r.name == "gitops_sless.web.api"]
    assert [(r.levelno, r.getMessage()) for r in gone] == [
        (
            logging.DEBUG,
            "github webhook: the client closed the connection before sending its body",
        )
    ]
    assert api.reconciler.requests == []


# --- one secret per forge, seen from the attacker's side ---------------------------------------


def separate_secrets_api(tmp_path: Path, shared: str | None = None) -> Api:
    """GitHub and GitLab each with a secret of their own; Gitea with ``shared`` alone."""
    reconciler = RecordingReconciler()
    store = Store(tmp_path / "status.db")
    own = {"github": "github-only", "gitlab": "gitlab-only"}
    app = create_api(
        reconciler, store, "main", "repo", "t", webhook_secret=shared, webhook_secrets=own
    )
    return Api(Client(app), reconciler, store)


def post(api: Api, forge: str, headers: dict[str, str], body: bytes = BODY):
    return api.http.post(f"/api/v1/webhooks/{forge}", content=body, headers=headers)


def test_a_forge_with_no_secret_at_all_is_403_and_the_others_use_their_own(tmp_path):
    api = separate_secrets_api(tmp_path)
    refused = post(api, "gitea", signed("gitea", secret="gitlab-only"))
    assert refused.status_code == 403
    assert "SLESS_WEBHOOK_SECRET_GITEA" in refused.json()["error"]
    assert post(api, "github", signed("github", secret="github-only")).status_code == 202
    assert post(api, "gitlab", signed("gitlab", secret="gitlab-only")).status_code == 202
    assert api.reconciler.requests == ["webhook:github", "webhook:gitlab"]


def test_the_gitlab_token_seen_in_clear_does_not_sign_github_events(tmp_path):
    """One GitLab delivery shows its secret (X-Gitlab-Token): with a secret per forge it
    signs nothing else; the shared default still serves Gitea, which has none of its own."""
    api = separate_secrets_api(tmp_path, shared="shared-default")
    seen = signed("gitlab", secret="gitlab-only")["x-gitlab-token"]
    forged = post(api, "github", signed("github", secret=seen))
    assert forged.status_code == 401
    assert post(api, "github", signed("github", secret="shared-default")).status_code == 401
    assert post(api, "gitea", signed("gitea", secret="shared-default")).status_code == 202
    assert api.reconciler.requests == ["webhook:gitea"]


def test_with_one_shared_secret_a_seen_gitlab_token_signs_github_events(tmp_path):
    """Why the secrets are separate: the same forgery succeeds against a shared secret."""
    api = app_with_secret(tmp_path)
    seen = signed("gitlab")["x-gitlab-token"]
    forged = post(api, "github", signed("github", secret=seen))
    assert forged.status_code == 202
    assert api.reconciler.requests == ["webhook:github"]


# --- deliveries acted on once -------------------------------------------------------------------


def with_id(forge: str, delivery: str, secret: str = SECRET, body: bytes = BODY) -> dict[str, str]:
    return {**signed(forge, body, secret), webhooks.DELIVERY_HEADERS[forge]: delivery}


@pytest.mark.parametrize("forge", webhooks.FORGES)
def test_a_delivery_received_before_is_200_and_requests_no_sync(tmp_path, forge):
    api = app_with_secret(tmp_path)
    first = post(api, forge, with_id(forge, "d-1"))
    assert first.status_code == 202
    again = post(api, forge, with_id(forge, "d-1"))
    assert (again.status_code, again.json()) == (
        200,
        {"accepted": False, "ignored": "duplicate delivery"},
    )
    assert api.reconciler.requests == [f"webhook:{forge}"]
    # another delivery of the same push is acted on: only the id makes it a repeat
    assert post(api, forge, with_id(forge, "d-2")).status_code == 202
    assert len(api.reconciler.requests) == 2


def test_an_unsigned_request_does_not_mark_its_delivery_id_as_seen(tmp_path):
    api = app_with_secret(tmp_path)
    assert post(api, "github", with_id("github", "d-1", secret="guess")).status_code == 401
    assert (
        post(api, "github", {"x-github-event": "push", "x-github-delivery": "d-1"}).status_code
        == 401
    )
    assert post(api, "github", with_id("github", "d-1")).status_code == 202
    assert api.store.deliveries() == 1


def test_a_push_without_a_delivery_id_is_acted_on_every_time(tmp_path):
    """Nothing to know it by: documented; a push only asks for a pass, which reads git."""
    api = app_with_secret(tmp_path)
    for _ in range(3):
        assert post(api, "gitea", signed("gitea")).status_code == 202
    assert api.reconciler.requests == ["webhook:gitea"] * 3
    assert api.store.deliveries() == 0


def test_an_absurd_delivery_id_is_400(tmp_path):
    api = app_with_secret(tmp_path)
    response = post(api, "gitlab", with_id("gitlab", "x" * 201))
    assert response.status_code == 400
    assert "X-Gitlab-Event-UUID is longer than 200" in response.json()["error"]
    assert api.reconciler.requests == []


class FailingOnce(RecordingReconciler):
    def request_sync(self, trigger: str) -> int:
        if not self.requests:
            self.requests.append("failed")
            raise RuntimeError("the store is gone for a moment")
        return super().request_sync(trigger)


def test_a_delivery_that_could_not_be_acted_on_is_acted_on_when_sent_again(tmp_path):
    reconciler = FailingOnce()
    store = Store(tmp_path / "status.db")
    http = Client(create_api(reconciler, store, "main", "repo", "t", webhook_secret=SECRET))
    api = Api(http, reconciler, store)
    with pytest.raises(RuntimeError):
        post(api, "github", with_id("github", "d-1"))
    assert post(api, "github", with_id("github", "d-1")).status_code == 202
    assert reconciler.requests == ["failed", "webhook:github"]
