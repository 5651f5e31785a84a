"""JSON Schemas of a Slack incoming webhook's Block Kit message and a Microsoft Teams
message with an Adaptive Card, written from their documented shapes:

- Slack: https://api.slack.com/messaging/webhooks and the Block Kit reference
  (https://api.slack.com/reference/block-kit/blocks): ``text`` is the notification's
  fallback, at most 50 ``blocks``; a ``section``'s ``text`` is a text object (``mrkdwn``
  or ``plain_text``, 1 to 3000 characters); a ``context`` block has 1 to 10 elements.
- Teams (Workflows and incoming webhooks): https://learn.microsoft.com/en-us/
  microsoftteams/platform/webhooks-and-connectors/how-to/connectors-using: a
  ``message`` whose ``attachments`` hold a card of content type
  ``application/vnd.microsoft.card.adaptive``; the card per
  https://adaptivecards.io/schemas/adaptive-card.json (type ``AdaptiveCard``, a
  ``version``, a ``body`` of elements; a ``TextBlock`` has a ``text``, Markdown; a
  ``RichTextBlock`` (1.2) has ``inlines``, TextRuns, whose ``text`` is not Markdown).
"""

from __future__ import annotations

from typing import Any

import jsonschema

__all__ = ["SLACK", "TEAMS", "check"]

_TEXT_OBJECT = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"enum": ["mrkdwn", "plain_text"]},
        "text": {"type": "string", "minLength": 1, "maxLength": 3000},
        "emoji": {"type": "boolean"},
        "verbatim": {"type": "boolean"},
    },
    "additionalProperties": False,
}

SLACK: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["text", "blocks"],
    "properties": {
        "text": {"type": "string", "minLength": 1},
        "blocks": {
            "type": "array",
            "minItems": 1,
            "maxItems": 50,
            "items": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {
                            "type": {"const": "section"},
                            "text": _TEXT_OBJECT,
                            "block_id": {"type": "string", "maxLength": 255},
                        },
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "required": ["type", "elements"],
                        "properties": {
                            "type": {"const": "context"},
                            "elements": {
                                "type": "array",
                                "minItems": 1,
                                "maxItems": 10,
                                "items": _TEXT_OBJECT,
                            },
                        },
                        "additionalProperties": False,
                    },
                ]
            },
        },
    },
    "additionalProperties": False,
}

_TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"const": "TextBlock"},
        "text": {"type": "string"},
        "wrap": {"type": "boolean"},
        "weight": {"enum": ["Default", "Lighter", "Bolder"]},
        "size": {"enum": ["Default", "Small", "Medium", "Large", "ExtraLarge"]},
        "fontType": {"enum": ["Default", "Monospace"]},
        "isSubtle": {"type": "boolean"},
    },
    "additionalProperties": False,
}

_RICH_TEXT_BLOCK = {  # TextRuns: no Markdown (adaptivecards.io/explorer/TextRun.html)
    "type": "object",
    "required": ["type", "inlines"],
    "properties": {
        "type": {"const": "RichTextBlock"},
        "inlines": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["type", "text"],
                "properties": {
                    "type": {"const": "TextRun"},
                    "text": {"type": "string"},
                    "weight": {"enum": ["Default", "Lighter", "Bolder"]},
                    "size": {"enum": ["Default", "Small", "Medium", "Large", "ExtraLarge"]},
                    "fontType": {"enum": ["Default", "Monospace"]},
                    "isSubtle": {"type": "boolean"},
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}

TEAMS: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["type", "attachments"],
    "properties": {
        "type": {"const": "message"},
        "attachments": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["contentType", "content"],
                "properties": {
                    "contentType": {"const": "application/vnd.microsoft.card.adaptive"},
                    "contentUrl": {"type": ["string", "null"]},
                    "content": {
                        "type": "object",
                        "required": ["type", "version", "body"],
                        "properties": {
                            "$schema": {
                                "const": "http://adaptivecards.io/schemas/adaptive-card.json"
                            },
                            "type": {"const": "AdaptiveCard"},
                            "version": {"type": "string", "pattern": "^1\\.[0-6]$"},
                            "body": {
                                "type": "array",
                                "minItems": 1,
                                "items": {"oneOf": [_TEXT_BLOCK, _RICH_TEXT_BLOCK]},
                            },
                        },
                        "additionalProperties": False,
                    },
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}


def check(schema: dict[str, Any], payload: Any) -> None:
    """Raises jsonschema.ValidationError unless ``payload`` has the documented shape."""
    jsonschema.Draft202012Validator(schema).validate(payload)
