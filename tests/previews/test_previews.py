"""Pull-request previews end to end: ``serve --previews`` against a real git daemon.

Each test has its own bare repository (``acme/functions.git``, so that a forge
client can take owner/repo from its URL), a work tree that pushes the tracked
branch and ``refs/pull/N/head`` / ``refs/merge-requests/N/head``, and a real
server process. Passes of ``main`` come from ``POST /api/v1/sync?wait`` and
webhooks (the TTL and forge tests also poll every second). Previews run in
their own thread after each pass of ``main``: every check polls
``GET /api/v1/environments`` (or the proxy, ``/proc``, the forge imitation)
until the expected state, with a timeout.

Most of these tests are about what happens to a preview, not about whom it
trusts: they run with ``--preview-trust all``, so that a PR known from its ref
alone is previewed. Trust has its own tests (tests/previews/test_preview_trust.py).

Then :class:`gitops_sless.previews.environments.Previews` in process: with doubles, to pin
down faults the end-to-end tests show, and on the Kubernetes backend (the test
API server and a real S3 server).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from gitops_sless.kube.client import KubeClient
from gitops_sless.kube.connect import connect
from gitops_sless.kube.renderer import ENV_LABEL
from gitops_sless.previews.environments import PinnedSource, PreviewConfig, Previews
from gitops_sless.previews.forge import forge_for
from gitops_sless.previews.pulls import PullRequest
from gitops_sless.reconciler import Reconciler
from gitops_sless.source.mirror import Mirror
from gitops_sless.state.routes import RouteTable
from gitops_sless.state.store import Store

from .. import gitserver
from ..conftest import with_their_groups
from ..gitserver import GitDaemon, WorkRepo, git, init_bare
from ..kube_harness import settings as kube_settings
from ..kubeapi import FakeKube
from ..paths import DATA
from ..s3server import S3Server
from ..sless_server import WEBHOOK_SECRET, SlessServer
from .test_forge import Failure, FakeForge
from .test_forge import serve as serve_forge

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon

PAYLOADS = DATA / "webhooks"
REPO = "acme/functions.git"
CHANGED = "greet"  # the one http function; the others are disabled
FUNCTIONS = 50
TIMEOUT = 30.0


# --- the repository ---------------------------------------------------------------------


def handler(text: str) -> str:
    return (
        f"def main(event, context):\n    return {{'text': {text!r}, 'env': context.environment}}\n"
    )


def function(name: str, text: str, *extra: str) -> dict[str, str]:
    manifest = "\n".join(
        [
            "functions:",
            f"  - name: {name}",
            "    runtime: python3.11",
            "    entrypoint: handler.main",
            "    triggers: [{type: http}]",
            *extra,
        ]
    )
    return {f"{name}/sless.yaml": manifest + "\n", f"{name}/handler.py": handler(text)}


def repository(text: str, count: int = FUNCTIONS) -> dict[str, str]:
    """``greet`` answering ``text``, and ``count - 1`` disabled functions."""
    files = function(CHANGED, text)
    for i in range(count - 1):
        files.update(function(f"idle-{i:02d}", f"idle {i}", "    enabled: false"))
    return files


def change(text: str) -> dict[str, str]:
    """The one-function change a pull request makes."""
    return {f"{CHANGED}/handler.py": handler(text)}


class Setup:
    """A repository on the git daemon, a work tree, and the servers of one test."""

    def __init__(self, tmp_path: Path, daemon: GitDaemon, root: Path) -> None:
        (root / "acme").mkdir()
        init_bare(root / REPO)
        self.bare = root / REPO
        self.url = daemon.url(REPO)
        self.work = WorkRepo(tmp_path / "work")
        self.state = tmp_path / "state"
        self.tmp_path = tmp_path
        self.servers: list[SlessServer] = []

    def push_main(self, files: dict[str, str | None], message: str = "main") -> str:
        commit = self.work.commit(message, files)
        self.work.push(self.url)
        return commit

    def push_pull(
        self, number: int, files: dict[str, str | None], ref: str = "refs/pull/{}/head"
    ) -> str:
        """Commit ``files`` on the PR's branch (from main the first time) and push its ref."""
        branch = f"change-{number}"
        exists = self.work.git("branch", "--list", branch)
        self.work.git("checkout", "-q", *([branch] if exists else ["-b", branch, "main"]))
        try:
            commit = self.work.commit(f"PR {number}", files)
            self.work.push(self.url, ref.format(number))
        finally:
            self.work.git("checkout", "-q", "main")
        return commit

    def open(
        self,
        server: SlessServer,
        number: int,
        files: dict[str, str | None],
        ref: str = "refs/pull/{}/head",
    ) -> str:
        """Push the PR's ref, then a pass of main (which fetches it; previews follow)."""
        commit = self.push_pull(number, files, ref)
        server.sync()
        return commit

    def remote_refs(self) -> str:
        return git("for-each-ref", "--format=%(refname)", cwd=self.bare)

    def serve(
        self,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        poll_interval: float = 3600,
        trust: str = "all",
        secrets_dir: Path | None = None,
    ) -> SlessServer:
        """A server with --previews; passes come from ``sync()`` and webhooks unless a
        ``poll_interval`` is given (a pass in flight when a preview is closed may put its
        routes back for a moment: see test_delete_during_a_preview_pass_...)."""
        server = SlessServer(
            self.url,
            self.state,
            poll_interval=poll_interval,
            args=["--previews", "--preview-trust", trust, *(args or [])],
            env=env,
            secrets_dir=secrets_dir,
        )
        self.servers.append(server)
        return server.start()


