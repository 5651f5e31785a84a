"""Reads need a token when one is configured: the three levels, sessions, the start-up rule.

Written from the attacker's side: a signed-out client asks for every route the app
has (enumerated from the app itself, so a route added later is checked too), forges,
replays and borrows cookies, posts the sign-in form from another site, and starts a
server on an open address without a token. Where it helps, the same attack is shown
succeeding without the protection (``anonymous_read``).
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from starlette.routing import Mount

from gitops_sless.state.store import Store
from gitops_sless.web.access import SESSION_SEC, Access, is_loopback, open_reads_refusal
from gitops_sless.web.api import create_api

from ..gitserver import free_port
from ..paths import ROOT
from ..sless_server import SlessServer
from ..test_serve_start import assert_refused, serve
from .test_api import Client, RecordingReconciler
from .test_api_schema import KNOWN, fill

API, READ = "api-token-0123456789", "read-token-9876543210"
RESULT = "RESULT-of-the-job-7f3a9c"  # what a job returned: a signed-out reader must never see it
LOG_LINE = "LOGLINE-the-build-printed-2b8e41"
PUBLIC = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("POST", "/api/v1/webhooks/{forge}"),
    ("GET", "/dashboard/assets/dashboard.css"),
    ("GET", "/dashboard/assets/dashboard.js"),
    ("GET", "/dashboard/assets/signin.js"),
    ("GET", "/signin"),
    ("POST", "/signin"),
    ("POST", "/signout"),
}
WRITES = {("POST", "/api/v1/sync"), ("DELETE", "/api/v1/environments/{env}")}
# a rollback and an unpin, each also under /api/ (where a revision list's links point)
SWITCHES = {
    ("POST", f"{prefix}/environments/{{env}}/functions/{{name}}/{action}")
    for prefix in ("/api/v1", "/api")
    for action in ("rollback", "unpin")
}
WRITES |= SWITCHES
# the dashboard's own forms that change something: a session signed in with the API
# token, its CSRF token in the form (never a bearer token)
FORMS = {
    ("POST", "/functions/{env}/{name}/rollback"),
    ("POST", "/functions/{env}/{name}/unpin"),
}
DIFF = ("POST", "/api/v1/environments/{env}/diff")
VALUES = {**KNOWN, "file": "swagger-ui.css"}
SAME_SITE = {"Origin": "http://api"}  # the in-process client's own origin
HTTPS = {"X-Forwarded-Proto": "https"}


class FakePreviews:
    """Previews that hold one, pr-3, so deleting it can be accepted."""

    def listing(self) -> list[dict[str, Any]]:
        return []

    def delete(self, number: int) -> bool:
        return number == 3


def make_client(tmp_path: Path, **settings: Any) -> Client:
    """A signed-out client of an API with both tokens, whose store holds a job result and a
    build log that a reader could only have from the server."""
    store = Store(tmp_path / "status.db")
    fill(store)
    store.set_job_run(
        "prod", "stamp", 1, function="fn0", phase="Succeeded", result=f'{{"mark": "{RESULT}"}}'
    )
    store.finish_build("python3.11-0", "Failed", f"step 1\n{LOG_LINE}\n", "pip install exited 1")
    reconciler = RecordingReconciler()
    reconciler.passes = 1
    app = create_api(
        reconciler,
        store,
        "main",
        "repo",
        api_token=API,
        webhook_secret="s",
        previews=FakePreviews(),
        read_token=settings.pop("read_token", READ),
        **settings,
    )
    client = Client(app)
    client.reconciler = reconciler  # type: ignore[attr-defined] - what the forms asked of it
    return client


def call(client: Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    body = {"json": {"functions": []}} if (method, path) == DIFF else {}
    return client.request(method, concrete(path), **body, **kwargs)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def endpoints(routes: Iterable[Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(method, path template) of every route the app answers, included routers too."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:  # FastAPI's include_router, resolved lazily
            yield from endpoints(inner.routes, prefix + route.include_context.prefix)
        elif isinstance(route, Mount):
            yield "GET", prefix + route.path + "/{file}"
        else:
            yield from ((m, prefix + route.path) for m in route.methods if m != "HEAD")


def concrete(path: str, values: dict[str, str] = VALUES) -> str:
    return re.sub(r"\{(\w+)\}", lambda match: values[match.group(1)], path)


def cookie_of(response: httpx.Response) -> str:
    found = re.match(r"sless_session=([^;]*)", response.headers["set-cookie"])
    assert found, response.headers["set-cookie"]
    return found.group(1)


def signed_in(client: Client, token: str = READ) -> dict[str, str]:
    response = client.post("/signin", data={"token": token, "next": "/"}, headers=SAME_SITE)
    assert response.status_code == 303, response.text
    return {"Cookie": f"sless_session={cookie_of(response)}"}


def csrf_of(page: str) -> dict[str, str]:
    """The CSRF header a dashboard page gives its script for /api/ calls."""
    found = re.search(r'data-csrf="([^"]+)" data-csrf-header="([^"]+)"', page)
    assert found, "the page carries no CSRF token"
    return {found.group(2): found.group(1)}


def api_session(client: Client, token: str = READ) -> dict[str, str]:
    """A session's cookie and the CSRF header its dashboard page gives: what the
    dashboard's own script sends to /api/."""
    session = signed_in(client, token)
    return {**session, **csrf_of(client.get("/", headers=session).text)}


