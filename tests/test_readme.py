"""The README and the docs say what is true: the sless.yaml reference is the schema's, and
every command they show exists and parses."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from gitops_sless import cli
from gitops_sless.manifests import reference
from gitops_sless.manifests.schema import load_schema

from .paths import ROOT

README = (ROOT / "README.md").read_text()
REFERENCE_PAGE = ROOT / "docs" / "reference.md"
# every page a user reads: the README and the docs site's own pages
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _reference_section() -> str:
    match = re.search(
        r"<!-- reference:start -->\n(.*)<!-- reference:end -->", REFERENCE_PAGE.read_text(), re.S
    )
    assert match, "docs/reference.md lost its reference markers"
    return match.group(1)


def test_the_reference_page_is_generated_from_the_schema():
    assert _reference_section() == reference.markdown(), (
        "docs/reference.md is stale: run "
        "`python -m gitops_sless.manifests.reference` and paste it between the markers"
    )


def test_reference_lists_every_function_field():
    section = _reference_section()
    for field in load_schema()["$defs"]["function"]["properties"]:
        assert f"| `{field}` |" in section


def test_schema_runtimes_are_the_runtime_folders():
    enum = load_schema()["$defs"]["function"]["properties"]["runtime"]["enum"]
    folders = sorted(p.parent.name for p in (ROOT / "runtimes").glob("*/runtime.json"))
    assert sorted(enum) == folders


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_two_commands_exist_and_ci_runs_the_test_command(page):
    text = (ROOT / page).read_text()
    start = text.index("## The two commands")
    end = text.find("\n## ", start + 1)
    two = text[start : end if end > 0 else None]
    commands = re.findall(r"^(scripts/\w+)\s+#", two, re.M)
    assert commands == ["scripts/run", "scripts/test"]
    for command in commands:
        assert (ROOT / command).stat().st_mode & 0o111
    assert "scripts/test" in (ROOT / ".ci/run").read_text()


def _shell_blocks(text: str) -> list[str]:
    return re.findall(r"^ *```(?:sh|bash|shell)\n(.*?)^ *```", text, re.M | re.S)


def _command_lines(block: str) -> list[str]:
    """The block's commands, a backslash-continued command joined into one line."""
    return block.replace("\\\n", " ").splitlines()


def _shown_commands() -> list[tuple[str, list[str]]]:
    """(page, words) of every gitops-sless invocation in a shell block of any page."""
    found = []
    for page in PAGES:
        for block in _shell_blocks(page.read_text()):
            for line in _command_lines(block):
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.whitespace_split = True
                words = list(lexer)
                for at, word in enumerate(words):
                    command = at == 0 or words[at - 1][-1] in "&|;(<"
                    if command and (word == "gitops-sless" or word.endswith("/bin/gitops-sless")):
                        args = words[at + 1 :]
                        stop = next((i for i, w in enumerate(args) if w[0] in "&|;()<>"), None)
                        found.append((page.name, args[:stop]))
    return found


def _scripts_shown() -> set[str]:
    return {
        match
        for page in PAGES
        for block in _shell_blocks(page.read_text())
        for match in re.findall(r"(?<![\w./-])((?:scripts|bench)/[\w./-]+)", block)
    }


def test_the_pages_show_gitops_sless_commands():
    # a guard for the collector below: the pages do show commands
    assert len(_shown_commands()) > 20


@pytest.mark.parametrize(
    "args", [pytest.param(args, id=f"{page}: {' '.join(args)}") for page, args in _shown_commands()]
)
def test_every_command_shown_parses(args):
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli._parser().parse_args(args)
        except SystemExit as exit:
            assert exit.code == 0, errors.getvalue()  # --version and --help exit 0


@pytest.mark.parametrize("path", sorted(_scripts_shown()))
def test_every_script_shown_exists(path):
    assert (ROOT / path).exists(), f"a page shows {path}, which does not exist"
    if path.startswith("scripts/") or "." not in Path(path).name:
        assert (ROOT / path).stat().st_mode & 0o111, f"{path} is not executable"


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    assert len(README.splitlines()) < 200
    links = set(re.findall(r"\]\(([^)#\s]+)", README))
    for link in links - {"docs/"}:
        if "://" not in link:
            assert (ROOT / link).exists(), f"README links {link}, which does not exist"
    # index.md is the site's copy of this front page; changelog.md includes CHANGELOG.md
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - {"docs/index.md", "docs/changelog.md"} <= links
    assert "CHANGELOG.md" in links
