"""Functions are untrusted code next to the dashboard and the API: written from their side.

A function author ships an HTML page whose script, opened by a signed-in reviewer,
tries to read job results, the dashboard's pages and replica logs with the reviewer's
session; a handler that reads the headers it is given, looking for the session cookie
or the server's token; a handler that calls the reconciler's API over the loopback it
shares with it on the local backend. One real ``serve`` (local backend, the default
sandbox, no token configured: it generates one), a real git server and Debian's
Chromium, as tests/web/test_dashboard.py drives it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gitops_sless.cli.common import api_token
from gitops_sless.proxy.http import SANDBOX_CSP

from ..gitserver import GitDaemon, free_port
from ..sless_server import SlessServer
from ..test_serve import HTTP, Setup, manifest
from .test_dashboard import OFFLINE, Tabs, browser, playwright, tabs

__all__ = ["browser", "playwright", "tabs"]  # the fixtures, shared with test_dashboard

RESULT = "job-result-9d2f7c"  # a job's result: for token holders only
LOGGED = "DB-PASSWORD-5e81a0"  # what a function printed: in its replica log
SANDBOX = SANDBOX_CSP.decode()

# the attacker's page: reads what the viewer's session can, reports it in the title
ATTACK = """<!doctype html><title>page</title><script>
(async () => {
  const found = [];
  for (const path of PATHS) {
    try {
      const r = await fetch(path, {credentials: "include", cache: "no-store"});
      const text = await r.text();
      found.push(path + "=" + r.status + (MARKS.some((m) => text.includes(m)) ? ":LEAKED" : ""));
    } catch (e) {
      found.push(path + "=blocked");
    }
  }
  document.title = "done " + found.join(" ");
})();
</script>"""
PATHS = [
    "/api/v1/environments/prod/jobs",
    "/api/v1/environments/prod/functions/echo/logs",
    "/functions/prod/stamp",  # the dashboard's own page: it shows job results
]


def page_handler(headers: dict[str, str]) -> str:
    # the marks are split so that the page itself never holds them whole
    marks = [RESULT[:6] + '" + "' + RESULT[6:], LOGGED[:6] + '" + "' + LOGGED[6:]]
    body = ATTACK.replace("PATHS", json.dumps(PATHS)).replace(
        "MARKS", "[" + ", ".join(f'"{m}"' for m in marks) + "]"
    )
    return (
        "def main(event, context):\n"
        f"    return {{'statusCode': 200, 'headers': {headers!r}, 'body': {body!r}}}\n"
    )


# what the function's own headers say: a policy of its own cannot lift the sandbox
OWN_CSP = {"Content-Type": "text/html", "Content-Security-Policy": "default-src * 'unsafe-inline'"}
ECHO = f"""import sys
print({LOGGED!r}, file=sys.stderr, flush=True)


def main(event, context):
    return {{"headers": event["_headers"]}}
"""
# the attacker's handler: calls the API over loopback, no token, port from the event
GRAB = """import urllib.error
import urllib.request


def main(event, context):
    url = f"http://127.0.0.1:{event['port']}{event['path']}"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return {"status": answer.status, "body": answer.read().decode()}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode()}
    except OSError as exc:
        return {"status": 0, "body": str(exc)}
