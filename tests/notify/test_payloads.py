"""What a repository's text can do to a chat message: nothing. An author, a cause or a
preview's head that carries a link, a mention or formatting comes out inert in Slack's
mrkdwn and in a Teams card; and each message keeps its documented shape."""

from __future__ import annotations

import json
import re

import pytest

from gitops_sless.notify import Event
from gitops_sless.notify.payloads import body

from .. import chat_schemas

LINK = "[Sign in](https://phish.example)"
SLACK_LINK = "<https://phish.example|click>"
MENTION = "<!channel>"
AUTHOR = f"Eve *bold* _it_ ~x~ {LINK} {SLACK_LINK} {MENTION}"
CAUSE = f"ok```\n{MENTION} {SLACK_LINK} {LINK}\n```"

EVENTS = {
    "deployed": Event("deployed", "prod", "greet", revision="r3", commit="c" * 40, author=AUTHOR),
    "failed": Event("startFailed", "prod", "greet", cause=CAUSE),
}


def slack_texts(events: list[Event]) -> list[str]:
    data = json.loads(body("slack", events)[0])
    chat_schemas.check(chat_schemas.SLACK, data)
    return [data["text"]] + [b["text"]["text"] for b in data["blocks"] if b["type"] == "section"]


@pytest.mark.parametrize("which", [["deployed"], ["failed"], ["deployed", "failed"]])
def test_a_repository_s_text_carries_no_mention_link_or_format_into_slack(which):
    for text in slack_texts([EVENTS[name] for name in which]):
        assert "<" not in text and ">" not in text  # no <!channel>, no <url|text>
        line, _, cause = text.partition("\n```")
        line = line.removeprefix("*").removesuffix("*")  # the line, in bold
        assert not re.search(r"[*_~`](?!\u200b)", line)  # no markup of its own
        if cause:  # one code block, which it cannot end
            assert cause.endswith("```") and "```" not in cause[:-3]


@pytest.mark.parametrize("which", [["deployed"], ["failed"], ["deployed", "failed"]])
def test_a_repository_s_text_is_no_markdown_in_a_teams_card(which):
    data = json.loads(body("teams", [EVENTS[name] for name in which])[0])
    chat_schemas.check(chat_schemas.TEAMS, data)
    card = data["attachments"][0]["content"]["body"]
    markdown = [b["text"] for b in card if b["type"] == "TextBlock"]  # rendered as Markdown
    assert not any("phish" in text or "*" in text or "[" in text for text in markdown)
    runs = [run["text"] for b in card if b["type"] == "RichTextBlock" for run in b["inlines"]]
    assert any(LINK in text for text in runs)  # said as it is, as plain text
