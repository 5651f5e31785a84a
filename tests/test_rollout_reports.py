"""What the forge shows of a rollout: the commit that brought the candidate gets a
commit status (pending while it rolls out, success when promoted, failure with the
numbers when rolled back) and, rolled back, a comment on the pull request it came from.

A real ``gitops-sless serve`` (real python runtimes, the real proxy) follows
``acme/functions.git`` on a git daemon and reports to a loopback imitation of the forge
(``FakeForge``), which is told which pull request each commit belongs to.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import gitserver
from .gitserver import GitDaemon, init_bare
from .previews.test_forge import KINDS, FakeForge, serve
from .sless_server import ServedRepo, SlessServer
from .test_rollouts import function, rollout, versions

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon

CONTEXT = "ci/rollout/prod/hello"  # --instance-name ci
MARKER = "<!-- gitops-sless:ci:rollout/prod/hello -->"
# what the forge calls each state: GitLab says "failed"
FAILURE = {"github": "failure", "gitea": "failure", "gitlab": "failed"}
NUMBERS = re.compile(
    r"^hello r2 rolled back at step 1 of 2 \(50%\): "
    r"(\d+) of (\d+) calls failed \((\d+\.\d)%, at most 10\.0%\)$"
)


@pytest.fixture
def repo(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[ServedRepo]:
    """The served repository at ``acme/functions``: the forge's owner and name."""
    served = ServedRepo(tmp_path, git_daemon, git_root)
    init_bare(git_root / "acme" / "functions.git")
    served.url = git_daemon.url("acme/functions.git")
    yield served
    served.close()


@pytest.fixture(params=["github"])
def fake(request: pytest.FixtureRequest) -> Iterator[FakeForge]:
    forge, server = serve(request.param)
    yield forge
    forge.gate = None
    server.shutdown()
    server.server_close()


def reporting(repo: ServedRepo, fake: FakeForge) -> SlessServer:
    """A server that reports to ``fake`` (no previews: rollouts alone need the token)."""
    server = SlessServer(
        repo.url,
        repo.state,
        args=["--forge", fake.kind, "--forge-api", fake.url, "--instance-name", "ci"],
        env={"SLESS_FORGE_TOKEN": fake.token},
    )
    repo.servers.append(server)
    return server.start()


def push(repo: ServedRepo, files: dict[str, str], fake: FakeForge, pull: int | None) -> str:
    """Push ``files``; the forge says the commit came from pull request ``pull``."""
    repo.push(files)
    sha = repo.work.head()
    if pull is not None:
        with fake.lock:
            fake.commit_pulls[sha] = [pull]
    return sha


def statuses(fake: FakeForge, sha: str) -> list[dict[str, Any]]:
    """The statuses the forge has for ``sha`` under the rollout's context, oldest first."""
    key = "name" if fake.kind == "gitlab" else "context"
    with fake.lock:
        return [dict(s) for commit, s in fake.statuses if commit == sha and s[key] == CONTEXT]


def last_status(server: SlessServer, fake: FakeForge, sha: str, state: str) -> dict[str, Any]:
    return server.wait(
        lambda: next((s for s in statuses(fake, sha)[-1:] if s["state"] == state), None),
        f"a {state} status on {sha[:12]}",
        timeout=60,
    )


def everything_sent(fake: FakeForge) -> str:
    with fake.lock:
        return repr([c.body for c in fake.calls])


@pytest.mark.parametrize("fake", KINDS, indirect=True)
def test_a_failing_candidate_fails_its_commit_and_says_why_on_its_pull_request(repo, fake):
    push(repo, function("v1"), fake, None)
    server = reporting(repo, fake)
    sha = push(repo, function("v2", every=4, steps="[50]"), fake, pull=7)
    server.sync()
    started = last_status(server, fake, sha, "pending")
    assert started["description"] == "rollout of hello r2: 50% (step 1 of 2)"

    versions(server, 80)  # a quarter of the candidate's calls fail
    server.wait(lambda: rollout(server)["phase"] == "RolledBack", "the rollback", timeout=30)
    failed = last_status(server, fake, sha, FAILURE[fake.kind])
    found = NUMBERS.match(failed["description"])
    assert found, failed
    # the very numbers that decided it, as the function's status has them
    assert f"{found[1]} of {found[2]} calls failed ({found[3]}%" in rollout(server)["message"]
    assert int(found[1]) == int(found[2]) // 4 and int(found[2]) >= 20

    # the pull request that brought the commit says so, in a comment of the rollout's own
    comment = server.wait(lambda: fake.comments.get(7), "the comment on PR 7", timeout=30)
    (body,) = [c["body"] for c in comment]
    assert body.startswith(MARKER + "\n")
    assert failed["description"] in body and "r1 takes every call" in body
    assert set(fake.comments) == {7}


def test_a_promoted_candidate_passes_its_commit_and_comments_nowhere(repo, fake):
    push(repo, function("v1"), fake, None)
    server = reporting(repo, fake)
    sha = push(repo, function("v2", interval="1s", min_requests=5, steps="[50]"), fake, pull=8)
    server.sync()
    versions(server, 30)
    server.wait(lambda: rollout(server)["phase"] == "Promoted", "the promotion", timeout=30)
    promoted = last_status(server, fake, sha, "success")
    assert re.match(
        r"^hello r2 promoted after step 1 of 2 \(50%\): 0 of \d+ calls failed",
        promoted["description"],
    ), promoted
    assert [s["state"] for s in statuses(fake, sha)] == ["pending", "success"]
    assert fake.comments == {}


def test_a_forge_that_is_down_delays_the_status_but_never_a_pass(repo, fake):
    push(repo, function("v1"), fake, None)
    server = reporting(repo, fake)
    fake.gate = threading.Event()  # every answer waits (10 s) for the gate...
    for _ in range(6):  # ...and then the first statuses fail: the forge is down
        fake.fail("POST", "/statuses/", 503)
    sha = push(repo, function("v2", every=4, steps="[50]"), fake, pull=7)
    began = time.monotonic()
    server.sync()
    assert time.monotonic() - began < 8, "the pass waited on the forge"
    versions(server, 80)
    server.wait(lambda: rollout(server)["phase"] == "RolledBack", "the rollback", timeout=30)
    assert statuses(fake, sha) == []  # nothing got through yet
    fake.gate.set()

    failed = last_status(server, fake, sha, "failure")
    assert NUMBERS.match(failed["description"]), failed
    server.wait(lambda: fake.comments.get(7), "the comment on PR 7", timeout=30)
    assert "report.retry" in server.output()


def test_a_candidate_that_cannot_start_is_failed_without_its_error(repo, fake):
    push(repo, function("v1"), fake, None)
    server = reporting(repo, fake)
    leak = "sk_live_do_not_publish"
    broken = function("v2")
    broken["hello/handler.py"] = f"raise RuntimeError({leak!r})\n" + broken["hello/handler.py"]
    sha = push(repo, broken, fake, pull=9)
    server.sync()
    assert rollout(server)["phase"] == "RolledBack"
    failed = last_status(server, fake, sha, "failure")
    assert failed["description"] == "hello r2 did not start; rolled back"
    server.wait(lambda: fake.comments.get(9), "the comment on PR 9", timeout=30)
    # the public status and comment carry no word the function said
    assert leak not in everything_sent(fake) and "RuntimeError" not in everything_sent(fake)