"""
FILES = {
    "page/sless.yaml": manifest("page", HTTP),
    "page/handler.py": page_handler(OWN_CSP),
    "trusted/sless.yaml": manifest("trusted", "    triggers: [{type: http, sameOrigin: true}]"),
    "trusted/handler.py": page_handler({"Content-Type": "text/html"}),
    "echo/sless.yaml": manifest("echo", HTTP),
    "echo/handler.py": ECHO,
    "grab/sless.yaml": manifest("grab", HTTP),
    "grab/handler.py": GRAB,
    "stamp/sless.yaml": manifest(
        "stamp", f"    jobs: [{{name: stamp-it, runId: 1, event: {{mark: {RESULT}}}}}]"
    ),
    "stamp/handler.py": "def main(event, context=None):\n    return {'mark': event['mark']}\n",
}
READY = ("page", "trusted", "echo", "grab")


def _ready(server: SlessServer, names: tuple[str, ...] = READY) -> None:
    for name in names:
        server.wait(lambda n=name: (server.function(n) or {}).get("phase") == "Ready", name)
    server.wait(lambda: any(RESULT in (j.get("result") or "") for j in server.jobs()), "stamp-it")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SlessServer, Path]]:
    """A server with no token configured, its state in ``<project>/.sless-state``."""
    tmp = tmp_path_factory.mktemp("origin")
    folder = tmp / "project"
    folder.mkdir()
    with GitDaemon(tmp / "served") as daemon:
        repo = Setup(tmp, daemon, tmp / "served")
        repo.push(FILES)
        server = SlessServer(repo.url, folder / ".sless-state", token=None, env=OFFLINE)
        try:
            server.start()
            _ready(server)
            yield server, folder
        finally:
            server.stop()


@pytest.fixture
def server(project: tuple[SlessServer, Path]) -> SlessServer:
    return project[0]


# --- item 5: a token always exists when functions run on this machine ------------------


def test_a_sandboxed_function_calling_the_api_over_loopback_gets_401(server):
    for path in ("/api/v1/environments/prod/jobs", "/api/v1/environments/prod/functions/echo/logs"):
        answer = server.call("grab", "/", "POST", json={"port": server.port, "path": path})
        assert answer.status_code == 200, answer.text
        got = answer.json()
        # 401; 0 (unreachable) once a sandbox has a network namespace of its own
        assert got["status"] in (401, 0), (path, got)
        assert RESULT not in got["body"] and LOGGED not in got["body"]
    # the data is there, for a token holder
    assert RESULT in json.dumps(server.jobs())


def test_the_generated_token_is_kept_in_the_state_folder_readable_by_its_owner_only(server):
    path = server.state_dir / "api-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = server.api_token()
    assert token and len(token) >= 32
    assert httpx.get(f"{server.base}/api/v1/status").status_code == 401
    answer = httpx.get(f"{server.base}/api/v1/status", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200
    # the banner says how to sign in, with the token in a fragment (never sent, never logged)
    server.wait(lambda: "/signin#token=" in server.output(), "the start-up banner")
    assert f"sign in:  {server.base}/signin#token={token}" in server.output()
    assert f"?token={token}" not in server.output()


def _cli(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The command line in a new shell: nothing of gitops-sless in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLESS_")}
    return subprocess.run(
        [sys.executable, "-m", "gitops_sless", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=120,
    )


def test_the_cli_on_the_same_machine_finds_the_token_from_the_project_folder(project):
    server, folder = project
    below = folder / "functions" / "deep"
    below.mkdir(parents=True, exist_ok=True)
    status = _cli(below, "status", "--server", server.base)
    assert status.returncode in (0, 1), status.stderr  # 1: a function not Ready is fine
    assert "page" in status.stdout
    sync = _cli(folder, "sync", "--server", server.base, "--wait", "60")
    assert sync.returncode == 0, sync.stderr
    # elsewhere, nothing is found: the server says it needs a token
    elsewhere = _cli(folder.parent, "status", "--server", server.base)
    assert elsewhere.returncode == 2
    assert elsewhere.stderr.strip().endswith("set SLESS_READ_TOKEN or SLESS_API_TOKEN")


def test_a_token_found_by_walking_up_is_never_sent_to_another_host(project, monkeypatch):
    _, folder = project
    for name in [k for k in os.environ if k.startswith("SLESS_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(folder)
    args = Namespace(token=None, state_dir=None)
    found = (folder / ".sless-state" / "api-token").read_text().strip()
    assert api_token(args, "http://127.0.0.1:8080") == found
    assert api_token(args, "https://sless.example") is None
    # named on purpose, it is used for any server
    named = Namespace(token=None, state_dir=str(folder / ".sless-state"))
    assert api_token(named, "https://sless.example") == found


def test_the_token_is_reused_across_restarts(tmp_path):
    folder = tmp_path / "functions"
    folder.mkdir()
    (folder / "README.md").write_text("no functions yet\n")
    first = SlessServer(str(folder), tmp_path / "state", token=None)
    try:
        first.start()
        token = first.api_token()
    finally:
        first.stop()
    again = SlessServer(str(folder), tmp_path / "state", token=None)
    try:
        again.start()
        assert again.api_token() == token
        assert again.client.get("/api/v1/status").status_code == 200
    finally:
        again.stop()


# --- item 4: function pages never act as the dashboard --------------------------------


def test_a_function_never_receives_the_session_cookie_nor_the_servers_token(server, tabs):
    page = tabs.open(server.base, token=server.api_token())
    cookie = next(c for c in tabs.tab(page).context.cookies() if c["name"] == "sless_session")
    token = server.api_token()
    sent = {"Cookie": f"theme=dark; sless_session={cookie['value']}; lang=en"}
    seen = server.call("echo", headers={**sent, "Authorization": f"Bearer {token}"}).json()
    assert seen["headers"]["cookie"] == "theme=dark; lang=en"
    assert "authorization" not in seen["headers"]
    assert cookie["value"] not in json.dumps(seen) and token not in json.dumps(seen)
    # the function's own credentials are its own
    own = server.call("echo", headers={"Authorization": "Bearer the-functions-own-key"}).json()
    assert own["headers"]["authorization"] == "Bearer the-functions-own-key"


def _attack(tabs: Tabs, server: SlessServer, name: str) -> str:
    page = tabs.open(server.base, token=server.api_token())
    assert page.goto("/").ok  # signed in: the dashboard shows
    page.goto(f"/fn/prod/{name}/")
    # read from here, not with a predicate evaluated in the page: the function's own CSP
    # forbids eval there, which playwright's wait_for_function needs
    deadline = time.monotonic() + 30
    while not page.title().startswith("done"):
        assert time.monotonic() < deadline, f"the page never finished: {page.title()!r}"
        page.wait_for_timeout(50)
    return page.title()


def test_a_function_page_opened_by_a_signed_in_viewer_reads_nothing_with_the_session(server, tabs):
    reported = _attack(tabs, server, "page")
    assert "LEAKED" not in reported, reported
    for path in PATHS:
        assert f"{path}=blocked" in reported, reported


def test_every_function_response_is_sandboxed_and_its_own_policy_cannot_lift_it(server):
    answer = server.call("page")
    policies = answer.headers.get_list("content-security-policy")
    assert SANDBOX in policies and "default-src * 'unsafe-inline'" in policies
    assert SANDBOX in server.call("nope").headers.get_list("content-security-policy")  # 404


def test_same_origin_in_the_manifest_opts_out_and_the_page_then_acts_as_the_dashboard(server, tabs):
    assert "content-security-policy" not in server.call("trusted").headers
    # what the sandbox stops: the same page, unsandboxed, reads the dashboard's own page
    reported = _attack(tabs, server, "trusted")
    assert "/functions/prod/stamp=200:LEAKED" in reported, reported
    # though never the API: a session alone does not read /api/
    assert "/api/v1/environments/prod/jobs=401" in reported, reported


def test_the_banner_link_signs_in_and_the_dashboard_api_link_and_sign_out_work(server, tabs):
    token = server.api_token()
    page = tabs.open(server.base, token=None)
    page.goto(f"/signin#token={token}")
    page.wait_for_url(re.compile(r"/$"))
    assert page.locator("form.signout").is_visible()
    assert all(token not in url for url in tabs.tab(page).requests)  # never in a URL sent
    page.get_by_role("link", name="Status API").click()
    # read from here: the JSON opens in a page under the dashboard's CSP, which forbids the
    # eval that playwright's wait_for_function needs (a clean-clone run failed on it)
    deadline = time.monotonic() + 30
    while '"repository"' not in page.inner_text("body"):
        assert time.monotonic() < deadline, "the status JSON never showed"
        page.wait_for_timeout(50)
    page.goto("/")
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url(re.compile(r"/signin\?signed-out$"))
    assert not tabs.tab(page).problems, tabs.tab(page).problems
    assert page.goto("/").status == 401  # (the sign-in form)


# --- item 4: --fn-listen --------------------------------------------------------------


def test_fn_listen_serves_functions_on_their_own_origin_and_the_main_address_not(tmp_path):
    with GitDaemon(tmp_path / "served") as daemon:
        repo = Setup(tmp_path, daemon, tmp_path / "served")
        repo.push({"echo/sless.yaml": manifest("echo", HTTP), "echo/handler.py": ECHO})
        fn_port = free_port()
        server = SlessServer(
            repo.url, tmp_path / "state", args=["--fn-listen", f"127.0.0.1:{fn_port}"]
        )
        try:
            server.start()
            server.wait(lambda: (server.function("echo") or {}).get("phase") == "Ready", "echo")
            fn_base = f"http://127.0.0.1:{fn_port}"
            assert server.function("echo")["url"] == f"{fn_base}/fn/prod/echo/"
            moved = server.call("echo")
            assert moved.status_code == 404
            assert f"--fn-listen address: {fn_base}" in moved.json()["error"]
            assert httpx.get(f"{fn_base}/fn/prod/echo/").json()["headers"]
            assert httpx.get(f"{fn_base}/healthz").json() == {"status": "ok"}
            token = {"Authorization": f"Bearer {server.api_token()}"}
            for path in ("/api/v1/status", "/", "/signin", "/metrics"):
                assert httpx.get(f"{fn_base}{path}", headers=token).status_code == 404, path
        finally:
            server.stop()