@pytest.fixture
def setup(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[Setup]:
    s = Setup(tmp_path, git_daemon, git_root)
    yield s
    for server in s.servers:
        server.stop()


# --- what the server shows ----------------------------------------------------------------


def until(check: Callable[[], Any], what: str, server: SlessServer, timeout: float = TIMEOUT):
    """The first truthy value of ``check()``; fails with the server's log tail on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}:\n{server.output()[-4000:]}"
    )


def listing(server: SlessServer) -> dict[str, dict[str, Any]]:
    response = server.client.get("/api/v1/environments")
    assert response.status_code == 200, response.text
    return {env["name"]: env for env in response.json()}


def preview(server: SlessServer, number: int) -> dict[str, Any] | None:
    env = listing(server).get(f"pr-{number}")
    return env["preview"] if env else None


def in_state(server: SlessServer, number: int, state: str, head: str | None = None):
    """A check: the preview's row once it is in ``state`` (at ``head``)."""

    def check() -> dict[str, Any] | None:
        row = preview(server, number)
        if row and row["state"] == state and (head is None or row["head"] == head):
            return row
        return None

    return check


def answer(server: SlessServer, env: str, name: str = CHANGED) -> str | None:
    """What ``/fn/<env>/<name>/`` says, or None when it does not answer 200."""
    response = server.client.get(f"/fn/{env}/{name}/")
    return response.json()["text"] if response.status_code == 200 else None


def builds(server: SlessServer) -> float:
    """``sless_builds_total`` summed over its labels."""
    text = server.client.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sless_builds_total")
    )


def processes(state: Path, env: str) -> dict[int, str]:
    """Processes of ``env`` started by the server on ``state``: pid -> function.

    Runtimes, and the bwrap holding each in its sandbox (it has the runtime's environment).
    """
    environs, ours = {}, []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
            args = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        environ = dict(
            v.split("=", 1) for v in raw.decode(errors="replace").split("\0") if "=" in v
        )
        environs[int(entry.name)] = environ
        # unconfined, the runtime names its folder; sandboxed, the bwrap holding it does
        if environ.get("SLESS_FUNCTION_DIR", "").startswith(str(state)) or str(state) in args:
            ours.append(int(entry.name))
    found = {}
    for pid in with_their_groups(ours):
        environ = environs.get(pid, {})
        if environ.get("SLESS_ENV") == env:
            found[pid] = environ.get("SLESS_FUNCTION_NAME", "?")
    return found


def job_phase(server: SlessServer, env: str, name: str) -> str | None:
    response = server.client.get(f"/api/v1/environments/{env}/jobs")
    runs = response.json() if response.status_code == 200 else []
    return next((run["phase"] for run in runs if run["name"] == name), None)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


# --- webhooks -------------------------------------------------------------------------------


def payload(name: str) -> dict[str, Any]:
    return json.loads((PAYLOADS / name).read_text())


def github_pull(action: str, number: int, sha: str, title: str = "greet: v2") -> bytes:
    data = payload(
        {
            "opened": "github-pull-request-opened.json",
            "synchronize": "github-pull-request-synchronize.json",
            "closed": "github-pull-request-closed.json",
        }[action]
    )
    pr = data["pull_request"]
    data["number"] = pr["number"] = number
    pr["head"]["sha"] = sha
    pr["head"]["ref"] = f"change-{number}"
    pr["title"] = title
    return json.dumps(data).encode()


def send(
    server: SlessServer, forge: str, body: bytes, event: str, secret: str = WEBHOOK_SECRET
) -> httpx.Response:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    delivery = str(uuid.uuid4())  # each send is a new delivery, as the forge makes it
    headers = {
        "github": {
            "X-Hub-Signature-256": f"sha256={digest}",
            "X-GitHub-Event": event,
            "X-GitHub-Delivery": delivery,
        },
        "gitea": {
            "X-Gitea-Signature": digest,
            "X-Gitea-Event": event,
            "X-Gitea-Delivery": delivery,
        },
        "gitlab": {
            "X-Gitlab-Token": secret,
            "X-Gitlab-Event": event,
            "X-Gitlab-Event-UUID": delivery,
        },
    }[forge]
    return server.client.post(
        f"/api/v1/webhooks/{forge}",
        content=body,
        headers={**headers, "Content-Type": "application/json"},
    )


def another_pass_shows(setup: Setup, server: SlessServer, number: int) -> None:
    """Proof that previews passes ran: a new PR ref becomes a preview."""
    setup.open(server, number, change(f"witness {number}"))
    until(in_state(server, number, "Ready"), f"pr-{number} Ready", server)


# --- the tests ------------------------------------------------------------------------------


def test_a_one_function_change_in_50_functions_is_one_build_and_closes_by_webhook(setup):
    setup.push_main(repository("main v1"))
    server = setup.serve()
    assert answer(server, "prod") == "main v1"
    # the 49 disabled functions are built and deployed at zero replicas: listed as
    # Disabled with a build, 503 through the proxy, no process
    prod = server.client.get("/api/v1/environments/prod/functions").json()
    assert Counter(f["phase"] for f in prod) == {"Ready": 1, "Disabled": FUNCTIONS - 1}
    assert all(f["buildTag"] for f in prod)
    assert builds(server) == FUNCTIONS
    assert server.call("idle-00").status_code == 503
    assert set(processes(setup.state, "prod").values()) == {CHANGED}

    before = builds(server)
    head = setup.open(server, 7, change("pr v1"))
    row = until(in_state(server, 7, "Ready", head), "pr-7 Ready", server)
    assert builds(server) - before == 1
    assert answer(server, "pr-7") == "pr v1"
    assert answer(server, "prod") == "main v1"
    assert row["number"] == 7 and row["head"] == head
    # every declared http function has its URL there, the disabled ones (503) too
    assert f"{server.base}/fn/pr-7/{CHANGED}/" in row["urls"]
    assert len(row["urls"]) == FUNCTIONS
    env = listing(server)["pr-7"]
    assert env["functions"] == FUNCTIONS
    assert set(processes(setup.state, "pr-7").values()) == {CHANGED}

    # a push to the PR ref: the preview serves it, prod does not
    head2 = setup.push_pull(7, change("pr v2"))
    sync = github_pull("synchronize", 7, head2)
    assert send(server, "github", sync, "pull_request").status_code == 202
    until(lambda: answer(server, "pr-7") == "pr v2", "pr-7 serving v2", server)
    assert answer(server, "prod") == "main v1"
    until(in_state(server, 7, "Ready", head2), "pr-7 Ready at the new head", server)
    assert builds(server) - before == 2
    pids = processes(setup.state, "pr-7")

    # a wrongly signed close changes nothing
    closed = github_pull("closed", 7, head2)
    refused = send(server, "github", closed, "pull_request", secret="wrong")
    assert refused.status_code == 401
    assert answer(server, "pr-7") == "pr v2"
    assert preview(server, 7)["state"] == "Ready"

    accepted = send(server, "github", closed, "pull_request")
    assert accepted.status_code == 202, accepted.text
    assert server.client.get(f"/fn/pr-7/{CHANGED}/").status_code == 404
    until(lambda: "pr-7" not in listing(server), "pr-7 gone from the listing", server)
    until(lambda: not any(alive(pid) for pid in pids), "pr-7's processes gone", server)
    assert processes(setup.state, "pr-7") == {}
    assert server.function(CHANGED, "pr-7") is None
    # the ref is still there: further passes do not bring the preview back
    assert "refs/pull/7/head" in setup.remote_refs()
    another_pass_shows(setup, server, 8)
    assert "pr-7" not in listing(server)
    assert server.client.get(f"/fn/pr-7/{CHANGED}/").status_code == 404
    assert answer(server, "prod") == "main v1"


