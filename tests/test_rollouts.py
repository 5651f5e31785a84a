"""Progressive rollouts end to end: a change of a function with a ``rollout`` block takes
the calls step by step, promoted when its answers are good and rolled back when they are
not, waiting while too few calls came, and resumed after a restart.

A real ``gitops-sless serve`` follows a repository on a git daemon, with real python
runtimes in bubblewrap; the calls go through the real proxy.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import gitserver
from .gitserver import GitDaemon
from .sless_server import ServedRepo, SlessServer

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon

REVISIONS = "/api/v1/environments/prod/functions/{name}/revisions"
# fails every call whose count is a multiple of `every` (0: never)
HANDLER = """\
import itertools
CALLS = itertools.count(1)
def main(event):
    n = next(CALLS)
    if {every} and n % {every} == 0:
        return {{"statusCode": 500, "body": "broken"}}
    return {{"version": {version!r}}}
"""


def function(
    version: str,
    *,
    steps: str = "[10, 50]",
    interval: str = "2s",
    min_requests: int = 20,
    every: int = 0,
    name: str = "hello",
) -> dict[str, str]:
    return {
        f"{name}/handler.py": HANDLER.format(version=version, every=every),
        f"{name}/sless.yaml": (
            "functions:\n"
            f"  - name: {name}\n"
            "    runtime: python3.11\n"
            "    entrypoint: handler.main\n"
            "    scale: {min: 1, max: 2, idle: 2s}\n"
            "    triggers: [{type: http}]\n"
            f"    rollout: {{steps: {steps}, interval: {interval}, "
            f"minRequests: {min_requests}, maxErrorRate: 0.1}}\n"
        ),
    }


@pytest.fixture
def repo(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[ServedRepo]:
    served = ServedRepo(tmp_path, git_daemon, git_root)
    yield served
    served.close()


def versions(server: SlessServer, n: int, name: str = "hello") -> Counter[str]:
    """The version (or the status) that answered each of ``n`` calls."""
    seen: Counter[str] = Counter()
    for _ in range(n):
        response = server.client.get(f"/fn/prod/{name}/")
        seen[
            response.json()["version"] if response.status_code == 200 else str(response.status_code)
        ] += 1
    return seen


def rollout(server: SlessServer, name: str = "hello") -> dict:
    listing = server.client.get(REVISIONS.format(name=name)).json()
    return {**(listing["rollout"] or {}), "serving": listing["serving"], "listing": listing}


def test_a_good_candidate_takes_each_steps_share_then_every_call(repo):
    repo.push(function("v1"))
    server = repo.server().start()
    assert versions(server, 5) == {"v1": 5}
    repo.push(function("v2", interval="5s"))
    server.sync()

    state = rollout(server)
    assert (state["phase"], state["candidate"], state["stable"]) == ("Progressing", "r2", "r1")
    assert (state["step"], state["steps"], state["traffic"]) == (1, 3, 10)
    assert server.function("hello")["phase"] == "Progressing"
    by_revision = {r["revision"]: (r["state"], r["traffic"]) for r in state["listing"]["revisions"]}
    assert by_revision == {"r2": ("candidate", 10), "r1": ("serving", 90)}
    seen = versions(server, 200)
    assert seen == {"v1": 180, "v2": 20}, seen  # exactly 10 % of the calls

    # its interval passed with enough calls and no error: the next step
    server.wait(lambda: rollout(server)["step"] == 2, "the second step", timeout=30)
    assert rollout(server)["traffic"] == 50
    seen = versions(server, 100)
    assert seen == {"v1": 50, "v2": 50}, seen
    # and then every call
    server.wait(lambda: rollout(server)["phase"] == "Promoted", "the promotion", timeout=30)
    assert versions(server, 20) == {"v2": 20}
    state = rollout(server)
    assert state["serving"] == "r2" and state["traffic"] == 100
    assert "r1 is kept" in state["message"]
    server.wait(lambda: server.function("hello")["phase"] == "Ready", "Ready")
    # the old revision is kept, and scaled down once idle
    old = lambda: next(r for r in rollout(server)["listing"]["revisions"] if r["revision"] == "r1")  # noqa: E731
    server.wait(lambda: old()["replicas"] == 0, "r1 to scale down", timeout=30)
    assert server.client.get("/fn/prod/hello@r1/").json()["version"] == "v1"
    assert "rollout.promoted" in server.output()


def test_a_failing_candidate_is_rolled_back_with_the_numbers(repo):
    repo.push(function("v1"))
    server = repo.server().start()
    repo.push(function("v2", every=4, steps="[50]"))  # a quarter of its calls fail
    server.sync()
    assert rollout(server)["phase"] == "Progressing"

    seen = versions(server, 80)
    # half of the calls reach the candidate, until the verdict (a pass, within a second)
    assert seen["v2"] + seen["500"] >= 20 and seen["500"] >= 5, seen
    server.wait(lambda: rollout(server)["phase"] == "RolledBack", "the rollback", timeout=30)
    state = rollout(server)
    found = re.search(
        r"(\d+) of (\d+) calls failed \((\d+\.\d)%, at most 10\.0%\)", state["message"]
    )
    assert found, state
    failed, calls, rate = int(found[1]), int(found[2]), float(found[3])
    assert calls >= 20 and failed == calls // 4 and rate == round(100 * failed / calls, 1)
    assert "r1 takes every call" in state["message"]
    assert versions(server, 30) == {"v1": 30}
    record = server.function("hello")
    assert record["phase"] == "RolledBack" and f"{rate}%" in record["message"]
    assert server.sync()["result"] == "Degraded"
    assert versions(server, 10) == {"v1": 10}  # a pass does not try it again

    # new code starts a new rollout
    repo.push(function("v3", steps="[50]"))
    server.sync()
    state = rollout(server)
    assert (state["phase"], state["candidate"], state["stable"]) == ("Progressing", "r3", "r1")


def test_a_step_waits_for_enough_calls(repo):
    repo.push(function("v1"))
    server = repo.server().start()
    repo.push(function("v2", interval="1s", min_requests=20, steps="[50]"))
    server.sync()
    versions(server, 10)  # 5 reach the candidate
    time.sleep(3)  # its interval passed, three times
    server.sync()
    state = rollout(server)
    assert (state["phase"], state["step"]) == ("Progressing", 1)
    assert "waits for 15 more calls" in state["message"], state
    versions(server, 30)
    server.wait(lambda: rollout(server)["phase"] == "Promoted", "the promotion", timeout=30)


def test_a_second_push_replaces_the_candidate(repo):
    repo.push(function("v1"))
    server = repo.server().start()
    repo.push(function("v2", interval="1h"))
    server.sync()
    assert rollout(server)["candidate"] == "r2"
    repo.push(function("v3", interval="1h", steps="[50]"))
    server.sync()
    state = rollout(server)
    assert (state["candidate"], state["stable"], state["traffic"]) == ("r3", "r1", 50)
    assert versions(server, 20) == {"v1": 10, "v3": 10}


@pytest.mark.parametrize("how", ["in place", "stop and start"])
def test_a_restart_resumes_the_rollout_at_its_step(repo, how):
    repo.push(function("v1"))
    server = repo.server().start()
    repo.push(function("v2", interval="3s", min_requests=10, steps="[10, 50]"))
    server.sync()
    versions(server, 100)
    server.wait(lambda: rollout(server)["step"] == 2, "the second step", timeout=30)
    if how == "in place":
        from .test_restart_in_place import _restart

        _restart(server)
    else:
        server.stop()
        server = repo.server().start()
    state = rollout(server)
    assert (state["phase"], state["step"], state["traffic"]) == ("Progressing", 2, 50)
    assert versions(server, 20) == {"v1": 10, "v2": 10}
    server.wait(lambda: rollout(server)["phase"] == "Promoted", "the promotion", timeout=30)
    assert versions(server, 10) == {"v2": 10}


def test_a_candidate_that_cannot_start_is_rolled_back_at_once(repo):
    repo.push(function("v1"))
    server = repo.server().start()
    broken = function("v2")
    broken["hello/handler.py"] = "raise RuntimeError('no start')\n" + broken["hello/handler.py"]
    repo.push(broken)
    server.sync()
    state = rollout(server)
    assert state["phase"] == "RolledBack" and "r2 did not start" in state["message"], state
    assert versions(server, 10) == {"v1": 10}
    assert server.function("hello")["phase"] == "RolledBack"


def test_a_disabled_function_takes_a_change_at_once(repo):
    repo.push(function("v1"))
    server = repo.server().start()
    off = function("v2")
    off["hello/sless.yaml"] += "    enabled: false\n"
    repo.push(off)
    server.sync()
    listing = rollout(server)
    assert listing["serving"] == "r2" and "phase" not in listing, listing
    assert server.function("hello")["phase"] == "Disabled"


def test_with_one_revision_kept_a_rollout_still_runs_and_numbers_are_never_reused(repo):
    repo.push(function("v1"))
    server = repo.server(args=["--keep-revisions", "1"]).start()
    repo.push(function("v2", interval="1s", min_requests=5, steps="[50]"))
    server.sync()
    assert rollout(server)["candidate"] == "r2"
    versions(server, 20)
    server.wait(lambda: rollout(server)["phase"] == "Promoted", "the promotion", timeout=30)
    assert versions(server, 10) == {"v2": 10}
    repo.push(function("v3", interval="1h", steps="[50]"))
    server.sync()
    assert rollout(server)["candidate"] == "r3"  # r1 was collected; its number is not given


# fails the calls to / and answers those to /ok: its own URL can be made to look healthy
SPLIT_HANDLER = """\
def main(event):
    if event["_path"] == "/ok":
        return {"version": "v2"}
    return {"statusCode": 500, "body": "broken"}
