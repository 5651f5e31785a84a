"""What each kind of provider is sent for a batch of events, as bytes and headers.

- ``webhook``: ``{"source": "gitops-sless", "events": [...]}`` (each event's
  :meth:`~.events.Event.fields`), signed as Flux's ``generic-hmac`` provider signs:
  ``X-Signature: sha256=<hex HMAC-SHA256 of the body>`` with the provider's key.
- ``slack``: an incoming webhook's Block Kit message: ``text`` (the notification's
  fallback) and ``blocks``, a section of mrkdwn per event.
- ``teams``: a message with one Adaptive Card (1.4) attachment, a RichTextBlock per
  event (a TextRun: no Markdown, so a repository's text cannot carry a link).

Text from the repository (an author, a cause, a PR's head) is inert in each format: in
Slack's mrkdwn ``&``, ``<``, ``>`` are escaped everywhere (``text`` too), ``*_~` ``
get a zero-width space, and a cause cannot end its code block.

No payload carries the provider's address; a cause is cut to a thousand characters, and
a message to Slack or Teams is kept under ``MAX_BYTES`` (the outbox sends fewer events in
one message when more would not fit; Teams refuses a message over 28 KB).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any

from .events import Event

__all__ = ["MAX_BYTES", "SIGNATURE_HEADER", "body", "fitting", "sign"]

SIGNATURE_HEADER = "X-Signature"
SOURCE = "gitops-sless"
MAX_SLACK_BLOCKS = 50  # Slack refuses more
MAX_SLACK_TEXT = 3000  # characters of one section's text
MAX_LINE = 2000  # characters of one event's line in a Teams card
MAX_BYTES = {"teams": 24_000, "slack": 35_000, "webhook": 1_000_000}  # of one body


def fitting(kind: str, events: Sequence[Event]) -> int:
    """How many of ``events``, from the first, one message to ``kind`` carries within
    ``MAX_BYTES`` (always at least one: a single event is cut to fit)."""
    limit = MAX_BYTES.get(kind, MAX_BYTES["webhook"])
    low, high = 1, len(events)
    while low < high:  # the largest count whose body fits
        middle = (low + high + 1) // 2
        if len(body(kind, events[:middle])[0]) <= limit:
            low = middle
        else:
            high = middle - 1
    return low


def sign(payload: bytes, key: bytes) -> str:
    return "sha256=" + hmac.new(key, payload, hashlib.sha256).hexdigest()


def body(
    kind: str, events: Sequence[Event], key: bytes | None = None
) -> tuple[bytes, dict[str, str]]:
    """The request body and headers that tell a ``kind`` provider of ``events``."""
    if kind == "slack":
        data: dict[str, Any] = slack(events)
    elif kind == "teams":
        data = teams(events)
    else:
        data = {"source": SOURCE, "events": [event.fields() for event in events]}
    raw = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers[SIGNATURE_HEADER] = sign(raw, key)
    return raw, headers


def headline(events: Sequence[Event]) -> str:
    if len(events) == 1:
        return events[0].line()
    failed = sum(1 for event in events if event.failure)
    return f"gitops-sless: {len(events)} events" + (f", {failed} failures" if failed else "")


_ZWSP = "\u200b"  # a zero-width space: keeps a character from being read as markup


def _mrkdwn(text: str) -> str:
    """``text`` (from the repository: an author, a cause) inert in Slack's mrkdwn: no
    <!channel>, no <url|link>, no *bold*, _italics_, ~strike~ or `code` of its own."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    for mark in "*_~`":
        text = text.replace(mark, mark + _ZWSP)
    return text


def _code(text: str) -> str:
    """``text`` inert inside a ``` block: escaped, and no ``` of its own to end it."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("`", "`" + _ZWSP)


def slack(events: Sequence[Event]) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    shown = list(events[: MAX_SLACK_BLOCKS - 1])
    for event in shown:
        text = f"*{_mrkdwn(event.line())}*"
        cause = event.short_cause()
        if cause:
            text += "\n```" + _code(cause) + "```"
        blocks.append(
            {"type": "section", "text": {"type": "mrkdwn", "text": text[:MAX_SLACK_TEXT]}}
        )
    if len(events) > len(shown):
        more = f"and {len(events) - len(shown)} more"
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": more}]})
    return {"text": _mrkdwn(headline(events))[:MAX_SLACK_TEXT], "blocks": blocks}


def _plain(text: str, **style: Any) -> dict[str, Any]:
    """A RichTextBlock of one TextRun: Teams renders no Markdown in a TextRun, so text
    from the repository (an author, a cause) cannot carry a link or formatting."""
    run = {"type": "TextRun", "text": text[:MAX_LINE], **style}
    return {"type": "RichTextBlock", "inlines": [run]}


def teams(events: Sequence[Event]) -> dict[str, Any]:
    card_body = [_plain(headline(events), weight="Bolder")]
    for event in events:
        if len(events) > 1:
            card_body.append(_plain(event.line()))
        cause = event.short_cause()
        if cause:
            card_body.append(_plain(cause, fontType="Monospace"))
    card = {
        "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
        "type": "AdaptiveCard",
        "version": "1.4",
        "body": card_body,
    }
    return {
        "type": "message",
        "attachments": [
            {"contentType": "application/vnd.microsoft.card.adaptive", "content": card}
        ],
    }