# --- every route, by level -----------------------------------------------------------------------


def test_every_route_but_the_public_ones_is_401_without_a_token_and_200_with_the_read_token(
    tmp_path,
):
    client = make_client(tmp_path)
    found = set(endpoints(client.app.routes))
    assert found >= PUBLIC | WRITES, "the lists name routes the app has"
    assert found >= FORMS
    reads = found - PUBLIC - WRITES - FORMS
    pages = {("GET", "/"), ("GET", "/functions/{env}/{name}")}
    assert pages | {("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"), DIFF} <= reads

    for method, path in sorted(found - PUBLIC - FORMS):
        for headers in ({}, bearer("wrong"), {"Authorization": f"Basic {READ}"}):
            refused = call(client, method, path, headers=headers)
            assert refused.status_code == 401, (method, path, headers, refused.text)
            assert "Authorization: Bearer" in refused.json()["error"]
            assert RESULT not in refused.text and LOG_LINE not in refused.text
    for method, path in sorted(reads):
        for token in (READ, API):
            answer = call(client, method, path, headers=bearer(token))
            assert answer.status_code == 200, (method, path, token, answer.text[:300])


def test_the_write_endpoints_refuse_the_read_token_and_take_the_api_token(tmp_path):
    client = make_client(tmp_path)
    for method, path in sorted(WRITES):
        # a preview that can be deleted; fn0 of prod, which can be rolled back and unpinned
        switch = (method, path) in SWITCHES
        url = concrete(path, VALUES if switch else {"env": "pr-3"})
        refused = client.request(method, url, headers=bearer(READ))
        assert refused.status_code == 403, (method, path, refused.text)
        assert "read token cannot change anything" in refused.json()["error"]
        assert client.request(method, url, headers=bearer("guess")).status_code == 401
        done = client.request(method, url, headers=bearer(API))
        assert done.status_code == (200 if switch else 202), (method, path, done.text)


