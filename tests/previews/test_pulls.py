"""Pull request events from GitHub, Gitea and GitLab webhooks, API objects and PR refs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from gitops_sless.previews.pulls import (
    PullRequest,
    pull_from_api,
    pull_number_from_ref,
    pull_request_event,
)
from gitops_sless.source.webhooks import PayloadError

from ..paths import DATA

PAYLOADS = DATA / "webhooks"
SHA_OPENED = "c0ffee5d2b1e4f6a8b9c0d1e2f3a4b5c6d7e8f90"
SHA_PUSHED = "d1e2f3a4b5c6d7e8f90c0ffee5d2b1e4f6a8b9c0"
GREET = {"title": "greet: say hello v2", "head_branch": "greet-v2", "base": "main"}


def _pr(number: int, state: str, sha: str, *, merged: bool = False, **fields: object):
    defaults: dict[str, object] = {
        **GREET,
        "author": "alice",
        "labels": ("preview",),
        "same_repo": True,
    }
    return PullRequest(number, state, sha, merged=merged, **{**defaults, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("forge", "event", "fixture", "expected"),
    [
        ("github", "pull_request", "github-pull-request-opened", _pr(42, "open", SHA_OPENED)),
        ("github", "pull_request", "github-pull-request-synchronize", _pr(42, "open", SHA_PUSHED)),
        (
            "github",
            "pull_request",
            "github-pull-request-closed-merged",
            _pr(42, "closed", SHA_PUSHED, merged=True),
        ),
        (
            "github",
            "pull_request",
            "github-pull-request-closed",
            _pr(
                43,
                "closed",
                "a4b5c6d7e8f90c0ffee5d2b1e4f6a8b9c0d1e2f3",
                title="try a new runtime",
                labels=(),
            ),
        ),
        (
            "gitea",
            "pull_request",
            "gitea-pull-request-opened",
            _pr(7, "open", "bffeb74224043ba2feb48d137756c8a9331c449a"),
        ),
        (
            "gitea",
            "pull_request",
            "gitea-pull-request-closed",
            _pr(7, "closed", "bffeb74224043ba2feb48d137756c8a9331c449a", merged=True),
        ),
        (
            "gitlab",
            "Merge Request Hook",
            "gitlab-merge-request-open",
            _pr(5, "open", "da1560886d4f094c3e6c9ef40349f7d38b5d27d7"),
        ),
        (
            "gitlab",
            "merge_request",  # webhooks' normalised name is accepted too
            "gitlab-merge-request-update",
            _pr(5, "open", "0b4bc9a49b562e85de7cc9e834518ea6828729b9"),
        ),
        (
            "gitlab",
            "Merge Request Hook",
            "gitlab-merge-request-merge",
            # GitLab's hook names who acted (bob merged), not the author
            _pr(5, "closed", "0b4bc9a49b562e85de7cc9e834518ea6828729b9", merged=True, author="bob"),
        ),
        (
            "gitlab",
            "Merge Request Hook",
            "gitlab-merge-request-close",
            _pr(5, "closed", "0b4bc9a49b562e85de7cc9e834518ea6828729b9"),
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_each_fixture_parses(forge, event, fixture, expected):
    body = (PAYLOADS / f"{fixture}.json").read_bytes()
    found = pull_request_event(forge, event, body)
    assert found is not None and found.sender  # who acted: see the tests below
    assert replace(found, sender=None, sender_id=None) == expected


def _payload(fixture: str, **changes: object) -> bytes:
    data = json.loads((PAYLOADS / f"{fixture}.json").read_text())
    data.update(changes)
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("forge", "event", "body"),
    [
        ("github", "push", (PAYLOADS / "github-push.json").read_bytes()),
        ("github", "issues", b"{}"),
        ("github", "pull_request", _payload("github-pull-request-opened", action="assigned")),
        (
            "github",
            "pull_request",
            _payload("github-pull-request-opened", action="review_requested"),
        ),
        ("gitea", "push", (PAYLOADS / "gitea-push.json").read_bytes()),
        ("gitea", "pull_request_approved", b"{}"),
        ("gitea", "pull_request", _payload("gitea-pull-request-opened", action="assigned")),
        ("gitlab", "Push Hook", (PAYLOADS / "gitlab-push.json").read_bytes()),
        ("gitlab", "Note Hook", b"{}"),
    ],
)
def test_other_events_and_actions_are_none(forge, event, body):
    assert pull_request_event(forge, event, body) is None


def test_gitea_sync_and_label_actions_count():
    body = _payload("gitea-pull-request-opened", action="synchronized")
    assert pull_request_event("gitea", "pull_request", body).number == 7  # type: ignore[union-attr]
    body = _payload("gitea-pull-request-opened", action="label_updated")
    assert pull_request_event("gitea", "pull_request_label", body) is not None


def test_gitlab_approval_is_none():
    data = json.loads((PAYLOADS / "gitlab-merge-request-update.json").read_text())
    data["object_attributes"]["action"] = "approved"
    assert pull_request_event("gitlab", "Merge Request Hook", json.dumps(data).encode()) is None


@pytest.mark.parametrize(
    ("forge", "event", "body", "reason"),
    [
        ("github", "pull_request", b"{not json", "not valid JSON"),
        ("github", "pull_request", b"[1, 2]", "must be a JSON object, not an array"),
        ("github", "pull_request", b'{"action": "opened"}', "no 'pull_request' field"),
        (
            "github",
            "pull_request",
            b'{"action": "opened", "pull_request": {"number": "42", "state": "open"}}',
            "'pull_request.number'",
        ),
        ("gitea", "pull_request", b'{"action": "opened", "pull_request": 7}', "'pull_request'"),
        ("gitlab", "Merge Request Hook", b'{"object_kind": "merge_request"}', "object_attributes"),
        (
            "gitlab",
            "Merge Request Hook",
            b'{"object_attributes": {"iid": 5, "state": "opened", "labels": "x"}}',
            "object_attributes.labels",
        ),
    ],
)
def test_malformed_payload_is_a_payload_error(forge, event, body, reason):
    with pytest.raises(PayloadError, match=reason) as caught:
        pull_request_event(forge, event, body)
    assert "\n" not in str(caught.value)


def test_deeply_nested_payload_is_a_payload_error():
    body = b'{"action": "opened", "pull_request": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(PayloadError):
        pull_request_event("github", "pull_request", body)


def test_unknown_forge_is_a_value_error():
    with pytest.raises(ValueError, match="unknown forge"):
        pull_request_event("bitbucket", "pull_request", b"{}")


def _event(fixture: str, change: Callable[[dict[str, Any]], None] = lambda d: None) -> bytes:
    data = json.loads((PAYLOADS / f"{fixture}.json").read_text())
    change(data)
    return json.dumps(data).encode()


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """A change to a payload: ``a.b.c`` set to ``value``, or removed when value is ...."""

    def change(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for key in parents:
            data = data[key]
        if value is ...:
            del data[last]
        else:
            data[last] = value

    return change


@pytest.mark.parametrize(
    ("forge", "event", "body", "same_repo"),
    [
        ("github", "pull_request", _event("github-pull-request-opened"), True),
        ("github", "pull_request", _event("github-pull-request-labeled-fork"), False),
        # a fork deleted since: GitHub sends head.repo null
        (
            "github",
            "pull_request",
            _event("github-pull-request-opened", _set("pull_request.head.repo", None)),
            False,
        ),
        # a body that does not say: unknown, never taken as the same repository
        (
            "github",
            "pull_request",
            _event("github-pull-request-opened", _set("pull_request.head.repo", ...)),
            None,
        ),
        (
            "github",
            "pull_request",
            _event("github-pull-request-opened", _set("pull_request.base.repo", ...)),
            None,
        ),
        ("gitea", "pull_request", _event("gitea-pull-request-opened"), True),
        (
            "gitea",
            "pull_request",
            _event(
                "gitea-pull-request-opened",
                _set("pull_request.head.repo", {"id": 141, "full_name": "mallory/functions"}),
            ),
            False,
        ),
        ("gitlab", "Merge Request Hook", _event("gitlab-merge-request-open"), True),
        ("gitlab", "Merge Request Hook", _event("gitlab-merge-request-labeled-fork"), False),
        (
            "gitlab",
            "Merge Request Hook",
            _event("gitlab-merge-request-open", _set("object_attributes.source_project_id", ...)),
            None,
        ),
    ],
)
def test_where_the_head_comes_from(forge, event, body, same_repo):
    found = pull_request_event(forge, event, body)
    assert found is not None and found.same_repo is same_repo


@pytest.mark.parametrize(
    ("forge", "event", "body", "sender", "added"),
    [
        (
            "github",
            "pull_request",
            _event("github-pull-request-labeled-fork"),
            ("carol", 6660002),
            ("preview",),
        ),
        (
            "github",
            "pull_request",
            _event("github-pull-request-labeled-fork", _set("action", "unlabeled")),
            ("carol", 6660002),
            (),
        ),
        # an opened PR that carries a label adds none: GitHub sends a labeled event for it
        ("github", "pull_request", _event("github-pull-request-opened"), ("alice", 21031067), ()),
        # Gitea sends the labels after the change, not the change: the previews compare
        (
            "gitea",
            "pull_request_label",
            _event("gitea-pull-request-opened", _set("action", "label_updated")),
            ("alice", 2),
            None,
        ),
        (
            "gitlab",
            "Merge Request Hook",
            _event("gitlab-merge-request-labeled-fork"),
            ("carol", 7),
            ("preview",),
        ),
        ("gitlab", "Merge Request Hook", _event("gitlab-merge-request-update"), ("alice", 4), ()),
    ],
)
def test_an_event_says_who_acted_and_which_labels_it_added(forge, event, body, sender, added):
    found = pull_request_event(forge, event, body)
    assert found is not None
    assert (found.sender, found.sender_id) == sender
    assert found.labels_added == added


def test_api_objects():
    github = json.loads((PAYLOADS / "github-pull-request-opened.json").read_text())
    assert pull_from_api("github", github["pull_request"]) == _pr(42, "open", SHA_OPENED)
    gitlab = {
        "iid": 5,
        "state": "opened",
        "sha": "da1560886d4f094c3e6c9ef40349f7d38b5d27d7",
        "title": "greet: say hello v2",
        "author": {"id": 4, "username": "alice"},
        "source_branch": "greet-v2",
        "target_branch": "main",
        "labels": ["preview"],
        "source_project_id": 15,
        "target_project_id": 15,
    }
    expected = _pr(5, "open", "da1560886d4f094c3e6c9ef40349f7d38b5d27d7")
    assert pull_from_api("gitlab", gitlab) == expected
    fork = pull_from_api("gitlab", {**gitlab, "source_project_id": 99})
    assert fork.same_repo is False
    assert pull_from_api("gitlab", {**gitlab, "target_project_id": None}).same_repo is None
    with pytest.raises(PayloadError, match="'iid'"):
        pull_from_api("gitlab", {"state": "opened"})


@pytest.mark.parametrize(
    ("ref", "number"),
    [
        ("refs/pull/7/head", 7),
        ("refs/merge-requests/123/head", 123),
        ("refs/pull/7/merge", None),
        ("refs/pull/07/head", None),
        ("refs/pull/0/head", None),
        ("refs/pull/x/head", None),
        ("refs/heads/pull/7/head", None),
        ("refs/pull/7/head/extra", None),
        ("refs/pull/99999999999/head", None),
        ("", None),
    ],
)
def test_pull_number_from_ref(ref, number):
    assert pull_number_from_ref(ref) == number