def test_gitlab_merge_request_ref_and_close_hook(setup):
    setup.push_main(repository("main", count=2))
    server = setup.serve()
    head = setup.open(server, 9, change("mr v1"), ref="refs/merge-requests/{}/head")
    until(in_state(server, 9, "Ready", head), "pr-9 Ready", server)
    assert answer(server, "pr-9") == "mr v1"

    data = payload("gitlab-merge-request-close.json")
    data["object_attributes"]["iid"] = 9
    data["object_attributes"]["last_commit"]["id"] = head
    body = json.dumps(data).encode()
    assert send(server, "gitlab", body, "Merge Request Hook", secret="wrong").status_code == 401
    assert answer(server, "pr-9") == "mr v1"
    response = send(server, "gitlab", body, "Merge Request Hook")
    assert response.status_code == 202, response.text
    assert server.client.get(f"/fn/pr-9/{CHANGED}/").status_code == 404
    until(lambda: "pr-9" not in listing(server), "pr-9 gone", server)
    until(lambda: not processes(setup.state, "pr-9"), "pr-9's processes gone", server)
    another_pass_shows(setup, server, 10)
    assert "pr-9" not in listing(server)


def test_gitea_and_github_opened_webhooks_list_title_and_author(setup):
    setup.push_main(repository("main", count=2))
    server = setup.serve()
    head = setup.push_pull(5, change("gitea v1"))
    data = payload("gitea-pull-request-opened.json")
    pr = data["pull_request"]
    data["number"] = pr["number"] = 5
    pr["head"]["sha"] = head
    pr["title"] = "greet: from gitea"
    body = json.dumps(data).encode()
    assert send(server, "gitea", body, "pull_request", secret="wrong").status_code == 401
    response = send(server, "gitea", body, "pull_request")
    assert response.status_code == 202, response.text
    # the row exists as soon as the webhook is answered
    row = preview(server, 5)
    assert row is not None
    assert (row["number"], row["title"], row["author"]) == (5, "greet: from gitea", "alice")
    assert row["state"] in ("Waiting", "Building", "Ready")
    row = until(in_state(server, 5, "Ready", head), "pr-5 Ready", server)
    assert (row["title"], row["author"]) == ("greet: from gitea", "alice")
    assert answer(server, "pr-5") == "gitea v1"

    head = setup.push_pull(6, change("github v1"))
    response = send(server, "github", github_pull("opened", 6, head, "from github"), "pull_request")
    assert response.status_code == 202, response.text
    row = until(in_state(server, 6, "Ready", head), "pr-6 Ready", server)
    assert (row["title"], row["author"]) == ("from github", "alice")
    assert answer(server, "pr-6") == "github v1"


def test_merged_by_a_fast_forward_of_main_without_webhook(setup):
    setup.push_main(repository("main v1", count=3))
    server = setup.serve()
    head = setup.open(server, 3, change("merged code"))
    until(in_state(server, 3, "Ready", head), "pr-3 Ready", server)
    pids = processes(setup.state, "pr-3")
    assert pids

    setup.work.git("merge", "-q", "--ff-only", "change-3")
    assert setup.work.head() == head
    setup.work.push(setup.url)
    assert server.sync()["revision"] == head
    assert answer(server, "prod") == "merged code"
    until(lambda: "pr-3" not in listing(server), "pr-3 torn down after the merge", server)
    until(lambda: not any(alive(pid) for pid in pids), "pr-3's processes gone", server)
    assert answer(server, "pr-3") is None
    assert answer(server, "prod") == "merged code"


