"""The dashboard's layout for a new user (issue 33 item 13), in a real Chromium: at 375 px
the functions are a compact list, one line each, with a filter for those that are not
Ready; URLs wrap at '/', never inside a name; a function's page shows its log's tail."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from ..test_serve import HTTP, git_daemon, git_root, manifest, setup
from .test_dashboard import JOB_ERROR, browser, fleet, playwright, tabs

# the fixtures, shared
__all__ = ["browser", "fleet", "git_daemon", "git_root", "playwright", "setup", "tabs"]

# where each character of the link lands: the characters after which a line ends
LINE_ENDS = """(a) => {
  a.style.display = 'inline-block';
  a.style.width = '18ch';  /* narrower than the URL, wider than any of its parts */
  const chars = [];
  const walk = document.createTreeWalker(a, NodeFilter.SHOW_TEXT);
  while (walk.nextNode()) {
    const text = walk.currentNode;
    for (let i = 0; i < text.length; i++) {
      const range = document.createRange();
      range.setStart(text, i);
      range.setEnd(text, i + 1);
      const box = range.getClientRects()[0];
      if (box) chars.push([text.data[i], Math.round(box.top)]);
    }
  }
  const ends = [];
  for (let i = 1; i < chars.length; i++) {
    if (chars[i][1] > chars[i - 1][1]) ends.push(chars[i - 1][0]);
  }
  return ends;
}"""


def test_on_a_phone_each_function_is_one_line_and_the_list_filters_the_not_ready(fleet, tabs):
    page = tabs.open(fleet, width=375)
    page.goto("/")
    greet = page.locator("#fn-prod-greet")
    expect(greet.locator(".badge")).to_have_text(re.compile("Ready$"))
    name_box = greet.locator("th").bounding_box()
    badge_box = greet.locator(".badge").bounding_box()
    row_box = greet.bounding_box()
    assert name_box and badge_box and row_box
    assert abs(name_box["y"] - badge_box["y"]) < name_box["height"], "name and phase on a line"
    assert row_box["height"] < 3 * name_box["height"], row_box  # a line, not a card
    assert not greet.locator("a.url").is_visible()  # on its page, a tap away
    # a function with a problem says it below its name
    expect(page.locator("#fn-prod-broken")).to_contain_text("memoryMB: -10")

    page.get_by_role("link", name=re.compile(r"^not Ready \(\d+\)$")).click()
    expect(page).to_have_url(re.compile(r"\?functions=unready"))
    shown = {row.get_attribute("data-phase") for row in page.locator("tr[data-phase]").all()}
    assert shown and "Ready" not in shown, shown
    expect(page.locator("#fn-prod-bad")).to_be_visible()
    expect(page.locator("#fn-prod-greet")).to_have_count(0)
    count = int(re.search(r"\((\d+)\)", page.locator(".phase-filter").inner_text())[1])
    assert count == page.locator("tr[data-phase]").count()
    page.locator(".phase-filter").get_by_role("link", name="all").click()
    expect(page.locator("#fn-prod-greet")).to_be_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= 375
    assert tabs.tab(page).problems == []


def test_urls_wrap_after_a_slash_never_inside_a_name(fleet, tabs):
    page = tabs.open(fleet, width=1280)
    page.goto("/")
    link = page.locator("#fn-prod-greet a.url")
    expect(link).to_have_text(f"{fleet}/fn/prod/greet/")  # the text, whole
    ends = link.evaluate(LINE_ENDS)
    assert ends and set(ends) == {"/"}, ends


RAISER = """
def main(event, context=None):
    raise ValueError("bad input: " + event.get("_query", {}).get("q", ""))
"""


def test_a_functions_page_shows_the_tail_of_its_log(setup, tabs):
    setup.push({"raiser/sless.yaml": manifest("raiser", HTTP), "raiser/handler.py": RAISER})
    server = setup.serve()
    server.wait(lambda: (server.function("raiser") or {}).get("phase") == "Ready", "raiser")
    assert server.call("raiser", "/", params={"q": JOB_ERROR}).status_code == 500
    page = tabs.open(server.base, width=375)
    page.goto("/functions/prod/raiser")
    log = page.locator("#replica-log")
    expect(log).to_contain_text("ValueError: bad input")  # the traceback, on its page
    expect(log.locator("mark.err").filter(has_text="ValueError").first).to_be_visible()
    expect(log).to_contain_text(JOB_ERROR)  # what the caller sent: shown as text, never run
    expect(log).to_contain_text("serving")  # the replica's start, above it
    assert tabs.tab(page).problems == []