def test_the_dashboards_forms_change_things_only_for_a_session_signed_in_with_the_api_token(
    tmp_path,
):
    client = make_client(tmp_path)
    reconciler = client.reconciler
    writer = api_session(client, API)
    reader = api_session(client, READ)
    csrf = next(v for k, v in writer.items() if k != "Cookie")
    for method, path in sorted(FORMS):
        url = concrete(path)
        form = {"csrf": csrf, "to": "r1"}
        cookie_only = {"Cookie": writer["Cookie"]}
        # every one of these is what an attacker could send: all refused, nothing done
        refusals = [
            ({}, form),  # signed out
            (bearer(API), form),  # a bearer token: the forms are the session's
            ({"Cookie": reader["Cookie"], **SAME_SITE}, {**form, "csrf": csrf_of_session(reader)}),
            ({**cookie_only, **SAME_SITE}, {"to": "r1"}),  # no CSRF token
            ({**cookie_only, **SAME_SITE}, {**form, "csrf": "guessed"}),
            ({**cookie_only, "Origin": "https://evil.example"}, form),  # another site
        ]
        before = list(reconciler.revisions.asked)
        for headers, data in refusals:
            refused = client.request(method, url, headers=headers, data=data)
            assert refused.status_code in (401, 403), (path, headers, refused.text[:200])
        assert reconciler.revisions.asked == before, "a refused form changed something"
        done = client.request(method, url, headers={**cookie_only, **SAME_SITE}, data=form)
        assert done.status_code == 303, done.text[:300]
        assert done.headers["location"] == "/functions/prod/fn0"
        assert reconciler.revisions.asked[-1][0] == path.rsplit("/", 1)[1]
        assert reconciler.revisions.asked[-1][-1] == "dashboard"


def csrf_of_session(session: dict[str, str]) -> str:
    return next(v for k, v in session.items() if k != "Cookie")


def test_the_public_routes_answer_anyone(tmp_path):
    client = make_client(tmp_path)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    assert client.get("/dashboard/assets/dashboard.css").status_code == 200
    assert client.get("/signin").status_code == 200
    # a webhook is not refused for want of a token: its own signature decides
    unsigned = client.post("/api/v1/webhooks/github", content=b"{}")
    assert unsigned.status_code == 401 and "webhook refused" in unsigned.json()["error"]


def test_a_signed_out_browser_is_shown_the_sign_in_form_and_nothing_the_server_holds(tmp_path):
    client = make_client(tmp_path)
    html = {"Accept": "text/html,application/xhtml+xml"}
    for path in ("/", "/functions/prod/fn0", "/docs", "/api/v1/environments/prod/jobs"):
        page = client.get(path, headers=html)
        assert page.status_code == 401, path
        assert '<form class="signin" method="post" action="/signin">' in page.text
        assert f'name="next" value="{path}"' in page.text
        for held in (RESULT, LOG_LINE, "python3.11-0", "fn1"):  # fn1: named by no path
            assert held not in page.text, (path, held)
    # the attack, with reads left open on purpose: the same request gets it all
    opened = make_client(tmp_path / "open", anonymous_read=True).get("/functions/prod/fn0")
    assert RESULT in opened.text and LOG_LINE in opened.text


def test_anonymous_read_opens_reads_but_never_writes(tmp_path):
    client = make_client(tmp_path, anonymous_read=True)
    assert RESULT in client.get("/api/v1/environments/prod/jobs").text
    assert client.get("/metrics").status_code == 200
    assert client.post("/api/v1/sync").status_code == 401
    assert client.post("/api/v1/sync", headers=bearer(READ)).status_code == 403


def test_no_token_at_all_keeps_reads_open_and_writes_refused(tmp_path):
    store = Store(tmp_path / "status.db")
    client = Client(create_api(RecordingReconciler(), store, "main", "repo", None, None))
    assert client.get("/api/v1/status").status_code == 200
    assert client.get("/").status_code == 200
    assert client.get("/signin").status_code == 303  # nothing to sign in to
    refused = client.post("/api/v1/sync", headers=bearer("guess"))
    assert refused.status_code == 403 and "no API token" in refused.json()["error"]


# --- sessions ------------------------------------------------------------------------------------