def test_a_preview_with_no_new_commit_for_the_ttl_is_torn_down(setup):
    setup.push_main(repository("main", count=2))
    server = setup.serve(args=["--preview-ttl", "3s"], poll_interval=1)
    head = setup.push_pull(4, change("short-lived"))
    row = until(in_state(server, 4, "Ready", head), "pr-4 Ready", server)
    seen_ready = time.time()
    until(lambda: "pr-4" not in listing(server), "pr-4 expired", server, timeout=15)
    created = _seconds(row["created"])
    assert time.time() - created >= 3, "torn down before its TTL"
    assert answer(server, "pr-4") is None
    until(lambda: not processes(setup.state, "pr-4"), "pr-4's processes gone", server)
    assert seen_ready - created < 3  # it was Ready within its TTL, then went
    # a new commit brings an expired preview back
    head2 = setup.push_pull(4, change("back again"))
    until(in_state(server, 4, "Ready", head2), "pr-4 back at a new head", server)
    assert answer(server, "pr-4") == "back again"


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_max_previews_makes_the_next_one_wait_until_a_slot_frees(setup):
    setup.push_main(repository("main", count=2))
    server = setup.serve(args=["--max-previews", "1"])
    first = setup.open(server, 1, change("first"))
    until(in_state(server, 1, "Ready", first), "pr-1 Ready", server)
    setup.open(server, 2, change("second"))

    def waiting_with_reason() -> dict[str, Any] | None:
        # a new row is Waiting with no reason until the pass has looked at it
        row = preview(server, 2)
        return row if row and row["state"] == "Waiting" and row["reason"] else None

    row = until(waiting_with_reason, "pr-2 Waiting with a reason", server)
    assert "--max-previews 1" in row["reason"], row
    assert answer(server, "pr-2") is None
    assert answer(server, "pr-1") == "first"
    # once pr-1 goes, pr-2 gets its slot
    auth = {"Authorization": f"Bearer {server.token}"}
    assert server.client.delete("/api/v1/environments/pr-1", headers=auth).status_code == 202
    until(in_state(server, 2, "Ready"), "pr-2 Ready once pr-1 is gone", server)
    assert answer(server, "pr-2") == "second"


def test_delete_needs_the_token_and_tears_the_preview_down_at_once(setup):
    setup.push_main(repository("main", count=2))
    server = setup.serve()
    head = setup.open(server, 6, change("to delete"))
    until(in_state(server, 6, "Ready", head), "pr-6 Ready", server)
    pids = processes(setup.state, "pr-6")

    assert server.client.delete("/api/v1/environments/pr-6").status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert server.client.delete("/api/v1/environments/pr-6", headers=wrong).status_code == 401
    assert answer(server, "pr-6") == "to delete"

    auth = {"Authorization": f"Bearer {server.token}"}
    response = server.client.delete("/api/v1/environments/pr-6", headers=auth)
    assert response.status_code == 202, response.text
    assert server.client.get(f"/fn/pr-6/{CHANGED}/").status_code == 404
    until(lambda: "pr-6" not in listing(server), "pr-6 gone", server)
    until(lambda: not any(alive(pid) for pid in pids), "pr-6's processes gone", server)
    for env in ("pr-6", "pr-99", "prod", "staging"):
        response = server.client.delete(f"/api/v1/environments/{env}", headers=auth)
        assert response.status_code == 404, (env, response.text)
        assert response.json()["error"]
    another_pass_shows(setup, server, 11)
    assert "pr-6" not in listing(server)
    assert answer(server, "prod") == "main"


JOB_HANDLER = """
import time

def slow(event, context):
    time.sleep(float(event["seconds"]))
    return {"slept": event["seconds"]}
"""


def slow_job(seconds: float) -> dict[str, str]:
    return {
        "slow/handler.py": JOB_HANDLER,
        "slow/sless.yaml": (
            "functions:\n"
            "  - name: slow\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.slow\n"
            "    jobs:\n"
            f"      - {{name: settle, runId: 1, event: {{seconds: {seconds}}}}}\n"
        ),
    }


def test_delete_during_a_preview_pass_is_not_undone_by_that_pass(setup):
    """The DELETE lands while the preview's pass runs (a 4 s job): the pass must not revive it."""
    setup.push_main({**repository("main", count=2), **slow_job(0)})
    server = setup.serve()
    setup.open(server, 12, {**change("pr 12"), **slow_job(3)})
    # the sandboxed job can mark nothing on the host: the API says it runs
    until(lambda: job_phase(server, "pr-12", "settle") == "Running", "pr-12's job", server)
    auth = {"Authorization": f"Bearer {server.token}"}
    response = server.client.delete("/api/v1/environments/pr-12", headers=auth)
    assert response.status_code == 202, response.text
    until(lambda: "pr-12" not in listing(server), "pr-12 gone", server, timeout=15)
    another_pass_shows(setup, server, 13)
    assert "pr-12" not in listing(server), listing(server)["pr-12"]
    assert answer(server, "pr-12") is None
    assert processes(setup.state, "pr-12") == {}


def test_a_teardown_interrupted_by_sigkill_finishes_after_the_restart(setup):
    setup.push_main(repository("main", count=2))
    server = setup.serve()
    head = setup.open(server, 8, change("doomed"))
    until(in_state(server, 8, "Ready", head), "pr-8 Ready", server)
    pids = processes(setup.state, "pr-8")
    assert pids
    response = send(server, "github", github_pull("closed", 8, head), "pull_request")
    assert response.status_code == 202
    server.kill()

    second = setup.serve()
    until(lambda: answer(second, "prod") == "main", "prod serving again", second)
    until(lambda: "pr-8" not in listing(second), "pr-8 gone after the restart", second)
    until(lambda: not any(alive(pid) for pid in pids), "pr-8's old processes gone", second)
    assert processes(setup.state, "pr-8") == {}
    assert second.function(CHANGED, "pr-8") is None
    another_pass_shows(setup, second, 14)
    assert "pr-8" not in listing(second)
    assert answer(second, "pr-8") is None


def test_a_restart_keeps_a_preview_serving_its_last_good_version(setup):
    setup.push_main(repository("main", count=2))
    server = setup.serve()
    good = setup.open(server, 9, change("pr v1"))
    until(in_state(server, 9, "Ready", good), "pr-9 Ready", server)
    code = 'raise RuntimeError("broken at import")\n\n\ndef main(event):\n    return {}\n'
    broken = setup.open(server, 9, {f"{CHANGED}/handler.py": code})
    until(in_state(server, 9, "Failed", broken), "pr-9's new head to fail", server)
    assert answer(server, "pr-9") == "pr v1"
    server.stop()

    again = setup.serve()
    until(lambda: answer(again, "pr-9") == "pr v1", "pr-9's last good version again", again)
    status = again.function(CHANGED, "pr-9")
    assert status["phase"] == "Failed" and "RuntimeError" in status["message"]
    assert status["revision"] == good


