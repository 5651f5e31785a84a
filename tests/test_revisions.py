"""Revisions end to end: every deploy numbered, the newest kept runnable at URLs of their
own, a rollback that switches at once and pins the function until a commit changes it or
an unpin, what a restart keeps, and what garbage collection may take.

A real ``gitops-sless serve`` follows a repository on a git daemon, with real python
runtimes in bubblewrap.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import gitserver
from .conftest import processes_under
from .gitserver import GitDaemon
from .sless_server import TOKEN, ServedRepo, SlessServer

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon

# a token made when the module loads: the same token is the same process
HANDLER = (
    "import uuid\n"
    "TOKEN = uuid.uuid4().hex\n"
    "def main(event):\n"
    "    return {{'version': {version!r}, 'token': TOKEN}}\n"
)
REVISIONS = "/api/v1/environments/prod/functions/{name}/revisions"
ROLLBACK = "/api/v1/environments/prod/functions/{name}/rollback"
UNPIN = "/api/v1/environments/prod/functions/{name}/unpin"
WRITE = {"Authorization": f"Bearer {TOKEN}"}
SLOW_IMPORT_SEC = 6


def function(name: str, version: str, *manifest: str) -> dict[str, str]:
    return {
        f"{name}/handler.py": HANDLER.format(version=version),
        f"{name}/sless.yaml": "\n".join(
            [
                "functions:",
                f"  - name: {name}",
                "    runtime: python3.11",
                "    entrypoint: handler.main",
                "    triggers: [{type: http}]",
                *manifest,
            ]
        )
        + "\n",
    }


@pytest.fixture
def repo(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[ServedRepo]:
    served = ServedRepo(tmp_path, git_daemon, git_root)
    yield served
    served.close()


def call(server: SlessServer, path: str) -> tuple[int, dict]:
    response = server.client.get(f"/fn/prod/{path}/")
    return response.status_code, response.json()


def version(server: SlessServer, path: str) -> tuple[int, str | dict]:
    status, body = call(server, path)
    return status, body["version"] if status == 200 else body


def listing(server: SlessServer, name: str) -> dict:
    response = server.client.get(REVISIONS.format(name=name))
    assert response.status_code == 200, response.text
    return response.json()


def deploy(repo: ServedRepo, server: SlessServer, files: dict[str, str]) -> None:
    repo.push(files)
    server.sync()


def test_every_deploy_is_a_numbered_revision_reached_at_a_url_of_its_own(repo):
    repo.push(function("hello", "v1"))
    server = repo.server().start()
    deploy(repo, server, function("hello", "v2"))
    deploy(repo, server, function("hello", "v3"))

    found = listing(server, "hello")
    assert found["serving"] == "r3" and found["pinned"] is None
    assert [r["revision"] for r in found["revisions"]] == ["r3", "r2", "r1"]
    assert [r["state"] for r in found["revisions"]] == ["serving", "kept", "kept"]
    assert [r["traffic"] for r in found["revisions"]] == [100, 0, 0]
    assert len({r["commit"] for r in found["revisions"]}) == 3
    assert len({r["id"] for r in found["revisions"]}) == 3
    r1 = found["revisions"][2]
    assert r1["replicas"] == 0  # kept, not running: its first call starts it
    assert r1["url"].endswith("/fn/prod/hello@r1/")
    assert server.function("hello")["servingRevision"] == "r3"

    # the main URL serves the newest; each revision's own URL reaches it, by number or id
    assert version(server, "hello") == (200, "v3")
    assert version(server, "hello@r1") == (200, "v1")
    assert version(server, f"hello@{r1['id']}") == (200, "v1")
    assert version(server, "hello@r2") == (200, "v2")
    assert version(server, "hello@r3") == (200, "v3")
    assert version(server, "hello") == (200, "v3")  # still: calling r1 changed nothing
    assert listing(server, "hello")["revisions"][2]["replicas"] == 1  # warm now

    # one that is not kept is a 404 that says which are
    status, body = version(server, "hello@r9")
    assert status == 404 and "r3, r2, r1" in body["error"], body
    assert version(server, "nobody@r1")[0] == 404

    # the same version deployed again is the same revision, not a new one
    deploy(repo, server, function("hello", "v1"))
    found = listing(server, "hello")
    assert found["serving"] == "r1"
    assert [r["revision"] for r in found["revisions"]] == ["r3", "r2", "r1"]


def test_a_rollback_switches_at_once_and_pins_until_a_commit_changes_the_function(repo):
    repo.push({**function("hello", "v1"), **function("other", "o1")})
    server = repo.server().start()
    deploy(repo, server, function("hello", "v2"))
    assert version(server, "hello") == (200, "v2")
    status, warm = call(server, "hello@r1")  # warm: the switch needs no start
    assert status == 200 and warm["version"] == "v1"

    response = server.client.post(ROLLBACK.format(name="hello"), headers=WRITE)
    assert response.status_code == 200, response.text
    # answered once the switch is made: the very next call gets the old code, from the
    # replica that was warm (switched to, not started again)
    assert call(server, "hello") == (200, warm)
    found = response.json()
    assert found["serving"] == "r1"
    assert found["pinned"]["revision"] == "r1" and found["pinned"]["by"] == "api"
    assert server.function("hello")["pinned"] == "r1"
    assert "function.rollback" in server.output()
    assert any(s["trigger"] == "rollback by api" for s in server.syncs())
    metrics = server.client.get("/metrics").text
    assert 'sless_revision_switches_total{action="rollback",by="api",env="prod",' in metrics

    # passes leave it where it was put, and so does a commit that changes another function
    server.sync()
    deploy(repo, server, function("other", "o2"))
    assert version(server, "other") == (200, "o2")
    assert version(server, "hello") == (200, "v1")
    assert server.function("hello")["pinned"] == "r1"

    # a commit that changes it unpins it: a new revision serves
    deploy(repo, server, function("hello", "v3"))
    assert version(server, "hello") == (200, "v3")
    found = listing(server, "hello")
    assert found["serving"] == "r3" and found["pinned"] is None
    assert "a commit changed it" in server.output()


def test_a_rollback_to_a_revision_at_zero_starts_it_before_answering(repo):
    repo.push(function("hello", "v1"))
    server = repo.server().start()
    deploy(repo, server, function("hello", "v2"))
    assert listing(server, "hello")["revisions"][1]["replicas"] == 0

    response = server.client.post(
        ROLLBACK.format(name="hello"), headers=WRITE, json={"to": "r1"}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert version(server, "hello") == (200, "v1")


def test_rollback_refusals_say_why(repo):
    repo.push(function("hello", "v1"))
    server = repo.server().start()
    post = server.client.post
    # nothing earlier to go back to
    response = post(ROLLBACK.format(name="hello"), headers=WRITE)
    assert response.status_code == 409 and "no revision before r1" in response.text
    response = post(ROLLBACK.format(name="hello"), headers=WRITE, json={"to": "r7"})
    assert response.status_code == 404 and "kept: r1" in response.text
    response = post(ROLLBACK.format(name="nobody"), headers=WRITE)
    assert response.status_code == 404
    # a write: the read token is not enough, and no token at all is a 401
    response = post(ROLLBACK.format(name="hello"), headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    response = post(UNPIN.format(name="hello"), headers=WRITE)
    assert response.status_code == 409 and "not pinned" in response.text
    assert version(server, "hello") == (200, "v1")


def test_unpin_lets_the_next_pass_deploy_what_git_says(repo):
    repo.push(function("hello", "v1"))
    server = repo.server().start()
    deploy(repo, server, function("hello", "v2"))
    assert server.client.post(ROLLBACK.format(name="hello"), headers=WRITE).status_code == 200
    assert version(server, "hello") == (200, "v1")

    response = server.client.post(UNPIN.format(name="hello"), headers=WRITE)
    assert response.status_code == 200, response.text
    server.wait(lambda: version(server, "hello") == (200, "v2"), "git's version again")
    assert listing(server, "hello")["pinned"] is None
    assert "function.unpin" in server.output()


def test_cli_rollback_and_unpin(repo):
    repo.push(function("hello", "v1"))
    server = repo.server().start()
    deploy(repo, server, function("hello", "v2"))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "gitops_sless", *args, "--server", server.base]
        env = {"SLESS_API_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"}
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)

    done = cli("rollback", "prod/hello", "--to", "r1")
    assert done.returncode == 0, done.stderr
    assert "r1" in done.stdout and "pinned" in done.stdout
    assert version(server, "hello") == (200, "v1")
    shown = cli("revisions", "prod/hello")
    assert shown.returncode == 0, shown.stderr
    assert "pinned at r1" in shown.stdout and "r2" in shown.stdout
    status = cli("status", "--env", "prod")
    line = next(x for x in status.stdout.splitlines() if x.startswith("hello"))
    assert " r1 " in line and "pinned at r1 by a rollback" in line, status.stdout

    refused = cli("rollback", "prod/hello", "--to", "r5")
    assert refused.returncode != 0 and "no revision r5" in refused.stderr

    done = cli("unpin", "prod/hello")
    assert done.returncode == 0, done.stderr
    server.wait(lambda: version(server, "hello") == (200, "v2"), "git's version again")


@pytest.mark.parametrize("how", ["in place", "stop and start"])
def test_revisions_and_pins_outlive_a_restart(repo, how):
    repo.push(function("hello", "v1"))
    server = repo.server().start()
    deploy(repo, server, function("hello", "v2"))
    assert server.client.post(ROLLBACK.format(name="hello"), headers=WRITE).status_code == 200
    assert version(server, "hello@r2") == (200, "v2")  # r2 warm across an in-place restart
    if how == "in place":
        from .test_restart_in_place import _restart

        _restart(server)
    else:
        server.stop()
        server = repo.server().start()
    assert version(server, "hello") == (200, "v1")
    assert version(server, "hello@r2") == (200, "v2")
    found = listing(server, "hello")
    assert found["serving"] == "r1" and found["pinned"]["revision"] == "r1"
    server.sync()
    assert version(server, "hello") == (200, "v1")


def test_a_kept_revision_answers_while_what_serves_starts_again(repo):
    # r2 takes seconds to import: after a stop and start, r1's URL must answer meanwhile
    # (its route published when r2's calls start to wait, not once r2 is up)
    repo.push(function("hello", "v1"))
    server = repo.server().start()
    slow = function("hello", "v2")
    slow["hello/handler.py"] = (
        f"import time\ntime.sleep({SLOW_IMPORT_SEC})\n" + slow["hello/handler.py"]
    )
    deploy(repo, server, slow)
    server.stop()
    server = repo.server().start(wait_for_sync=False)
    server.wait(
        lambda: call(server, "hello@r1")[0] != 404 or "function.restored" in server.output(),
        "r1's URL, or r2 up",
    )
    assert "function.restored" not in server.output(), "r1's URL was 404 until r2 was up"
    assert version(server, "hello@r1") == (200, "v1")
    assert version(server, "hello") == (200, "v2")  # held until r2 is up


def test_kept_revisions_survive_collection_and_older_ones_go(repo):
    repo.push(function("hello", "v1"))
    server = repo.server(
        args=["--keep-revisions", "2", "--keep-builds", "0", "--gc-interval", "0.5"]
    ).start()
    for v in ("v2", "v3"):
        deploy(repo, server, function("hello", v))
    found = listing(server, "hello")
    assert [r["revision"] for r in found["revisions"]] == ["r3", "r2"]
    assert version(server, "hello@r1")[0] == 404
    assert version(server, "hello@r2") == (200, "v2")
    kept = {r["buildTag"] for r in found["revisions"]}
    artifacts = repo.state / "artifacts"

    def collected() -> bool:
        return {p.name for p in artifacts.iterdir() if p.is_dir() and "-" in p.name} == kept

    server.wait(collected, "r1's artifact to be collected, r2's and r3's kept", timeout=30)
    assert version(server, "hello@r2") == (200, "v2")
    server.stop()
    assert processes_under(repo.state) == []


def test_the_revision_list_is_json_with_what_a_reader_needs(repo):
    repo.push(function("hello", "v1"))
    server = repo.server().start()
    found = listing(server, "hello")
    (only,) = found["revisions"]
    assert set(only) >= {"revision", "id", "commit", "buildTag", "created", "traffic", "state"}
    assert json.loads(json.dumps(found)) == found
    assert server.client.get(REVISIONS.format(name="nobody")).status_code == 404


def test_a_disabled_function_answers_at_none_of_its_revisions_urls(repo):
    repo.push(function("hello", "v1"))
    server = repo.server().start()
    deploy(repo, server, function("hello", "v2"))
    assert version(server, "hello@r1") == (200, "v1")
    # taking it offline takes its old code offline too
    deploy(repo, server, function("hello", "v2", "    enabled: false"))
    for path in ("hello", "hello@r1", "hello@r2", "hello@r3"):
        status, _ = version(server, path)
        assert status in (404, 503), (path, status)
    assert version(server, "hello@r1")[0] == 404


def test_revision_urls_share_the_functions_rate_limit(repo):
    repo.push(function("hello", "v1", "    rateLimit: {rps: 0.1, burst: 3}"))
    server = repo.server().start()
    deploy(repo, server, function("hello", "v2", "    rateLimit: {rps: 0.1, burst: 3}"))
    statuses = [version(server, path)[0] for path in ("hello@r1", "hello", "hello@r2", "hello@r1")]
    # three tokens in the bucket, whichever URL takes them: the fourth call is refused
    assert statuses == [200, 200, 200, 429], statuses
