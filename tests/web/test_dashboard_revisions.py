"""A function's revisions on its dashboard page, in a real Chromium against a real
``serve``: the kept revisions and which serves; signed in with the API token, a button
rolls back to one (the function then says it is pinned, and serves the old code) and
another unpins it; signed in with the read token, no button at all.
"""

from __future__ import annotations

import re

from playwright.sync_api import expect

from ..sless_server import TOKEN
from ..test_serve import http_function
from .test_dashboard import browser, git_daemon, git_root, playwright, setup, tabs

__all__ = ["browser", "git_daemon", "git_root", "playwright", "setup", "tabs"]  # fixtures


def test_roll_back_and_unpin_from_the_functions_page(setup, tabs):
    setup.push(http_function("greet", "hello v1"))
    server = setup.serve()
    setup.push(http_function("greet", "hello v2"))
    server.sync()
    assert server.call("greet").json()["message"] == "hello v2"

    # the read token reads: the revisions, no button
    reader = tabs.open(server.base)
    reader.goto("/functions/prod/greet")
    table = reader.locator("#revisions table")
    expect(table).to_contain_text("r2")
    expect(table).to_contain_text("r1")
    expect(reader.locator("#revisions button")).to_have_count(0)

    page = tabs.open(server.base, token=TOKEN)
    page.goto("/functions/prod/greet")
    revisions = page.locator("#revisions")
    expect(revisions.locator("tbody tr").first).to_contain_text("serving")
    page.get_by_role("button", name="Roll back to r1").click()
    expect(page).to_have_url(re.compile(r"/functions/prod/greet$"))
    expect(revisions.locator(".pinned")).to_contain_text("Pinned at r1 by dashboard")
    assert server.call("greet").json()["message"] == "hello v1"
    assert server.function("greet")["pinned"] == "r1"

    page.get_by_role("button", name="Unpin").click()
    expect(page).to_have_url(re.compile(r"/functions/prod/greet$"))
    server.wait(lambda: server.call("greet").json()["message"] == "hello v2", "git's version")
    page.reload()
    expect(revisions.locator(".pinned")).to_have_count(0)
    assert tabs.tab(page).problems == []