# --- reporting to the forge -----------------------------------------------------------------


@pytest.fixture
def fake_github() -> Iterator[FakeForge]:
    fake, http = serve_forge("github")
    fake.token = "t"
    yield fake
    http.shutdown()
    http.server_close()


def github_listing(fake: FakeForge, number: int, sha: str) -> None:
    """The PR as GitHub's API lists it: open, at ``sha`` (what a push to it does there)."""
    with fake.lock:
        fake.pulls = [p for p in fake.pulls if p["number"] != number]
    fake.add_pull(number, origin="same")
    with fake.lock:
        fake.pulls[-1]["head"]["sha"] = sha
        fake.pulls[-1]["head"]["ref"] = f"change-{number}"


def statuses(fake: FakeForge, sha: str) -> list[dict[str, Any]]:
    with fake.lock:
        return [body for s, body in fake.statuses if s == sha]


def comments(fake: FakeForge, number: int) -> list[dict[str, Any]]:
    with fake.lock:
        return [dict(c) for c in fake.comments.get(number, [])]


def test_forge_for_takes_owner_and_repo_from_any_url_with_kind_github():
    client = forge_for(
        "git://127.0.0.1:9418/acme/functions.git", "t", "http://127.0.0.1:1", "github"
    )
    try:
        assert repr(client) == "<github forge acme/functions>"
    finally:
        client.close()


def serve_with_forge(setup: Setup, fake: FakeForge) -> SlessServer:
    """Polling every second: the forge's list of open PRs is then read every 15 s."""
    return setup.serve(
        args=["--forge", "github", "--forge-api", fake.url, "--instance-name", "ci-previews"],
        env={"SLESS_FORGE_TOKEN": "t"},
        poll_interval=1,
    )


def listed_pull(setup: Setup, fake: FakeForge, number: int, text: str) -> str:
    """Push the PR's ref and list it on the forge (before the server's first poll)."""
    head = setup.push_pull(number, change(text))
    github_listing(fake, number, head)
    return head


def opened(server: SlessServer, number: int, head: str) -> None:
    response = send(server, "github", github_pull("opened", number, head), "pull_request")
    assert response.status_code == 202, response.text


def new_commit(setup: Setup, server: SlessServer, fake: FakeForge, number: int, text: str) -> str:
    """A new commit on the PR: its ref, the forge's listing and the synchronize webhook."""
    head = setup.push_pull(number, change(text))
    github_listing(fake, number, head)
    sync = github_pull("synchronize", number, head)
    assert send(server, "github", sync, "pull_request").status_code == 202
    return head


def reported(fake: FakeForge, sha: str, server: SlessServer, timeout: float = TIMEOUT) -> None:
    """Wait for the success status of ``sha``."""
    until(
        lambda: [s["state"] for s in statuses(fake, sha)][-1:] == ["success"],
        f"a success status for {sha[:12]}",
        server,
        timeout,
    )


def test_statuses_in_order_and_one_comment_edited_in_place(setup, fake_github):
    fake = fake_github
    setup.push_main(repository("main v1", count=2))
    head = listed_pull(setup, fake, 7, "pr v1")
    server = serve_with_forge(setup, fake)
    opened(server, 7, head)
    marker = "<!-- gitops-sless:ci-previews -->"
    url = f"{server.base}/fn/pr-7/{CHANGED}/"
    until(in_state(server, 7, "Ready", head), "pr-7 Ready", server)
    assert answer(server, "pr-7") == "pr v1"
    reported(fake, head, server)
    # the status goes first, then the comment (reporter.py): wait for the comment's edit
    until(lambda: url in "".join(c["body"] for c in comments(fake, 7)), "the comment", server)
    sent = statuses(fake, head)
    assert {s["context"] for s in sent} == {"ci-previews"}
    states = [s["state"] for s in sent]
    assert states == sorted(states, key=["pending", "success"].index), states  # never back
    assert sent[-1]["target_url"] == f"{server.base}/fn/pr-7/"
    [comment] = comments(fake, 7)
    assert comment["body"].startswith(marker) and url in comment["body"]
    assert head[:12] in comment["body"]

    # the next push: its own statuses, and the same comment edited in place (within the
    # next read of the forge's list: until then its older head holds the preview, see
    # test_while_the_forge_refuses_...)
    head2 = new_commit(setup, server, fake, 7, "pr v2")
    until(lambda: answer(server, "pr-7") == "pr v2", "pr-7 serving v2", server)
    reported(fake, head2, server)
    until(lambda: head2[:12] in comments(fake, 7)[0]["body"], "the comment edited", server)
    [edited] = comments(fake, 7)
    assert edited["id"] == comment["id"] and url in edited["body"]
    assert any(c.method == "PATCH" and "/issues/comments/" in c.path for c in fake.calls)
    posts = [c for c in fake.calls if c.method == "POST" and c.path.endswith("/7/comments")]
    assert len(posts) == 1
    assert {s["context"] for s in statuses(fake, head2)} == {"ci-previews"}


def test_a_pending_status_comes_before_success(setup, fake_github):
    """What the PR page shows while the preview builds: pending, then success."""
    fake = fake_github
    setup.push_main(repository("main v1", count=2))
    head = listed_pull(setup, fake, 7, "pr v1")
    server = serve_with_forge(setup, fake)
    opened(server, 7, head)
    until(in_state(server, 7, "Ready", head), "pr-7 Ready", server)
    reported(fake, head, server)
    assert [s["state"] for s in statuses(fake, head)] == ["pending", "success"]


