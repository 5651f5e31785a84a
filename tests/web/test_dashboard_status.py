"""What the dashboard says of syncs, previews, shared builds and revisions, in Chromium.

Each test runs a real ``serve`` against a real git server and looks at the pages the
way a person does (see test_dashboard.py for the browser and its tabs).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import expect

from .. import gitserver
from ..gitserver import GitDaemon
from ..previews import test_previews as previews
from ..previews.test_previews import github_pull, in_state, send, until
from ..test_serve import HTTP, Setup, handler, manifest
from .test_dashboard import browser, playwright, tabs

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["browser", "playwright", "tabs"]  # the browser fixtures, shared


@pytest.fixture
def repo(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[Setup]:
    s = Setup(tmp_path, git_daemon, git_root)
    yield s
    for server in s.servers:
        server.stop()


@pytest.fixture
def prs(tmp_path: Path, git_daemon: GitDaemon, git_root: Path) -> Iterator[previews.Setup]:
    s = previews.Setup(tmp_path, git_daemon, git_root)
    yield s
    for server in s.servers:
        server.stop()


def test_previews_show_their_pull_request_state_and_sync_history_per_environment(prs, tabs):
    prs.push_main(previews.repository("main", count=2))
    server = prs.serve(args=["--forge", "github"])
    head = prs.push_pull(6, previews.change("v2"))
    opened = github_pull("opened", 6, head, "greet: say v2")
    assert send(server, "github", opened, "pull_request").status_code == 202
    until(in_state(server, 6, "Ready", head), "pr-6 Ready", server)
    broken = {"greet/sless.yaml": "functions:\n  - name: greet\n    runtime: cobol\n"}
    bad = prs.push_pull(7, broken)
    send(server, "github", github_pull("opened", 7, bad, "break greet"), "pull_request")
    until(in_state(server, 7, "Failed", bad), "pr-7 Failed", server)
    server.sync()
    server.sync()  # a repeat: the row's latest pass is later than its end

    page = tabs.open(server.base)
    page.goto("/")

    ready = page.locator("#preview-pr-6")
    expect(ready).to_contain_text("Ready")
    expect(ready.locator("a.pr-link")).to_have_text("#6 greet: say v2")
    expect(ready.locator("a.pr-link")).to_have_attribute("href", re.compile(r"/pull/6$"))
    expect(ready).to_contain_text("alice")
    expect(ready).to_contain_text("change-6 → main")
    expect(ready).to_contain_text(head[:7])
    failed = page.locator("#preview-pr-7")
    expect(failed).to_contain_text("Failed greet: invalid manifest")

    # one definition of "last sync": the header and prod's section show the same instant
    header_time = page.locator("#top div", has_text="Last sync").locator("time").first
    section_time = page.locator("#env-prod p.muted time").first
    assert header_time.get_attribute("datetime") == section_time.get_attribute("datetime")

    history = page.locator("#syncs tbody")
    envs = {
        text.strip() for text in history.locator("td[data-label=Environment]").all_inner_texts()
    }
    assert {"prod", "pr-6", "pr-7"} <= envs
    page.locator("#syncs nav a", has_text="pr-6").click()
    expect(page).to_have_url(re.compile(r"\?syncs=pr-6"))
    cells = page.locator("#syncs tbody td[data-label=Environment]")
    expect(cells.first).to_have_text("pr-6")
    assert set(cells.all_inner_texts()) == {"pr-6"}
    assert tabs.tab(page).problems == []


TWO = """functions:
  - name: alpha
    runtime: python3.11
    entrypoint: handler.main
    triggers: [{type: http}]
  - name: beta
    runtime: python3.11
    entrypoint: handler.main
    triggers: [{type: http}]
"""


def test_a_shared_build_names_its_folder_and_every_function_it_builds(repo, tabs):
    repo.push({"pair/sless.yaml": TWO, "pair/handler.py": handler("pair")})
    server = repo.serve()
    server.wait(lambda: (server.function("beta") or {}).get("phase") == "Ready", "beta Ready")

    page = tabs.open(server.base)
    page.goto("/functions/prod/beta")
    built = page.locator("#build .built-with")
    expect(built).to_have_text("Folder pair builds 2 functions: alpha, beta.")


def test_after_a_restart_each_function_shows_the_revision_it_was_deployed_from(repo, tabs):
    first = repo.push(
        {
            "one/sless.yaml": manifest("one", HTTP),
            "one/handler.py": handler("one"),
            "two/sless.yaml": manifest("two", HTTP),
            "two/handler.py": handler("two v1"),
        },
        message="both",
    )
    server = repo.serve()
    server.wait(lambda: (server.function("two") or {}).get("revision") == first, "two at first")
    second = repo.push({"two/handler.py": handler("two v2")}, message="only two")
    server.sync()
    server.wait(lambda: (server.function("two") or {}).get("revision") == second, "two at second")
    server.stop()

    again = repo.serve()
    page = tabs.open(again.base)
    page.goto("/")
    expect(page.locator("#fn-prod-one code[title]").nth(1)).to_have_attribute("title", first)
    expect(page.locator("#fn-prod-two code[title]").nth(1)).to_have_attribute("title", second)
    page.goto("/functions/prod/one")
    expect(page.locator("main dl.facts")).to_contain_text(first[:7])
