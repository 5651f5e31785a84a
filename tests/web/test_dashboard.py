"""The dashboard in a real headless Chromium, against a real ``serve`` and git server.

Chromium is Debian's (``/usr/bin/chromium``, which ``scripts/test`` installs),
driven by Playwright; no browser is ever downloaded. One server holds a
repository with a function of every kind (ready, failed build, invalid
manifest, a job that fails) for the tests that only look; a test that pushes
gets a server of its own. Screenshots go to ``test-artifacts/screenshots/``.

The servers have a token, so every tab signs in first (with the read token,
through the sign-in form's endpoint) unless a test opens it signed out.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, Playwright, expect, sync_playwright

from gitops_sless.state.store import Store
from gitops_sless.web.api import create_api

from .. import gitserver
from ..gitserver import GitDaemon
from ..paths import ROOT
from ..sless_server import READ_TOKEN
from ..test_serve import HTTP, Setup, handler, http_function, manifest, setup
from .test_api import Client, RecordingReconciler

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
SUBJECT = "Show <script>alert(1)</script> as text, never run it"
JOB_ERROR = "<img src=x onerror=alert(2)>"
MISSING = "sless-no-such-package"
RESULT = "stamp-result-4c1d8e"  # what a job returned: for signed-in eyes only
# pip finds nothing: no index, and no machine-wide config pointing at local wheels
expect.set_options(timeout=15_000)  # a loaded machine; the page refreshes every 2.5 s
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}

WORKER = f"""
def main(event, context=None):
    if event.get("boom"):
        raise ValueError({JOB_ERROR!r})
    return {{"ok": True}}
"""

FLEET = {
    **http_function("greet", "hello from greet"),
    **http_function("bad", "never served"),
    "bad/requirements.txt": f"{MISSING}==1.0\n",
    "broken/sless.yaml": manifest("broken", HTTP, "    memoryMB: -10"),
    "broken/handler.py": handler("never served"),
    "worker/sless.yaml": manifest("worker", "    jobs: [{name: boom, runId: 1, event: {boom: 1}}]"),
    "worker/handler.py": WORKER,
    "stamp/sless.yaml": manifest(
        "stamp", f"    jobs: [{{name: stamp-it, runId: 1, event: {{mark: {RESULT}}}}}]"
    ),
    "stamp/handler.py": "def main(event, context=None):\n    return {'mark': event['mark']}\n",
}


# --- a browser, and a server to point it at -------------------------------------------------


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as pw:
        yield pw


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: scripts/test installs it (apt-get install chromium)")
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
    yield browser
    browser.close()


class Tab:
    """One page in its own browser context, recording what a person would be shown by mistake."""

    def __init__(
        self, browser: Browser, base: str, width: int, scheme: str, token: str | None
    ) -> None:
        self.context = browser.new_context(
            base_url=base,
            viewport={"width": width, "height": 800},
            color_scheme=scheme,  # type: ignore[arg-type]
        )
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.problems.append(f"uncaught: {exc}"))
        self.page.on("dialog", self._dialog)
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.fetches: list[str] = []
        self.page.on("requestfinished", self._finished)
        if token:
            self.sign_in(base, token)

    def sign_in(self, base: str, token: str) -> None:
        """What posting the sign-in form does, without a page: the context gets the cookie."""
        response = self.context.request.post(
            f"{base}/signin",
            form={"token": token, "next": "/"},
            headers={"Origin": base},
            max_redirects=0,
        )
        assert response.status == 303, response.text()

    def _console(self, message: Any) -> None:
        if message.type in ("error", "warning"):
            self.problems.append(f"console.{message.type}: {message.text}")

    def _finished(self, request: Any) -> None:
        if request.resource_type == "fetch":
            self.fetches.append(request.url)

    def _dialog(self, dialog: Any) -> None:
        self.problems.append(f"dialog: {dialog.message}")
        dialog.dismiss()

    def refreshed(self) -> None:
        """Wait until the page has fetched itself again (since it was opened) and patched."""
        while self.page.url not in self.fetches:
            self.page.wait_for_timeout(100)
        self.page.wait_for_function("document.getElementById('live-status').textContent === ''")


class Tabs:
    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        self.opened: list[Tab] = []

    def open(
        self,
        base: str,
        width: int = 1280,
        scheme: str = "light",
        token: str | None = READ_TOKEN,
    ) -> Page:
        """A new tab, signed in with ``token`` (None: signed out)."""
        tab = Tab(self.browser, base, width, scheme, token)
        self.opened.append(tab)
        return tab.page

    def tab(self, page: Page) -> Tab:
        return next(tab for tab in self.opened if tab.page is page)

    def close(self) -> None:
        for tab in self.opened:
            tab.context.close()


@pytest.fixture
def tabs(browser: Browser) -> Iterator[Tabs]:
    opened = Tabs(browser)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server following a repository with one function of every kind; its base URL."""
    tmp = tmp_path_factory.mktemp("fleet")
    with GitDaemon(tmp / "served") as daemon:
        repo = Setup(tmp, daemon, tmp / "served")
        repo.push(FLEET, message=SUBJECT)
        server = repo.serve(env=OFFLINE)
        try:
            server.wait(lambda: (server.function("greet") or {}).get("phase") == "Ready", "greet")
            yield server.base
        finally:
            server.stop()