"""


def test_calls_at_the_candidates_own_url_do_not_count_in_its_verdict(repo):
    repo.push(function("v1"))
    server = repo.server().start()
    broken = function("v2", interval="1s", min_requests=10, steps="[20]")
    broken["hello/handler.py"] = SPLIT_HANDLER
    repo.push(broken)
    server.sync()
    # an attacker floods the candidate's own URL with calls that succeed...
    for _ in range(200):
        assert server.client.get("/fn/prod/hello@r2/ok").status_code == 200
    # ...while the calls it takes as its share fail: the share alone decides
    versions(server, 100)
    server.wait(lambda: rollout(server)["phase"] == "RolledBack", "the rollback", timeout=30)
    assert "20 of 20 calls failed" in rollout(server)["message"], rollout(server)


def test_a_revert_withdraws_the_candidate_and_the_same_version_may_come_again(repo):
    repo.push(function("v1"))
    server = repo.server().start()
    repo.push(function("v2", interval="1h"))
    server.sync()
    assert rollout(server)["phase"] == "Progressing"
    repo.push(function("v1"))  # the revert
    server.sync()
    server.wait(lambda: rollout(server)["phase"] == "Withdrawn", "the withdrawal", timeout=30)
    assert versions(server, 20) == {"v1": 20}
    assert server.function("hello")["phase"] == "Ready"
    repo.push(function("v2", interval="1h"))  # the same version again: rolled out again
    server.sync()
    state = rollout(server)
    assert (state["phase"], state["candidate"]) == ("Progressing", "r2"), state
