"""Build tags: derived from content, changed by a runtime change, stable otherwise."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from gitops_sless.manifests import load as manifest
from gitops_sless.manifests import runtimes
from gitops_sless.source.snapshot import DirectorySnapshot

from ..paths import ROOT


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private copy of schemas/, templates/ and runtimes/ to change at will."""
    for folder in ("schemas", "templates", "runtimes"):
        shutil.copytree(ROOT / folder, tmp_path / "home" / folder)
    monkeypatch.setenv("SLESS_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _repo(root: Path) -> Path:
    code = {"py": "def main(event):\n    return event\n", "js": "exports.main = (e) => e;\n"}
    for runtime, handler, ext in (("python3.11", "h", "py"), ("nodejs20", "h", "js")):
        folder = root / "repo" / runtime
        folder.mkdir(parents=True)
        (folder / f"{handler}.{ext}").write_text(code[ext])
        name = "fn-" + runtime.replace(".", "")
        (folder / "sless.yaml").write_text(
            f"functions:\n  - {{name: {name}, runtime: {runtime}, entrypoint: {handler}.main}}\n"
        )
    return root / "repo"


def _tags(repo: Path) -> dict[str, str]:
    state = manifest.load(DirectorySnapshot(repo))
    assert not state.invalid, state.problems
    return {name: fn.build_tag for name, fn in state.functions.items()}


def test_tag_is_runtime_name_and_hash(home, tmp_path):
    tags = _tags(_repo(tmp_path))
    assert re.fullmatch(r"python3\.11-[0-9a-f]{24}", tags["fn-python311"])
    assert re.fullmatch(r"nodejs20-[0-9a-f]{24}", tags["fn-nodejs20"])


def test_changing_a_runtime_changes_only_its_functions_tags(home, tmp_path):
    repo = _repo(tmp_path)
    before = _tags(repo)
    server = home / "runtimes" / "python3.11" / "Dockerfile"
    server.write_text(server.read_text() + "\n# base image bumped\n")
    runtimes.reload()
    after = _tags(repo)
    assert after["fn-python311"] != before["fn-python311"]
    assert after["fn-nodejs20"] == before["fn-nodejs20"]


def test_a_revert_gives_the_old_tag_back(home, tmp_path):
    repo = _repo(tmp_path)
    handler = repo / "python3.11" / "h.py"
    original = _tags(repo)["fn-python311"]
    code = handler.read_text()
    handler.write_text(code + "# changed\n")
    changed = _tags(repo)["fn-python311"]
    handler.write_text(code)
    assert changed != original
    assert _tags(repo)["fn-python311"] == original


def test_runtime_version_is_its_folders_tree_id(home):
    python = runtimes.available()["python3.11"]
    assert python.folder == home / "runtimes" / "python3.11"
    assert python.version == DirectorySnapshot(python.folder).tree_id("")