# --- what a person sees ---------------------------------------------------------------------


def test_the_page_lists_every_function_with_its_phase(fleet, tabs):
    page = tabs.open(fleet)
    sizes: list[int] = []
    page.on("response", lambda response: sizes.append(len(response.body())))
    page.goto("/")

    expected = {
        "greet": "Ready",
        "bad": "Failed",
        "broken": "Invalid",
        "worker": "Ready",
        "stamp": "Ready",
    }
    for name, phase in expected.items():
        expect(page.locator(f"#fn-prod-{name} .badge")).to_have_text(re.compile(rf"\b{phase}$"))
    expect(page.locator("#fn-prod-broken")).to_contain_text(
        "broken/sless.yaml:6: functions[0].memoryMB: -10 is less than the minimum of 64"
    )
    expect(page.locator("#fn-prod-bad")).to_contain_text(
        f"No matching distribution found for {MISSING}"
    )
    expect(page.locator("#fn-prod-greet")).to_contain_text("python3.11")
    expect(page.locator("#fn-prod-greet a.url")).to_have_text(f"{fleet}/fn/prod/greet/")
    expect(page.locator("#top")).to_contain_text(SUBJECT)
    expect(page.locator("#syncs tbody tr").first).to_contain_text(
        "Degraded"
    )  # a build and a job failed

    assert all(url.startswith(fleet) for url in tabs.tab(page).requests), "only its own server"
    assert sum(sizes) < 100_000, f"the page weighs {sum(sizes)} bytes"
    assert tabs.tab(page).problems == []


def test_a_push_shows_up_on_the_open_page_without_a_reload(setup, tabs):
    first = setup.push(http_function("greet", "v1"), message="first version")
    server = setup.serve()
    page = tabs.open(server.base)
    page.goto("/")
    row = page.locator("#fn-prod-greet")
    expect(row.locator(".badge")).to_have_text(re.compile("Ready$"))
    expect(row).to_contain_text(first[:7])
    link = row.get_by_role("link", name="greet", exact=True)
    link.focus()
    page.evaluate("window.sameDocument = true")

    second = setup.push(
        {"greet/sless.yaml": manifest("greet", HTTP, "    memoryMB: -10")}, message="less memory"
    )
    server.sync()

    expect(row.locator(".badge")).to_have_text(re.compile("Invalid$"))
    expect(row).to_contain_text("memoryMB: -10 is less than the minimum of 64")
    expect(row).to_contain_text(first[:7])  # the revision it still serves
    expect(page.locator("#top")).to_contain_text(second[:7])
    expect(page.locator("#top")).to_contain_text("less memory")
    assert page.evaluate("window.sameDocument") is True, "the page was reloaded"
    expect(link).to_be_focused()
    assert tabs.tab(page).problems == []