def test_signing_in_trades_the_token_for_a_cookie_that_reads_and_never_holds_the_token(tmp_path):
    client = make_client(tmp_path)
    signin = client.post(
        "/signin", data={"token": READ, "next": "/functions/prod/fn0"}, headers=SAME_SITE
    )
    assert (signin.status_code, signin.headers["location"]) == (303, "/functions/prod/fn0")
    attributes = {part.strip().lower() for part in signin.headers["set-cookie"].split(";")}
    assert {"httponly", "samesite=strict", "path=/", f"max-age={SESSION_SEC}"} <= attributes
    assert "secure" not in attributes  # plain http: a Secure cookie would never come back
    cookie = cookie_of(signin)
    assert READ not in cookie and API not in cookie
    session = {"Cookie": f"sless_session={cookie}"}

    page = client.get("/functions/prod/fn0", headers=session)
    assert page.status_code == 200 and RESULT in page.text
    assert '<form class="signout" method="post" action="/signout" data-csrf=' in page.text
    # the API takes the session only with the CSRF header the page gives its script
    log = "/api/v1/builds/python3.11-0/log"
    assert client.get(log, headers=session).status_code == 401
    assert client.get(log, headers={**session, **csrf_of(page.text)}).status_code == 200
    # a session reads only: a forged cross-site POST that carried it could change nothing
    assert client.post("/api/v1/sync", headers=session).status_code == 401
    assert client.request("DELETE", "/api/v1/environments/pr-3", headers=session).status_code == 401
    api_session = signed_in(client, API)
    assert client.post("/api/v1/sync", headers=api_session).status_code == 401


def test_a_signed_out_cookie_replayed_reads_nothing(tmp_path):
    client = make_client(tmp_path)
    session = api_session(client)
    assert client.get("/api/v1/status", headers=session).status_code == 200
    out = client.post("/signout", headers={**session, **SAME_SITE})
    assert (out.status_code, out.headers["location"]) == (303, "/signin?signed-out")
    cleared = out.headers["set-cookie"].lower()
    assert cleared.startswith('sless_session="";') and "max-age=0" in cleared
    assert client.get("/api/v1/status", headers=session).status_code == 401
    assert "You are signed out." in client.get("/signin?signed-out").text


def _later(cookie: str) -> str:
    expiry, nonce, signature = cookie.split(".")
    return f"{int(expiry) + 10**6}.{nonce}.{signature}"


def _resigned(cookie: str) -> str:
    return cookie[:-2] + ("BB" if cookie.endswith("AA") else "AA")


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(_later, id="later-expiry"),
        pytest.param(_resigned, id="bad-signature"),
        pytest.param(lambda cookie: READ, id="the-token-itself"),
        pytest.param(lambda cookie: "9999999999.nonce.", id="unsigned"),
        pytest.param(lambda cookie: "", id="empty"),
    ],
)
def test_a_forged_cookie_reads_nothing(tmp_path, forge):
    client = make_client(tmp_path)
    real = signed_in(client)["Cookie"].removeprefix("sless_session=")
    forged = {"Cookie": f"sless_session={forge(real)}"}
    assert client.get("/api/v1/environments/prod/jobs", headers=forged).status_code == 401


def test_a_cookie_from_a_server_with_other_tokens_reads_nothing(tmp_path):
    other = make_client(tmp_path / "other", read_token="another-read-token")
    client = make_client(tmp_path)
    borrowed = api_session(other, "another-read-token")
    assert client.get("/api/v1/status", headers=borrowed).status_code == 401
    same_tokens = make_client(tmp_path / "replica")  # another replica with the same tokens
    assert same_tokens.get("/api/v1/status", headers=api_session(client)).status_code == 200


def test_a_session_ends_after_twelve_hours():
    now = [1_800_000_000.0]
    access = Access(API, READ, clock=lambda: now[0])
    cookie = access.new_session()
    now[0] += SESSION_SEC - 1
    assert access.session_valid(cookie)
    now[0] += 1
    assert not access.session_valid(cookie)


