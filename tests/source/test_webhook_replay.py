"""Captured webhook deliveries replayed, and forged, against a real ``serve --previews``.

The attacker has seen signed deliveries (a proxy log, a misdirected hook, a GitLab
token sent in clear) and sends them again, or signs new ones with what they saw.
Every test drives a real server process and a git daemon on loopback, with the
pull-request payloads of ``tests/data/webhooks`` (see tests/previews/test_previews.py);
the forge API, where there is one, is the loopback imitation of tests/previews/test_forge.py.
Then the status store's table of deliveries in process: bounded, atomic, durable.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from gitops_sless.previews.pulls import PullRequest
from gitops_sless.source import webhooks
from gitops_sless.state.store import DELIVERY_MAX_AGE_SEC, MAX_DELIVERIES, Store

from .. import gitserver
from ..previews.test_previews import (
    CHANGED,
    NEW,
    ForgeDouble,
    Setup,
    answer,
    change,
    doubles,
    fake_github,
    github_listing,
    in_state,
    listing,
    next_pass,
    payload,
    repository,
    serve_with_forge,
    setup,
    until,
)
from ..sless_server import WEBHOOK_SECRET, SlessServer
from .test_webhooks import wait_for

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["doubles", "fake_github", "setup"]  # fixtures, shared with test_previews

GITHUB_ONLY = "github-only-secret"
GITLAB_ONLY = "gitlab-only-secret"


# --- deliveries as the forge sends them ------------------------------------------------------


def deliver(
    server: SlessServer,
    forge: str,
    body: bytes,
    event: str,
    delivery: str | None,
    secret: str = WEBHOOK_SECRET,
) -> httpx.Response:
    """One signed delivery with its id header (None: without one), as the forge sends it."""
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    headers = {
        "github": {"X-Hub-Signature-256": f"sha256={digest}", "X-GitHub-Event": event},
        "gitea": {"X-Gitea-Signature": digest, "X-Gitea-Event": event},
        "gitlab": {"X-Gitlab-Token": secret, "X-Gitlab-Event": event},
    }[forge]
    if delivery is not None:
        headers[webhooks.DELIVERY_HEADERS[forge]] = delivery
    return server.client.post(
        f"/api/v1/webhooks/{forge}",
        content=body,
        headers={**headers, "Content-Type": "application/json"},
    )


def pull_event(action: str, number: int, sha: str, labels: tuple[str, ...] = ()) -> bytes:
    """A GitHub ``pull_request`` delivery's body: the PR at ``sha`` with ``labels``."""
    fixture = "closed" if action == "closed" else "opened"
    data = payload(f"github-pull-request-{fixture}.json")
    data["action"] = action
    pr = data["pull_request"]
    data["number"] = pr["number"] = number
    pr["head"]["sha"] = sha
    pr["head"]["ref"] = f"change-{number}"
    pr["title"] = f"change {number}"
    pr["labels"] = [{"id": 1, "name": name} for name in labels]
    if action in ("labeled", "unlabeled"):
        data["label"] = {"id": 1, "name": "preview"}
    return json.dumps(data).encode()


DUPLICATE = {"accepted": False, "ignored": "duplicate delivery"}


def duplicate(response: httpx.Response) -> bool:
    return response.status_code == 200 and response.json() == DUPLICATE


def opened_by_webhook(setup: Setup, server: SlessServer, number: int, text: str, *labels: str):
    """A new PR: its ref pushed and its ``opened`` delivered; returns its head once Ready."""
    head = setup.push_pull(number, change(text))
    body = pull_event("opened", number, head, labels)
    response = deliver(server, "github", body, "pull_request", f"opened-{number}")
    assert response.status_code == 202, response.text
    until(in_state(server, number, "Ready", head), f"pr-{number} Ready", server)
    return head


def previews_ran(setup: Setup, server: SlessServer, number: int, *labels: str) -> None:
    """Proof that a previews pass ran after what came before: a new PR becomes Ready."""
    opened_by_webhook(setup, server, number, f"witness {number}", *labels)


