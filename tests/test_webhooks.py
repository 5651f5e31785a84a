"""Webhook signatures for GitHub, Gitea and GitLab, and push parsing."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from gitops_sless import webhooks

SECRET = "s3cret"
BODY = json.dumps({"ref": "refs/heads/main", "after": "abc"}).encode()


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


def test_push_that_is_not_json_is_a_clear_error():
    with pytest.raises(ValueError, match="not a JSON object"):
        webhooks.parse_push("github", {"x-github-event": "push"}, b"[1]")