@pytest.mark.parametrize("width", [1280, 375])
def test_a_failing_builds_log_lines_are_visible_without_scrolling(fleet, tabs, width):
    page = tabs.open(fleet, width=width)
    page.goto("/functions/prod/bad")

    reason = page.locator(".problems").get_by_text(f"No matching distribution found for {MISSING}")
    expect(reason).to_be_in_viewport(ratio=1)
    expect(page.locator("h1 .badge")).to_have_text(re.compile("Failed$"))
    log = page.locator("#build-log")
    expect(
        log.locator("mark.err", has_text="Could not find a version that satisfies")
    ).to_have_count(1)
    expect(log).to_contain_text("pip install exited 1")
    assert tabs.tab(page).problems == []


def test_clicking_a_functions_url_returns_its_answer(fleet, tabs):
    page = tabs.open(fleet)
    page.goto("/")
    with page.expect_response(f"{fleet}/fn/prod/greet/") as answer:
        page.locator("#fn-prod-greet a.url").click()
    assert answer.value.status == 200
    assert answer.value.json()["message"] == "hello from greet"
    expect(page).to_have_url(f"{fleet}/fn/prod/greet/")
    expect(page.locator("body")).to_contain_text("hello from greet")

    page.goto("/functions/prod/greet")
    calls = page.locator("#calls")
    expect(calls.locator("tbody tr").first).to_contain_text("GET")
    expect(calls.locator("tbody tr").first).to_contain_text("200")
    expect(calls.locator("svg rect.ok")).not_to_have_count(0)


@pytest.mark.parametrize("path", ["/", "/functions/prod/worker"])
def test_the_keyboard_alone_reaches_every_link_and_shows_where_it_is(fleet, tabs, path):
    page = tabs.open(fleet)
    page.goto(path)
    links = page.eval_on_selector_all(
        "a[href]", "links => links.map(a => a.getAttribute('href') + ' ' + a.textContent)"
    )
    reached = []
    for _ in range(len(links) + 20):
        page.keyboard.press("Tab")
        focused = page.evaluate(
            """() => {
                const el = document.activeElement, style = getComputedStyle(el);
                return {link: el.matches('a[href]') ? el.getAttribute('href') + ' ' + el.textContent
                                                    : null,
                        outline: style.outlineStyle, width: parseFloat(style.outlineWidth)};
            }"""
        )
        if focused["link"]:
            reached.append(focused["link"])
            assert focused["outline"] != "none" and focused["width"] >= 2, focused
    assert reached[0] == "#main Skip to content"
    assert set(links) <= set(reached), set(links) - set(reached)

    page.locator("a.skip").focus()
    page.keyboard.press("Enter")
    expect(page.locator("main")).to_be_focused()


def test_no_page_logs_a_console_error(fleet, tabs):
    paths = ("/", "/functions/prod/greet", "/functions/prod/bad", "/functions/prod/worker")
    pages = [tabs.open(fleet, width=375, scheme="dark") for _ in paths]
    for page, path in zip(pages, paths, strict=True):
        page.goto(path)
    for page in pages:
        tabs.tab(page).refreshed()  # each has patched itself at least once
        assert tabs.tab(page).problems == [], page.url


def test_html_in_a_commit_subject_or_a_job_error_is_shown_as_text_never_run(fleet, tabs):
    page = tabs.open(fleet)
    page.goto("/")
    expect(page.locator("#top .subject")).to_have_text(SUBJECT)
    page.goto("/functions/prod/worker")
    expect(page.locator("#jobs tbody tr")).to_contain_text(f"ValueError: {JOB_ERROR}")
    expect(page.locator("#jobs .badge")).to_have_text(re.compile("Failed$"))
    expect(page.locator(".subject")).to_have_text([SUBJECT, SUBJECT])  # header, revision
    tabs.tab(page).refreshed()  # the live update escapes too
    assert page.locator("img").count() == 0
    assert page.locator("script").count() == 1  # the dashboard's own
    assert tabs.tab(page).problems == []  # no alert() dialog, no error