def labels_stored(state: Path, number: int) -> list[str]:
    """What the server recorded of the PR's labels (not served by the API), read-only."""
    db = sqlite3.connect(f"file:{state / 'status.db'}?mode=ro", uri=True)
    try:
        (raw,) = db.execute("SELECT labels FROM previews WHERE number = ?", (number,)).fetchone()
    finally:
        db.close()
    return json.loads(raw)


# --- replays ----------------------------------------------------------------------------------


def test_a_captured_opened_sent_again_after_closed_does_not_bring_the_preview_back(setup):
    setup.push_main(repository("main", count=2))
    server = setup.serve()
    head = setup.push_pull(7, change("pr v1"))
    captured = pull_event("opened", 7, head, ("preview",))
    assert deliver(server, "github", captured, "pull_request", "o-1").status_code == 202
    until(in_state(server, 7, "Ready", head), "pr-7 Ready", server)
    closed = pull_event("closed", 7, head)
    assert deliver(server, "github", closed, "pull_request", "c-1").status_code == 202
    until(lambda: "pr-7" not in listing(server), "pr-7 closed", server)

    # the delivery as captured, then with a new id: the id is not signed, the body is
    assert duplicate(deliver(server, "github", captured, "pull_request", "o-1"))
    assert duplicate(deliver(server, "github", captured, "pull_request", "o-1-edited"))
    assert duplicate(deliver(server, "github", captured, "pull_request", None))
    previews_ran(setup, server, 8)
    assert "pr-7" not in listing(server)
    assert answer(server, "pr-7") is None

    # the ids are in the status store: a restart remembers them
    server.stop()
    again = setup.serve()
    assert duplicate(deliver(again, "github", captured, "pull_request", "o-1"))
    previews_ran(setup, again, 9)
    assert "pr-7" not in listing(again)

    # what the replay was refused is done by a new event: the PR really reopened
    reopened = pull_event("reopened", 7, head, ("preview",))
    assert deliver(again, "github", reopened, "pull_request", "r-1").status_code == 202
    until(in_state(again, 7, "Ready", head), "pr-7 reopened", again)
    assert answer(again, "pr-7") == "pr v1"


def settled(setup: Setup, server: SlessServer, number: int, witness: int) -> dict[str, Any]:
    """What the server shows of PR ``number`` once a previews pass ran after the last event."""
    previews_ran(setup, server, witness, "preview")
    row = listing(server).get(f"pr-{number}", {}).get("preview") or {}
    return {
        "state": row.get("state"),
        "reason": row.get("reason"),
        "head": row.get("head"),
        "answer": answer(server, f"pr-{number}"),
        "labels": labels_stored(setup.state, number),
    }


def test_an_old_labeled_event_sent_again_changes_nothing(setup):
    """With --preview-filter label=preview: the label added, removed, a new commit pushed;
    the delivery that added the label, replayed, puts nothing back."""
    setup.push_main(repository("main", count=2))
    server = setup.serve(args=["--preview-filter", "label=preview"])
    v1 = setup.push_pull(7, change("pr v1"))
    assert deliver(server, "github", pull_event("opened", 7, v1), "pull_request", "o-1").is_success
    labeled = pull_event("labeled", 7, v1, ("preview",))
    assert deliver(server, "github", labeled, "pull_request", "l-1").status_code == 202
    until(in_state(server, 7, "Ready", v1), "pr-7 Ready once labelled", server)
    unlabeled = pull_event("unlabeled", 7, v1)
    assert deliver(server, "github", unlabeled, "pull_request", "u-1").status_code == 202
    v2 = setup.push_pull(7, change("pr v2"))
    synchronize = pull_event("synchronize", 7, v2)
    assert deliver(server, "github", synchronize, "pull_request", "s-1").status_code == 202
    before = settled(setup, server, 7, witness=8)
    assert before["labels"] == [] and before["answer"] != "pr v2", before

    assert duplicate(deliver(server, "github", labeled, "pull_request", "l-1"))
    assert duplicate(deliver(server, "github", labeled, "pull_request", "l-1-edited"))
    assert settled(setup, server, 7, witness=9) == before

    # a maintainer labelling it again is a new delivery: v2 is previewed
    relabeled = pull_event("labeled", 7, v2, ("preview",))
    assert deliver(server, "github", relabeled, "pull_request", "l-2").status_code == 202
    until(lambda: answer(server, "pr-7") == "pr v2", "pr-7 serving v2 once labelled", server)