def test_while_the_forge_refuses_reconciling_goes_on_and_reporting_catches_up(setup, fake_github):
    fake = fake_github
    setup.push_main(repository("main v1", count=2))
    head = listed_pull(setup, fake, 7, "pr v1")
    server = serve_with_forge(setup, fake)
    opened(server, 7, head)
    until(in_state(server, 7, "Ready", head), "pr-7 Ready", server)
    reported(fake, head, server)
    until(lambda: comments(fake, 7), "the comment", server)

    # the forge answers 403 (statuses, comments) and 429 (the list of open PRs) for a while
    with fake.lock:
        fake.failures.append(Failure("GET", "/pulls", 429, {}, 10_000))
        for method in ("GET", "POST", "PATCH"):
            fake.failures.append(Failure(method, "/", 403, {}, 10_000))
    head2 = new_commit(setup, server, fake, 7, "pr v2")
    setup.push_main(change("main v2"))
    push = json.dumps({"ref": "refs/heads/main"}).encode()
    assert send(server, "github", push, "push").status_code == 202
    until(lambda: answer(server, "prod") == "main v2", "prod serving main v2", server, 10)
    until(lambda: answer(server, "pr-7") == "pr v2", "pr-7 serving v2", server, 10)
    until(in_state(server, 7, "Ready", head2), "pr-7 Ready at the new head", server, 10)
    until(
        lambda: any(c.method == "POST" and head2 in c.path for c in fake.calls),
        "a refused status call",
        server,
    )
    assert statuses(fake, head2) == []

    # the forge is back: reporting catches up
    with fake.lock:
        fake.failures.clear()
    reported(fake, head2, server, timeout=60)
    until(lambda: head2[:12] in comments(fake, 7)[0]["body"], "the comment caught up", server)
    assert len(comments(fake, 7)) == 1


def test_a_pr_opened_after_the_last_forge_poll_is_not_closed_by_that_poll(setup, fake_github):
    """The forge's list of open PRs is polled now and then; a webhook is newer than it."""
    fake = fake_github
    setup.push_main(repository("main", count=2))
    server = serve_with_forge(setup, fake)
    until(lambda: any(c.path.endswith("/pulls") for c in fake.calls), "a forge poll", server)
    head = setup.push_pull(15, change("new PR"))
    github_listing(fake, 15, head)  # GitHub lists it from now on; the server polled before
    opened = github_pull("opened", 15, head)
    assert send(server, "github", opened, "pull_request").status_code == 202
    until(in_state(server, 15, "Ready", head), "pr-15 Ready", server, timeout=10)
    assert answer(server, "pr-15") == "new PR"


def delete_ref(setup: Setup, number: int) -> None:
    """The PR's ref leaves the remote (what a plain git host does when a PR goes)."""
    git("update-ref", "-d", f"refs/pull/{number}/head", cwd=setup.bare)
    assert f"refs/pull/{number}/head" not in setup.remote_refs()


def test_a_deleted_pr_ref_closes_its_preview_when_nothing_else_can_tell(setup):
    # no forge token, no webhook: the ref is all that says the PR is open
    setup.push_main(repository("main", count=2))
    server = setup.serve()
    head = setup.open(server, 8, change("pr 8"))
    until(in_state(server, 8, "Ready", head), "pr-8 Ready", server)
    assert answer(server, "pr-8") == "pr 8"
    pids = processes(setup.state, "pr-8")
    assert pids

    delete_ref(setup, 8)
    server.sync()  # fetches, with the deleted ref pruned; previews follow
    until(lambda: "pr-8" not in listing(server), "pr-8 gone from the listing", server)
    assert server.client.get(f"/fn/pr-8/{CHANGED}/").status_code == 404
    until(lambda: not any(alive(pid) for pid in pids), "pr-8's processes gone", server)
    assert server.function(CHANGED, "pr-8") is None
    assert answer(server, "prod") == "main"
    # other passes do not bring it back; the ref coming back does
    another_pass_shows(setup, server, 11)
    assert "pr-8" not in listing(server)
    head = setup.open(server, 8, change("pr 8 again"))
    until(in_state(server, 8, "Ready", head), "pr-8 back with its ref", server)
    assert answer(server, "pr-8") == "pr 8 again"


def test_with_a_forge_a_deleted_ref_alone_does_not_close_an_open_pr(setup, fake_github):
    setup.push_main(repository("main", count=2))
    head = listed_pull(setup, fake_github, 8, "pr 8")
    server = serve_with_forge(setup, fake_github)
    until(in_state(server, 8, "Ready", head), "pr-8 Ready", server)

    delete_ref(setup, 8)
    server.sync()
    another_pass_shows(setup, server, 12)  # passes ran after the ref was gone
    row = preview(server, 8)
    assert row is not None and (row["state"], row["head"]) == ("Ready", head), row
    assert answer(server, "pr-8") == "pr 8"


# --- Previews in process, with doubles: the same faults, pinned down ------------------------

OLD, NEW = "a" * 40, "b" * 40
TRACKED = "c" * 40


class MirrorDouble:
    def __init__(self) -> None:
        self.heads: dict[int, str] = {}

    def head(self) -> str:
        return TRACKED

    def snapshot(self, commit: str | None = None) -> Any:
        return commit

    def preview_heads(self) -> dict[int, str]:
        return dict(self.heads)

    def is_ancestor(self, commit: str, of: str) -> bool:
        return commit == of


class ReconcilerDouble:
    """Records the commit of each pass; ``during`` runs in the middle of a pass."""

    def __init__(self, env: str, source: PinnedSource) -> None:
        self.env, self.source = env, source
        self.synced: list[str] = []
        self.during: Callable[[], None] | None = None

    def sync(self, trigger: str) -> Any:
        self.synced.append(self.source.commit)
        if self.during is not None:
            self.during()
        return SimpleNamespace(error=None, result="Succeeded")

    def busy(self) -> bool:
        return False

    def stop(self) -> None:
        pass


class BackendDouble:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove(self, env: str, name: str) -> None:
        pass

    def remove_environment(self, env: str) -> None:
        self.removed.append(env)


class ForgeDouble:
    def __init__(self, pulls: list[PullRequest], writers: tuple[str, ...] = ()) -> None:
        self.pulls = pulls
        self.writers = writers

    def open_pulls(self) -> list[PullRequest]:
        return list(self.pulls)

    def pull(self, number: int) -> PullRequest | None:
        return next((p for p in self.pulls if p.number == number), None)

    def can_write(self, user: str, user_id: int | None = None) -> bool:
        return user in self.writers