def test_a_wrong_token_is_refused_and_sets_no_cookie(tmp_path):
    client = make_client(tmp_path)
    wrong = client.post("/signin", data={"token": "guess", "next": "/"}, headers=SAME_SITE)
    assert wrong.status_code == 401
    assert "That token is not valid." in wrong.text
    assert "set-cookie" not in wrong.headers


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({"Origin": "http://evil.example"}, id="another-origin"),
        pytest.param({"Origin": "null"}, id="opaque-origin"),
        pytest.param({"Referer": "http://evil.example/page"}, id="another-referer"),
        pytest.param({"Origin": "http://api.evil.example"}, id="a-longer-host"),
    ],
)
def test_the_sign_in_and_sign_out_forms_refuse_a_post_from_another_site(tmp_path, headers):
    client = make_client(tmp_path)
    forged = client.post("/signin", data={"token": READ, "next": "/"}, headers=headers)
    assert forged.status_code == 403
    assert "set-cookie" not in forged.headers
    session = api_session(client)
    out = client.post("/signout", headers={**session, **headers})
    assert out.status_code == 403
    assert client.get("/api/v1/status", headers=session).status_code == 200  # still signed in


@pytest.mark.parametrize(
    "target",
    ["//evil.example/x", "https://evil.example/", "/\\evil.example", "javascript:alert(1)", ""],
)
def test_after_signing_in_the_browser_stays_on_this_server(tmp_path, target):
    client = make_client(tmp_path)
    response = client.post("/signin", data={"token": READ, "next": target}, headers=SAME_SITE)
    assert (response.status_code, response.headers["location"]) == (303, "/")


@pytest.mark.parametrize(
    ("base", "trusted", "headers", "secure"),
    [
        pytest.param("https://api", (), {}, True, id="tls-here"),
        pytest.param("http://api", ("127.0.0.0/8",), HTTPS, True, id="trusted-proxy"),
        pytest.param("http://api", (), HTTPS, False, id="untrusted-peer"),
        pytest.param("http://api", ("127.0.0.0/8",), {}, False, id="plain-http"),
    ],
)
def test_the_cookie_is_secure_when_the_browser_came_over_https(
    tmp_path, base, trusted, headers, secure
):
    client = make_client(tmp_path, trusted_proxies=trusted)
    origin = {"Origin": base}

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=client.app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url=base) as http:
            return await http.post(
                "/signin", data={"token": READ, "next": "/"}, headers={**origin, **headers}
            )

    response = asyncio.run(post())
    assert response.status_code == 303, response.text
    attributes = {part.strip().lower() for part in response.headers["set-cookie"].split(";")}
    assert ("secure" in attributes) == secure


# --- start-up: no token off loopback -------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback
    refused = open_reads_refusal(f"{host}:8080", host, None, None, False)
    assert (refused is None) is loopback


def _functions(tmp_path: Path) -> Path:
    folder = tmp_path / "functions"
    folder.mkdir(parents=True)
    (folder / "README.md").write_text("no functions yet\n")
    return folder


@pytest.mark.parametrize("listen", ["0.0.0.0", "[::]", "192.0.2.1"])
def test_a_server_on_an_open_address_without_a_token_refuses_to_start(tmp_path, listen):
    address = f"{listen}:{free_port()}"
    proc = serve(tmp_path, "--repo", str(_functions(tmp_path)), "--listen", address)
    line = assert_refused(
        proc, f"--listen {address}", "SLESS_READ_TOKEN", "SLESS_API_TOKEN", "--anonymous-read"
    )
    assert line.startswith("gitops-sless serve: ")
    assert not (tmp_path / "state").exists()  # refused before anything was written


def _open_server(tmp_path: Path, *args: str, **kwargs: Any) -> SlessServer:
    server = SlessServer(str(_functions(tmp_path)), tmp_path / "state", **kwargs)
    server.extra_args += ["--listen", f"0.0.0.0:{server.port}", *args]
    return server