# --- signing in ------------------------------------------------------------------------------


def _session_cookies(page: Page) -> list[dict[str, Any]]:
    return [c for c in page.context.cookies() if c["name"] == "sless_session"]


def _shows_the_sign_in_form(page: Page) -> None:
    expect(page.get_by_label("Token")).to_be_visible()
    expect(page.get_by_role("button", name="Sign in")).to_be_visible()


def test_signing_in_with_the_read_token_and_out_again(fleet, tabs):
    page = tabs.open(fleet, token=None)
    assert page.goto("/functions/prod/stamp").status == 401
    _shows_the_sign_in_form(page)
    expect(page.get_by_label("Token")).to_be_focused()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / "signin-1280-light.png")

    page.get_by_label("Token").fill("not-the-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#signin-error")).to_have_text("That token is not valid.")
    assert _session_cookies(page) == []

    page.get_by_label("Token").fill(READ_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(f"{fleet}/functions/prod/stamp")  # back where it was going
    expect(page.locator("#jobs")).to_contain_text(RESULT)
    (cookie,) = _session_cookies(page)
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["secure"]) == (True, "Strict", False)
    assert READ_TOKEN not in cookie["value"]
    assert page.evaluate("document.cookie") == ""  # no script on the page can read it

    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(f"{fleet}/signin?signed-out")
    expect(page.locator("#signin-notice")).to_have_text("You are signed out.")
    assert _session_cookies(page) == []
    assert page.goto("/").status == 401
    _shows_the_sign_in_form(page)


def test_a_signed_out_visitor_never_sees_a_job_result_or_a_log_line(fleet, tabs):
    held = (RESULT, "Could not find a version that satisfies", "ValueError", "never run it")
    reader = tabs.open(fleet)  # first, that there is something to hide
    reader.goto("/functions/prod/stamp")
    expect(reader.locator("#jobs")).to_contain_text(RESULT)
    reader.goto("/functions/prod/bad")
    expect(reader.locator("#build-log")).to_contain_text(held[1])

    page = tabs.open(fleet, token=None)
    paths = ("/", "/functions/prod/stamp", "/functions/prod/bad", "/functions/prod/worker")
    for path in (*paths, "/api/v1/environments/prod/jobs", "/docs", "/metrics"):
        assert page.goto(path).status == 401, path
        _shows_the_sign_in_form(page)
        html = page.content()
        assert [text for text in held if text in html] == [], path


def test_an_open_page_shows_the_sign_in_form_once_its_session_ends(fleet, tabs):
    page = tabs.open(fleet)
    page.goto("/functions/prod/stamp")
    expect(page.locator("#jobs")).to_contain_text(RESULT)

    other = page.context.new_page()  # the same browser: signing out there ends this session
    other.goto("/")
    other.get_by_role("button", name="Sign out").click()
    expect(other).to_have_url(f"{fleet}/signin?signed-out")

    _shows_the_sign_in_form(page)  # its next refresh was refused
    assert RESULT not in page.content()


# --- how it looks ------------------------------------------------------------------------------


def _luminance(css: str) -> float:
    """Relative luminance (WCAG) of an ``rgb(...)``/``rgba(...)`` colour."""
    red, green, blue = (int(v) / 255 for v in re.findall(r"[\d.]+", css)[:3])
    linear = [
        c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (red, green, blue)
    ]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def _contrast(a: str, b: str) -> float:
    light, dark = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("width", [375, 1280])
