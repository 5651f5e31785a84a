"""Webhook payloads from GitHub, Gitea and GitLab: signature checks and push parsing.

Pure functions over headers and body bytes, so the HTTP layer stays thin and
every rule here is tested without a server. Comparisons are constant-time.

Each forge has its own secret (:func:`secret_for`), falling back to one shared
by all: GitLab sends its secret in clear (``X-Gitlab-Token``), so a shared one
seen in a single GitLab delivery would sign GitHub and Gitea events too. A
delivery is known again by its id (:func:`delivery_id`) and, for pull-request
events, by its body (:func:`body_digest`): the signature covers the body only,
so an id is what a replayer can change, never the body.
A push body is parsed into a validated model by pydantic's JSON parser, which
refuses nesting deeper than a couple of hundred levels, so a hostile body is a
``PayloadError`` naming the reason, never a crash.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "DELIVERY_HEADERS",
    "FORGES",
    "FORWARDED_BY",
    "PayloadError",
    "Push",
    "PushPayload",
    "SignatureError",
    "body_digest",
    "delivery_id",
    "forwardable",
    "parse_payload",
    "parse_push",
    "secret_for",
    "verify",
]

FORGES = ("github", "gitea", "gitlab")
# the id a forge gives each event; a redelivery of the event carries the same one
DELIVERY_HEADERS = {
    "github": "X-GitHub-Delivery",
    "gitea": "X-Gitea-Delivery",
    "gitlab": "X-Gitlab-Event-UUID",
}
MAX_DELIVERY_ID = 200  # forges send a UUID (36 characters)
# set on a delivery a replica that does not lead hands to the leader: never handed on again
FORWARDED_BY = "X-Sless-Forwarded-By"
_FORGE_HEADER_PREFIXES = ("x-github-", "x-hub-", "x-gitea-", "x-gogs-", "x-gitlab-")


class SignatureError(Exception):
    """The request is not from the forge: 401, and nothing is synced."""


class PayloadError(ValueError):
    """A signed body that is not a push payload: 400 with the reason, and nothing is synced."""


class PushPayload(BaseModel):
    """The part of a push event that matters here; GitHub, Gitea and GitLab all send it."""

    model_config = ConfigDict(strict=True, extra="ignore")

    ref: str


# JSON names for the Python types pydantic reports in a wrong value
_JSON_TYPES = {
    "dict": "an object",
    "list": "an array",
    "str": "a string",
    "int": "a number",
    "float": "a number",
    "bool": "a boolean",
    "NoneType": "null",
}


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


def secret_for(forge: str, secrets: Mapping[str, str | None], default: str | None) -> str | None:
    """The secret that signs ``forge``'s webhooks: its own, else the shared ``default``."""
    return secrets.get(forge) or default or None


def delivery_id(forge: str, headers: Mapping[str, str]) -> str | None:
    """The forge's id of this delivery, or None when it sent none (PayloadError if absurd)."""
    given = headers.get(DELIVERY_HEADERS[forge].lower(), "").strip()
    if len(given) > MAX_DELIVERY_ID:
        raise PayloadError(f"{DELIVERY_HEADERS[forge]} is longer than {MAX_DELIVERY_ID} characters")
    return given or None


def forwardable(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of a delivery that the leader needs to verify and read it again: the
    forge's own (signature, event, delivery id) and the content type, nothing else."""
    return {
        name: value
        for name, value in headers.items()
        if name.lower() == "content-type" or name.lower().startswith(_FORGE_HEADER_PREFIXES)
    }


def body_digest(body: bytes) -> str:
    """What knows a signed body again, whatever id its delivery claims."""
    return hashlib.sha256(body).hexdigest()


def _event(forge: str, headers: Mapping[str, str]) -> str:
    raw = {
        "github": headers.get("x-github-event", ""),
        "gitea": headers.get("x-gitea-event", ""),
        "gitlab": headers.get("x-gitlab-event", ""),
    }[forge]
    return {"Push Hook": "push", "Merge Request Hook": "merge_request"}.get(raw, raw.lower())


def _json_type(value: object) -> str:
    return _JSON_TYPES.get(type(value).__name__, type(value).__name__)


def _reason(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    kind, where = first["type"], ".".join(str(part) for part in first["loc"])
    if kind == "json_invalid":
        return f"push payload is not valid JSON: {first.get('ctx', {}).get('error', '?')}"
    if kind == "model_type":
        return f"push payload must be a JSON object, not {_json_type(first['input'])}"
    if kind == "missing":
        return f"push payload has no {where!r} field"
    if kind == "string_type":
        return f"push payload field {where!r} must be a string, not {_json_type(first['input'])}"
    return f"push payload field {where!r}: {first['msg']}"


def parse_payload(body: bytes) -> PushPayload:
    """``body`` as a push payload, or PayloadError saying what is wrong with it."""
    try:
        return PushPayload.model_validate_json(body)
    except ValidationError as exc:
        raise PayloadError(_reason(exc)) from None


def parse_push(forge: str, headers: Mapping[str, str], body: bytes) -> Push:
    """The event and, for a push, its branch (``refs/heads/x`` -> ``x``)."""
    event = _event(forge, headers)
    if event != "push":
        return Push(event, None)
    ref = parse_payload(body).ref
    branch = ref.removeprefix("refs/heads/") if ref.startswith("refs/heads/") else None
    return Push(event, branch)
