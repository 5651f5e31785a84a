"""The documentation site builds offline and its configuration page is complete."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from gitops_sless import cli

from .paths import ROOT

DOCS = ROOT / "docs"
CONFIGURATION = (DOCS / "configuration.md").read_text()

# every SLESS_* name the package spells out in full, read or handed to function code
_SLESS_NAME = re.compile(r"[\"'](SLESS_[A-Z0-9_]*[A-Z0-9])[\"']")
# other variables the package reads from its environment (KUBECONFIG, AWS_*, NO_COLOR...)
_READ_NAME = re.compile(r"(?:environ\.get\(|environ\[|getenv\()\s*[\"']([A-Z][A-Z0-9_]*)[\"']")
# TMPDIR: the sandbox sets it for installers; SLESS_TYPES: tfimport's resource types, a
# Python name in an __all__
_NOT_SETTINGS = {"TMPDIR", "SLESS_TYPES"}


def _package_sources() -> list[str]:
    return [path.read_text() for path in (ROOT / "gitops_sless").rglob("*.py")]


def environment_variables() -> set[str]:
    """Every environment variable name gitops_sless reads or gives to function code."""
    names: set[str] = set()
    for source in _package_sources():
        names.update(_SLESS_NAME.findall(source))
        names.update(_READ_NAME.findall(source))
    return names - _NOT_SETTINGS


def serve_flags() -> set[str]:
    commands = next(action for action in cli._parser()._actions if action.dest == "command").choices
    return {
        flag
        for action in commands["serve"]._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }


def _mentioned(name: str, text: str) -> bool:
    # --preview-ttl must not count as --preview, SLESS_FORGE_API as SLESS_FORGE
    return re.search(re.escape(name) + r"(?![A-Za-z0-9_-])", text) is not None


def test_the_collected_names_are_the_ones_serve_knows():
    # a sanity check of the collectors, so an empty set cannot pass the tests below
    assert {"--repo", "--previews", "--backend", "--trusted-proxies"} <= serve_flags()
    assert {"SLESS_API_TOKEN", "SLESS_PROXY_MAX_CONNECTIONS", "AWS_ACCESS_KEY_ID"} <= (
        environment_variables()
    )


@pytest.mark.parametrize("flag", sorted(serve_flags()))
def test_every_serve_flag_is_on_the_configuration_page(flag):
    assert _mentioned(flag, CONFIGURATION), f"docs/configuration.md does not mention {flag}"


@pytest.mark.parametrize("variable", sorted(environment_variables()))
def test_every_environment_variable_is_on_the_configuration_page(variable):
    assert _mentioned(variable, CONFIGURATION), (
        f"docs/configuration.md does not mention {variable}, which gitops_sless reads"
    )


def _build(project: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` as scripts/test runs it."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=project,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `mkdocs build --strict` writes it."""
    out = tmp_path_factory.mktemp("site")
    build = _build(ROOT, out)
    assert build.returncode == 0, build.stderr
    return out


@pytest.mark.parametrize(
    "link",
    [
        pytest.param("[gone](no-such-page.md)", id="missing-page"),
        pytest.param("[gone](concepts.md#no-such-section)", id="missing-anchor"),
        pytest.param("[outside](../README.md)", id="outside-docs"),
    ],
)
def test_a_broken_link_fails_the_build(tmp_path, link):
    project = tmp_path / "project"
    for name in ("mkdocs.yml", "CHANGELOG.md", "bench/README.md"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(DOCS, project / "docs")
    with (project / "docs/index.md").open("a") as index:
        index.write(f"\nSee {link}.\n")
    build = _build(project, tmp_path / "site")
    assert build.returncode != 0
    target = link[link.index("(") + 1 : -1]
    assert target.split("#")[-1] in build.stderr  # the warning names what is broken


def test_the_site_has_every_page_of_the_navigation(site):
    pages = {path.stem for path in DOCS.glob("*.md")}
    assert pages <= {path.stem for path in site.glob("*.html")}
    assert "Every setting of" in (site / "configuration.html").read_text()


def test_the_changelog_page_is_the_changelog(site):
    entries = [
        line[2:].replace("`", "").strip()
        for line in (ROOT / "CHANGELOG.md").read_text().splitlines()
        if line.startswith("- ")
    ]
    page = _text(site / "changelog.html")
    assert entries
    assert entries[0][:40] in page
    assert entries[-1][:40] in page


def test_the_benchmarks_page_is_bench_readme(site):
    assert "Every benchmark runs in CI at a tiny size." in _text(site / "benchmarks.html")


class _Assets(HTMLParser):
    """Every URL a page loads by itself: stylesheets, icons, scripts, images, frames."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "link" and found.get("href"):
            self.urls.append(found["href"] or "")
        if tag in ("script", "img", "iframe", "source", "video", "audio") and found.get("src"):
            self.urls.append(found["src"] or "")


def _assets(page: Path) -> list[str]:
    parser = _Assets()
    parser.feed(page.read_text())
    return parser.urls


def test_no_page_loads_anything_from_another_host(site):
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 10
    external = {
        f"{page.relative_to(site)}: {url}"
        for page in pages
        for url in _assets(page)
        if re.match(r"(?i)([a-z][a-z0-9+.-]*:)?//", url)
    }
    assert not external
    stylesheets = (site / "assets/stylesheets").glob("*.css")
    assert not [css.name for css in stylesheets if "@import url(http" in css.read_text()]


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))