def passes_for(server: SlessServer, trigger: str) -> int:
    """How many passes the log says a trigger started (alone or with others)."""
    return sum(
        1
        for line in server.output().splitlines()
        if "sync.started" in line and trigger in line.rsplit("trigger ", 1)[-1].split(",")
    )


def test_a_push_delivery_sent_again_requests_no_pass_even_twice_at_once(setup):
    setup.push_main(repository("main v1", count=2))
    server = setup.serve()
    setup.push_main(change("main v2"))
    push = json.dumps({"ref": "refs/heads/main", "after": "0" * 40}).encode()
    assert deliver(server, "github", push, "push", "p-1").status_code == 202
    until(lambda: answer(server, "prod") == "main v2", "prod serving main v2", server)
    server.sync()  # any pass the delivery asked for has started by now
    assert passes_for(server, "webhook:github") == 1

    assert duplicate(deliver(server, "github", push, "push", "p-1"))
    server.sync(timeout=60)  # a pass the replay asked for would come before this one ends
    assert passes_for(server, "webhook:github") == 1

    # the same new delivery twice at once: one is acted on, the other is the duplicate
    barrier = threading.Barrier(2)
    answers: list[httpx.Response] = []

    def send() -> None:
        barrier.wait()
        answers.append(deliver(server, "github", push, "push", "p-2"))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(r.status_code for r in answers) == [200, 202]
    assert sum(duplicate(r) for r in answers) == 1


# --- one secret per forge ---------------------------------------------------------------------


def test_a_github_event_signed_with_the_gitlab_secret_is_401(setup):
    """A GitLab delivery carries its secret in clear; with a secret per forge it signs
    nothing else. With one shared secret, the same forgery is accepted."""
    setup.push_main(repository("main", count=2))
    separate = setup.serve(
        env={
            "SLESS_WEBHOOK_SECRET_GITHUB": GITHUB_ONLY,
            "SLESS_WEBHOOK_SECRET_GITLAB": GITLAB_ONLY,
        }
    )
    push = json.dumps({"ref": "refs/heads/main"}).encode()
    seen = deliver(separate, "gitlab", push, "Push Hook", "g-1", secret=GITLAB_ONLY)
    assert seen.status_code == 202
    assert seen.request.headers["X-Gitlab-Token"] == GITLAB_ONLY  # what a log shows
    forged = json.dumps({"ref": "refs/heads/main", "forged": True}).encode()
    assert deliver(separate, "github", forged, "push", "f-1", secret=GITLAB_ONLY).status_code == 401
    shared = deliver(separate, "github", forged, "push", "f-2", secret=WEBHOOK_SECRET)
    assert shared.status_code == 401  # GitHub has its own: the shared one does not sign it
    assert deliver(separate, "github", forged, "push", "f-3", secret=GITHUB_ONLY).status_code == 202
    # Gitea has none of its own: the shared default (--webhook-secret) signs it
    assert deliver(separate, "gitea", forged, "push", "f-4").status_code == 202
    separate.stop()

    only_shared = setup.serve()
    seen = deliver(only_shared, "gitlab", push, "Push Hook", "g-2")
    assert seen.request.headers["X-Gitlab-Token"] == WEBHOOK_SECRET
    forged_again = deliver(only_shared, "github", forged, "push", "f-5", secret=WEBHOOK_SECRET)
    assert forged_again.status_code == 202  # why each forge should have its own