class ReporterDouble:
    def __init__(self) -> None:
        self.reports: list[tuple[int, str, str]] = []
        self.said: list[Any] = []  # the PreviewReports

    def report_preview(self, number: int, preview: Any) -> None:
        self.reports.append((number, preview.sha, preview.forge_state))
        self.said.append(preview)


@pytest.fixture
def doubles(tmp_path: Path) -> Iterator[SimpleNamespace]:
    store = Store(tmp_path / "status.db")
    made: dict[int, ReconcilerDouble] = {}

    def make(env: str, source: PinnedSource) -> Any:
        made[int(env[3:])] = ReconcilerDouble(env, source)
        return made[int(env[3:])]

    kit = SimpleNamespace(
        mirror=MirrorDouble(), backend=BackendDouble(), store=store, routes=RouteTable(), made=made
    )

    def previews(config: PreviewConfig | None = None, **options: Any) -> Previews:
        config = config or PreviewConfig(trust="all")  # refs alone open previews here
        kit.previews = Previews(kit.mirror, kit.backend, store, kit.routes, config, make, **options)
        return kit.previews

    kit.make = previews
    yield kit
    if hasattr(kit, "previews"):
        kit.previews.stop()
    store.close()


def next_pass(previews: Previews, action: Callable[[], None]) -> None:
    """Do ``action`` (which asks for a pass) and wait for a pass that started after it."""
    before = previews.passes
    action()
    assert previews.wait_for_pass(before, 10), "no previews pass"
    # a pass already under way when the action came may not have seen it: one more
    before = previews.passes
    previews.request()
    assert previews.wait_for_pass(before, 10), "no previews pass"


def test_delete_in_the_middle_of_a_preview_pass_is_kept(doubles):
    """previews.py ``_converge`` sets the state after ``reconciler.sync`` returns, over a
    ``TearingDown`` that ``delete`` (or a close webhook) wrote during that sync."""
    doubles.mirror.heads[9] = OLD
    previews = doubles.make()
    previews.run_pass()  # creates the row (Waiting) and the preview
    assert doubles.store.preview(9)["state"] == "Ready"
    doubles.mirror.heads[9] = NEW  # a new commit: the next pass syncs it
    doubles.made[9].during = lambda: previews.delete(9)
    previews.run_pass()
    assert doubles.store.preview(9)["state"] in ("TearingDown", "Closed")
    previews.run_pass()
    assert doubles.store.preview(9)["state"] == "Closed"
    assert "pr-9" in doubles.backend.removed


def test_a_webhook_newer_than_the_forges_list_is_not_overridden_by_it(doubles):
    """previews.py ``_observe``: ``head = pr.head_sha or ref_head``: the forge's list,
    read every max(poll, 15) s, wins over a newer synchronize webhook and the fetched ref."""
    doubles.mirror.heads[7] = OLD
    forge = ForgeDouble([PullRequest(7, "open", OLD, "main")])
    previews = doubles.make(forge=forge, forge_interval_sec=3600)
    next_pass(previews, previews.start)
    assert doubles.made[7].synced[-1] == OLD
    # a push to the PR: the ref and the webhook say NEW, the list read an hour ago says OLD
    doubles.mirror.heads[7] = NEW
    next_pass(previews, lambda: previews.on_event(PullRequest(7, "open", NEW, "main")))
    assert doubles.store.preview(7)["head"] == NEW
    assert doubles.made[7].synced[-1] == NEW


def test_a_pr_opened_after_the_forges_list_was_read_stays_open(doubles):
    """previews.py ``_observe``: a row the webhook marked ``forge_open=1`` that the last
    list (read before the PR existed) lacks is taken as closed and torn down."""
    previews = doubles.make(forge=ForgeDouble([]), forge_interval_sec=3600)
    next_pass(previews, previews.start)
    doubles.mirror.heads[15] = NEW
    next_pass(previews, lambda: previews.on_event(PullRequest(15, "open", NEW, "main")))
    row = doubles.store.preview(15)
    assert (row["state"], row["reason"]) == ("Ready", None), row
    # every pass converges it again (cheap when nothing changed); it was never torn down
    assert set(doubles.made[15].synced) == {NEW}
    assert "pr-15" not in doubles.backend.removed


def test_a_pending_report_goes_out_before_the_preview_pass(doubles):
    """previews.py ``_report`` runs only after ``reconciler.sync``: the forge never hears
    'pending' while a preview builds, only its outcome."""
    reporter = ReporterDouble()
    doubles.mirror.heads[7] = NEW
    previews = doubles.make(reporter=reporter)
    seen: list[list[tuple[int, str, str]]] = []

    def make_with_probe(env: str, source: PinnedSource) -> Any:
        reconciler = ReconcilerDouble(env, source)
        reconciler.during = lambda: seen.append(list(reporter.reports))
        return reconciler

    previews.make_reconciler = make_with_probe
    previews.run_pass()
    assert seen == [[(7, NEW, "pending")]]
    assert reporter.reports == [(7, NEW, "pending"), (7, NEW, "success")]


def test_a_pr_known_from_its_ref_alone_closes_when_the_ref_goes_and_opens_when_back(doubles):
    doubles.mirror.heads[8] = NEW
    previews = doubles.make()
    previews.run_pass()
    assert doubles.store.preview(8)["state"] == "Ready"
    del doubles.mirror.heads[8]
    previews.run_pass()
    row = doubles.store.preview(8)
    assert (row["state"], row["reason"]) == ("Closed", "ref deleted")
    assert "pr-8" in doubles.backend.removed
    previews.run_pass()  # stays closed
    assert doubles.store.preview(8)["state"] == "Closed"
    doubles.mirror.heads[8] = NEW  # the same head, pushed again
    previews.run_pass()
    assert doubles.store.preview(8)["state"] == "Ready"