def test_on_an_open_address_anonymous_read_or_a_token_lets_it_start(tmp_path):
    anonymous = _open_server(tmp_path / "a", "--anonymous-read", token=None)
    token = _open_server(tmp_path / "b", token=None, read_token=READ)
    try:
        anonymous.start()
        assert httpx.get(f"{anonymous.base}/api/v1/status").status_code == 200
        token.start()
        assert httpx.get(f"{token.base}/api/v1/status").status_code == 401
        answer = httpx.get(f"{token.base}/api/v1/status", headers=bearer(READ))
        assert answer.status_code == 200
    finally:
        anonymous.stop()
        token.stop()


def test_on_loopback_without_a_token_it_generates_one_and_reads_need_it(tmp_path):
    # functions share the loopback on the local backend: an address proves nothing
    server = SlessServer(str(_functions(tmp_path)), tmp_path / "state", token=None)
    try:
        server.start()
        assert httpx.get(f"{server.base}/api/v1/status").status_code == 401
        assert httpx.get(f"{server.base}/", headers={"Accept": "text/html"}).status_code == 401
        generated = server.api_token()
        assert generated and generated == (tmp_path / "state" / "api-token").read_text().strip()
        assert (
            httpx.get(f"{server.base}/api/v1/status", headers=bearer(generated)).status_code == 200
        )
        refused = httpx.post(f"{server.base}/api/v1/sync", headers=bearer("guess"))
        assert refused.status_code == 401
        taken = httpx.post(f"{server.base}/api/v1/sync", headers=bearer(generated))
        assert taken.status_code == 202
    finally:
        server.stop()


def test_the_command_line_reads_with_the_read_token_and_cannot_sync_with_it(tmp_path):
    server = SlessServer(str(_functions(tmp_path)), tmp_path / "state")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    env.update(SLESS_SERVER=server.base, SLESS_READ_TOKEN=server.read_token or "")

    def cli(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gitops_sless", *args],
            capture_output=True,
            text=True,
            env={**env, **extra},
            cwd=tmp_path,  # no .sless-state with a token file from here up
            timeout=60,
        )

    try:
        server.start()
        assert cli("status").returncode == 0
        sync = cli("sync")
        assert sync.returncode == 2
        assert sync.stderr.strip().endswith("set SLESS_API_TOKEN")
        signed_out = cli("status", SLESS_READ_TOKEN="")
        assert signed_out.returncode == 2
        assert signed_out.stderr.strip().endswith("set SLESS_READ_TOKEN or SLESS_API_TOKEN")
        assert cli("sync", "--wait", "0", SLESS_API_TOKEN=server.token or "").returncode == 0
    finally:
        server.stop()


def test_the_shipped_deployment_listens_off_loopback_with_a_token_from_its_secret():
    deploy = ROOT / "deploy"
    (container,) = yaml.safe_load((deploy / "deployment.yaml").read_text())["spec"]["template"][
        "spec"
    ]["containers"]
    secret = yaml.safe_load((deploy / "secret.example.yaml").read_text())
    assert {"secretRef": {"name": secret["metadata"]["name"]}} in container["envFrom"]
    args = container["args"]
    listen = args[args.index("--listen") + 1]
    host = listen.rpartition(":")[0]
    tokens = secret["stringData"]
    assert "--anonymous-read" not in args
    assert open_reads_refusal(listen, host, None, None, False) is not None  # without the Secret
    refusal = open_reads_refusal(
        listen, host, tokens.get("SLESS_API_TOKEN"), tokens.get("SLESS_READ_TOKEN"), False
    )
    assert refusal is None


@pytest.mark.parametrize(("trusted", "status"), [(("127.0.0.0/8",), 303), ((), 403)])
def test_behind_a_proxy_that_rewrites_host_only_a_trusted_one_names_the_public_host(
    tmp_path, trusted, status
):
    client = make_client(tmp_path, trusted_proxies=trusted)
    headers = {"Origin": "https://sless.example", "X-Forwarded-Host": "sless.example"}
    response = client.post("/signin", data={"token": READ, "next": "/"}, headers=headers)
    assert response.status_code == status