def test_the_pages_fit_phone_and_desktop_in_the_systems_theme(fleet, tabs, width, scheme):
    page = tabs.open(fleet, width=width, scheme=scheme)
    page.goto("/")
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert (_luminance(background) > 0.8) if scheme == "light" else (_luminance(background) < 0.05)
    for badge in page.locator(".badge").all():
        colors = badge.evaluate(
            "b => [getComputedStyle(b).color, getComputedStyle(b).backgroundColor]"
        )
        assert _contrast(*colors) >= 4.5, (badge.inner_text(), colors)
    header = page.evaluate("getComputedStyle(document.querySelector('thead')).position")
    assert (header == "absolute") == (width < 760), "cards on a phone, a table on a desktop"

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for path, name in (("/", "dashboard"), ("/functions/prod/bad", "function")):
        page.goto(path)
        expect(page.locator("main h2").first).to_be_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= width, "scrolls sideways"
        page.screenshot(path=SCREENSHOTS / f"{name}-{width}-{scheme}.png", full_page=True)
    assert tabs.tab(page).problems == []


# --- in process -------------------------------------------------------------------------------


def _get(app: Any, url: str) -> httpx.Response:
    """One request to the app in process, on a thread of its own: Playwright's loop runs here."""
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(Client(app).get, url).result()


def test_the_header_says_when_the_next_poll_is_due_and_a_gone_function_says_so(tmp_path):
    store = Store(tmp_path / "status.db")
    polled = create_api(RecordingReconciler(), store, "main", "repo", None, None, poll_interval=30)
    assert "in about 30 s (every 30 s)" in _get(polled, "/").text
    sync = store.begin_sync("prod", "poll")
    assert "a sync is running" in _get(polled, "/").text
    store.finish_sync(sync, "Succeeded", "a" * 40)
    assert "in about 30 s (every 30 s)" in _get(polled, "/").text

    unpolled = create_api(RecordingReconciler(), store, "main", "repo", None, None)
    assert "Next poll" not in _get(unpolled, "/").text
    gone = _get(unpolled, "/functions/prod/nothing")
    assert gone.status_code == 404
    assert "No function nothing in prod" in gone.text


TRACED = """\
def main(event, context):
    print("serving", event["_path"])
    return {"ok": True}
"""
CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
VIEWER = "http://traces.example/trace/{trace_id}"


def test_each_call_links_its_log_lines_and_its_trace_and_says_if_it_was_cold(setup, tabs):
    setup.push(
        {
            "zero/sless.yaml": manifest("zero", HTTP, "    scale: {min: 0, max: 1, idle: 1s}"),
            "zero/handler.py": TRACED,
        }
    )
    fast = ["--scale-window", "3s", "--scale-panic-window", "1s", "--scale-tick", "0.2s"]
    server = setup.serve(args=[*fast, "--trace-url-template", VIEWER], env=OFFLINE)
    server.wait(lambda: (server.function("zero") or {}).get("phase") == "Idle", "zero idle")
    cold = server.call("zero", "/first", headers={"traceparent": CALLER, "x-request-id": "req-1"})
    assert cold.status_code == 200 and "x-sless-cold-start" in cold.headers
    assert server.call("zero", "/second").status_code == 200

    def calls() -> list[dict[str, Any]]:
        return (server.function("zero") or {}).get("invocations") or []

    server.wait(lambda: len(calls()) >= 2, "both calls in the history")
    page = tabs.open(server.base)
    page.goto("/functions/prod/zero")
    rows = page.locator("#calls tbody tr")
    expect(rows).to_have_count(2)
    warm, first = rows.nth(0), rows.nth(1)
    expect(first).to_contain_text("cold,")
    expect(warm).not_to_contain_text("cold")
    # the trace viewer's link names the caller's trace; the second call's trace is its own
    trace = first.locator("a", has_text="trace")
    expect(trace).to_have_attribute("href", VIEWER.replace("{trace_id}", CALLER[3:35]))
    own = warm.locator("a", has_text="trace")
    second_id = calls()[0]["requestId"]
    expect(own).to_have_attribute("href", VIEWER.replace("{trace_id}", second_id))
    # the request id opens the lines the handler printed serving it, and no other
    link = first.locator("a", has_text="req-1")
    expect(link).to_have_attribute("href", re.compile(r"/logs\?request=req-1$"))
    link.click()
    expect(page.locator("body")).to_contain_text(f"trace_id={CALLER[3:35]}] serving /first")
    expect(page.locator("body")).not_to_contain_text("/second")