@pytest.mark.parametrize("told_by", ["webhook", "forge"])
def test_a_vanished_ref_does_not_close_a_pr_a_webhook_or_the_forge_spoke_of(doubles, told_by):
    doubles.mirror.heads[8] = NEW
    if told_by == "forge":
        previews = doubles.make(forge=ForgeDouble([PullRequest(8, "open", NEW, "main")]))
        next_pass(previews, previews.start)
    else:
        previews = doubles.make()
        previews.on_event(PullRequest(8, "open", NEW, "main"))
        previews.run_pass()
    assert doubles.store.preview(8)["state"] == "Ready"
    del doubles.mirror.heads[8]
    previews.run_pass()
    assert doubles.store.preview(8)["state"] == "Ready"
    assert "pr-8" not in doubles.backend.removed


# --- the Kubernetes backend, in process -----------------------------------------------------


class _Recorded:
    """A Previews' reconciler factory keeping what it made, to stop them at the end."""

    def __init__(self, backend: Any, store: Store, routes: RouteTable) -> None:
        self.backend, self.store, self.routes = backend, store, routes
        self.made: list[Reconciler] = []

    def __call__(self, env: str, source: PinnedSource) -> Reconciler:
        reconciler = Reconciler(
            source, self.backend, self.store, env=env, routes=self.routes, workers=4
        )
        self.made.append(reconciler)
        return reconciler


def test_kubernetes_preview_namespace_is_made_and_deleted_on_close(
    fake_kube: FakeKube, s3_server: S3Server, tmp_path: Path
):
    KubeClient.from_config(str(fake_kube.kubeconfig), calls=None).create(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gitops-sless"}}
    )
    bare = init_bare(tmp_path / "origin.git")
    work = WorkRepo(tmp_path / "work")
    work.commit("main", repository("main", count=2))
    work.push(str(bare))
    work.git("checkout", "-q", "-b", "change-21")
    head = work.commit("PR 21", change("pr 21"))
    work.push(str(bare), "refs/pull/21/head")

    routes = RouteTable()
    backend = connect(kube_settings(fake_kube.kubeconfig, s3_server.config()), routes)
    backend.builds.poll_sec = 0.2
    store = Store(tmp_path / "state" / "status.db")
    mirror = Mirror(str(bare), "main", tmp_path / "state" / "mirror.git", preview_refs=True)
    mirror.fetch()
    made = _Recorded(backend, store, routes)
    previews = Previews(mirror, backend, store, routes, PreviewConfig(trust="all"), made)
    try:
        previews.run_pass()
        row = store.preview(21)
        assert row is not None and row["head"] == head, row
        assert row["state"] in ("Ready", "Building"), row
        namespace = fake_kube.get("Namespace", None, "sless-pr-21")
        assert namespace is not None
        labels = namespace["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "gitops-sless"
        assert labels[ENV_LABEL] == "pr-21"
        assert fake_kube.objects("NetworkPolicy", "sless-pr-21")
        assert {d["metadata"]["name"] for d in fake_kube.objects("Deployment", "sless-pr-21")} >= {
            CHANGED
        }
        assert fake_kube.get("Namespace", None, "sless-prod") is None  # only the preview's

        previews.on_event(PullRequest(21, "closed", head, "main"))
        assert routes.get("pr-21", CHANGED) is None
        previews.run_pass()
        assert fake_kube.get("Namespace", None, "sless-pr-21") is None
        assert fake_kube.objects("Deployment", "sless-pr-21") == []
        assert store.functions("pr-21") == []
        assert [r["state"] for r in store.previews()] == ["Closed"]
        assert previews.listing() == []
        previews.run_pass()  # the ref is still there: it does not come back
        assert fake_kube.get("Namespace", None, "sless-pr-21") is None
        assert previews.listing() == []
    finally:
        previews.stop()
        for reconciler in made.made:
            reconciler.stop()
        backend.close()
        store.close()


def test_a_preview_whose_functions_wait_for_a_secret_waits_then_serves_once_it_is_given(setup):
    """A function waiting for a preview secret that is not there holds its preview in
    Waiting (naming it), not Building forever; writing the secret makes it Ready, no push."""
    setup.push_main(repository("main", count=2))
    preview_secrets = setup.tmp_path / "preview-secrets"
    preview_secrets.mkdir()
    server = setup.serve(args=["--preview-secrets-dir", str(preview_secrets)], poll_interval=1)
    needs = function(
        "needs-db",
        "needs",
        "    preview: {env: {DSN: {secret: db-preview, key: dsn}}}",
    )
    head = setup.open(server, 4, {**change("v4"), **needs})
    waits = in_state(server, 4, "Waiting", head)
    row = until(lambda: (row := waits()) and row["reason"] and row, "pr-4 waits", server)
    assert row["reason"] == "needs-db is Pending"
    assert answer(server, "pr-4") == "v4"  # the rest of the preview serves meanwhile
    (preview_secrets / "db-preview").mkdir()
    (preview_secrets / "db-preview" / "dsn").write_text("postgres://preview\n")
    until(in_state(server, 4, "Ready", head), "pr-4 Ready once the secret exists", server)
    assert answer(server, "pr-4", "needs-db") == "needs"


def test_a_preview_scales_to_zero_by_default_and_production_keeps_its_replica(setup):
    setup.push_main(repository("main", count=2))
    server = setup.serve()
    head = setup.open(server, 4, change("pr v1"))
    until(in_state(server, 4, "Ready", head), "pr-4 Ready", server)
    preview_fn = server.function(CHANGED, "pr-4")
    # neither replicas nor scale in the manifest: min 0 in previews, one fixed in production
    assert (preview_fn["scaling"]["min"], preview_fn["scaling"]["max"]) == (0, 1)
    assert preview_fn["scaling"]["idleSec"] == 300
    assert server.function(CHANGED)["scaling"] is None
    assert answer(server, "pr-4") == "pr v1"
