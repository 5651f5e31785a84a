"""Webhook payloads from GitHub, Gitea and GitLab: signature checks and push parsing.

Pure functions over headers and body bytes, so the HTTP layer stays thin and
every rule here is tested without a server. Comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["FORGES", "Push", "SignatureError", "parse_push", "verify"]

FORGES = ("github", "gitea", "gitlab")


class SignatureError(Exception):
    """The request is not from the forge: 401, and nothing is synced."""


@dataclass(frozen=True)
class Push:
    """What a webhook tells: an event kind and, for pushes, the branch."""

    event: str
    branch: str | None


def _hmac_hex(secret: str, body: bytes) -> str:
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(forge: str, headers: Mapping[str, str], body: bytes, secret: str) -> None:
    """Raise SignatureError unless ``body`` carries a valid signature for ``secret``."""
    if forge == "github":
        given = headers.get("x-hub-signature-256", "")
        if not given.startswith("sha256="):
            raise SignatureError("missing X-Hub-Signature-256 (sha256=...)")
        expected = "sha256=" + _hmac_hex(secret, body)
    elif forge == "gitea":
        given = headers.get("x-gitea-signature", "")
        if not given:
            raise SignatureError("missing X-Gitea-Signature")
        expected = _hmac_hex(secret, body)
    elif forge == "gitlab":
        given = headers.get("x-gitlab-token", "")
        if not given:
            raise SignatureError("missing X-Gitlab-Token")
        expected = secret
    else:
        raise SignatureError(f"unknown forge {forge!r}")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise SignatureError("signature does not match")


def _event(forge: str, headers: Mapping[str, str]) -> str:
    raw = {
        "github": headers.get("x-github-event", ""),
        "gitea": headers.get("x-gitea-event", ""),
        "gitlab": headers.get("x-gitlab-event", ""),
    }[forge]
    return {"Push Hook": "push", "Merge Request Hook": "merge_request"}.get(raw, raw.lower())


def parse_push(forge: str, headers: Mapping[str, str], body: bytes) -> Push:
    """The event and, for a push, its branch (``refs/heads/x`` -> ``x``)."""
    event = _event(forge, headers)
    if event != "push":
        return Push(event, None)
    try:
        ref = json.loads(body).get("ref", "")
    except (ValueError, AttributeError) as exc:
        raise ValueError("push payload is not a JSON object with 'ref'") from exc
    branch = ref.removeprefix("refs/heads/") if ref.startswith("refs/heads/") else None
    return Push(event, branch)
