"""The README's sless.yaml reference is the schema's, and its commands exist."""

from __future__ import annotations

import re
from pathlib import Path

from gitops_sless import reference
from gitops_sless.schema import load_schema

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _reference_section() -> str:
    match = re.search(r"<!-- reference:start -->\n(.*)<!-- reference:end -->", README, re.S)
    assert match, "README lost its reference markers"
    return match.group(1)


def test_readme_reference_is_generated_from_the_schema():
    assert _reference_section() == reference.markdown(), (
        "README reference is stale: run "
        "`python -m gitops_sless.reference` and paste it between the markers"
    )


def test_reference_lists_every_function_field():
    section = _reference_section()
    for field in load_schema()["$defs"]["function"]["properties"]:
        assert f"| `{field}` |" in section


def test_schema_runtimes_are_the_runtime_folders():
    enum = load_schema()["$defs"]["function"]["properties"]["runtime"]["enum"]
    folders = sorted(p.parent.name for p in (ROOT / "runtimes").glob("*/runtime.json"))
    assert sorted(enum) == folders


def test_readme_commands_exist_and_ci_runs_the_test_command():
    start = README.index("## The two commands")
    two = README[start : README.index("\n## ", start + 1)]
    commands = re.findall(r"^(scripts/\w+)\s+#", two, re.M)
    assert commands == ["scripts/run", "scripts/test"]
    for command in commands:
        assert (ROOT / command).stat().st_mode & 0o111
    assert "scripts/test" in (ROOT / ".ci/run").read_text()