# --- confirmed with the forge before anything opens -------------------------------------------


def close_on_forge(fake: Any, number: int) -> None:
    with fake.lock:
        for pull in fake.pulls:
            if pull["number"] == number:
                pull["state"] = "closed"


def test_with_a_forge_token_a_delivery_never_seen_cannot_reopen_a_closed_pr(setup, fake_github):
    """A delivery this server never received (lost, intercepted, or older than the 7 days
    of ids it keeps) is new to it: the forge's API says whether the PR is open."""
    fake = fake_github
    setup.push_main(repository("main", count=2))
    head = setup.push_pull(7, change("pr v1"))
    github_listing(fake, 7, head)
    captured = pull_event("opened", 7, head, ("preview",))  # never delivered to this server
    server = serve_with_forge(setup, fake)
    synchronize = pull_event("synchronize", 7, head, ("preview",))
    assert deliver(server, "github", synchronize, "pull_request", "s-1").status_code == 202
    until(in_state(server, 7, "Ready", head), "pr-7 Ready", server)
    close_on_forge(fake, 7)
    closed = pull_event("closed", 7, head)
    assert deliver(server, "github", closed, "pull_request", "c-1").status_code == 202
    until(lambda: "pr-7" not in listing(server), "pr-7 closed", server)

    refused = deliver(server, "github", captured, "pull_request", "o-1")
    assert refused.status_code == 200, refused.text
    assert refused.json() == {
        "accepted": False,
        "ignored": "the forge says pull request 7 is closed",
    }
    assert any(c.method == "GET" and c.path.endswith("/pulls/7") for c in fake.calls)

    # an event naming a head the forge does not have opens nothing either
    v2 = setup.push_pull(9, change("pr 9 v2"))
    github_listing(fake, 9, v2)
    stale = pull_event("opened", 9, "9" * 40)
    ignored = deliver(server, "github", stale, "pull_request", "o-9")
    assert ignored.status_code == 200
    assert ignored.json()["ignored"] == (
        f"the forge says pull request 9 is at {v2[:12]}, not {'9' * 12}"
    )

    head8 = setup.push_pull(8, change("witness 8"))
    github_listing(fake, 8, head8)
    opened = deliver(server, "github", pull_event("opened", 8, head8), "pull_request", "o-8")
    assert opened.status_code == 202  # the forge agrees: opened
    until(in_state(server, 8, "Ready", head8), "pr-8 Ready", server)
    assert "pr-7" not in listing(server)
    assert answer(server, "pr-7") is None
    assert server.client.get(f"/fn/pr-7/{CHANGED}/").status_code == 404


def test_without_a_forge_token_the_same_never_seen_delivery_reopens_the_pr(setup):
    """What the forge's confirmation prevents: nothing else can tell this delivery is old."""
    setup.push_main(repository("main", count=2))
    server = setup.serve()
    head = setup.push_pull(7, change("pr v1"))
    captured = pull_event("opened", 7, head, ("preview",))  # never delivered to this server
    synchronize = pull_event("synchronize", 7, head, ("preview",))
    assert deliver(server, "github", synchronize, "pull_request", "s-1").status_code == 202
    until(in_state(server, 7, "Ready", head), "pr-7 Ready", server)
    closed = pull_event("closed", 7, head)
    assert deliver(server, "github", closed, "pull_request", "c-1").status_code == 202
    until(lambda: "pr-7" not in listing(server), "pr-7 closed", server)

    assert deliver(server, "github", captured, "pull_request", "o-1").status_code == 202
    until(in_state(server, 7, "Ready", head), "pr-7 back from a replayed delivery", server)


# --- the store's record of deliveries, in process -------------------------------------------


def test_deliveries_are_kept_for_seven_days_at_most(tmp_path):
    store = Store(tmp_path / "status.db")
    day0, week = 1000.0, DELIVERY_MAX_AGE_SEC
    assert store.claim_delivery("github", "d-1", None, now=day0)
    assert not store.claim_delivery("github", "d-1", None, now=day0 + week - 1)
    later = day0 + week + 1
    assert store.claim_delivery("github", "d-1", None, now=later)
    assert store.deliveries() == 1  # the old row went when the new one came
    # ids are per forge; a body digest knows a delivery again under any id
    assert store.claim_delivery("gitea", "d-1", None, now=later)
    assert store.claim_delivery("github", "d-2", "digest-a", now=later)
    assert not store.claim_delivery("github", "d-3", "digest-a", now=later)
    assert store.claim_delivery("github", None, None, now=later)  # nothing to know it by
    assert store.deliveries() == 3


def test_the_newest_10000_deliveries_are_kept(tmp_path):
    store = Store(tmp_path / "status.db")
    now = 1000.0  # all within a second: the count bounds them, not their age
    for i in range(MAX_DELIVERIES + 5):
        assert store.claim_delivery("github", f"d-{i}", None, now=now)
    assert store.deliveries() == MAX_DELIVERIES
    assert not store.claim_delivery("github", f"d-{MAX_DELIVERIES + 4}", None, now=now)
    assert not store.claim_delivery("github", "d-5", None, now=now)  # the oldest one kept
    assert store.claim_delivery("github", "d-4", None, now=now)  # forgotten: acted on again


@pytest.mark.parametrize("connections", [1, 2], ids=["one-connection", "two-connections"])
def test_of_identical_deliveries_at_once_exactly_one_is_claimed(tmp_path, connections):
    stores = [Store(tmp_path / "status.db") for _ in range(connections)]
    barrier = threading.Barrier(8)
    claimed: list[bool] = []

    def claim(index: int) -> None:
        barrier.wait()
        claimed.append(stores[index % connections].claim_delivery("gitlab", "same", None))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(claimed) == [False] * 7 + [True]
    for store in stores:
        store.close()


def test_deliveries_survive_a_restart_of_the_store(tmp_path):
    store = Store(tmp_path / "status.db")
    assert store.claim_delivery("github", "d-1", "digest-a")
    store.close()
    reopened = Store(tmp_path / "status.db")
    assert not reopened.claim_delivery("github", "d-1", None)
    assert not reopened.claim_delivery("github", "d-9", "digest-a")


# --- the forge's list, read before a close webhook, in process --------------------------------


def test_a_forge_list_read_before_the_close_webhook_does_not_reopen_the_pr(doubles):
    """previews.py ``_observe``: a closed row reopened whenever the last list (read every
    max(poll, 15) s) still had the PR, so a close held only until a pass ran."""
    doubles.mirror.heads[7] = NEW
    forge = ForgeDouble([PullRequest(7, "open", NEW, "main")])
    previews = doubles.make(forge=forge, forge_interval_sec=3600)
    next_pass(previews, previews.start)
    assert doubles.store.preview(7)["state"] != "Closed"
    next_pass(previews, lambda: previews.on_event(PullRequest(7, "closed", NEW, "main")))
    next_pass(previews, previews.request)
    assert doubles.store.preview(7)["state"] == "Closed"


def test_a_forge_list_read_after_the_close_reopens_the_pr_it_lists_open(doubles):
    doubles.mirror.heads[7] = NEW
    forge = ForgeDouble([PullRequest(7, "open", NEW, "main")])
    previews = doubles.make(forge=forge, forge_interval_sec=0.1)
    next_pass(previews, previews.start)
    forge.pulls = []  # closed on the forge, and the webhook says so
    previews.on_event(PullRequest(7, "closed", NEW, "main"))
    wait_for(lambda: doubles.store.preview(7)["state"] == "Closed", "pr-7 closed")
    forge.pulls = [PullRequest(7, "open", NEW, "main")]  # reopened, and no webhook came
    wait_for(lambda: doubles.store.preview(7)["state"] != "Closed", "pr-7 reopened by the list")
