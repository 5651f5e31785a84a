"""The package's layers (docs/layout.md) are import-linter contracts in pyproject.toml.

``scripts/test`` runs ``lint-imports`` over the tree; these tests show that the
contracts bite: an import from a higher layer, planted in a copy of the package,
breaks them with import-linter's own message.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from .paths import ROOT

LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the package and its contracts."""
    shutil.copytree(ROOT / "gitops_sless", tmp_path / "gitops_sless")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _plant(tree: Path, module: str, line: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_tree_keeps_every_contract(tree):
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        # a manifest loader that asks the store: manifests sit below state
        ("gitops_sless.manifests.load", "from ..state import store", "one push flows up"),
        # a snapshot that knows about previews
        ("gitops_sless.source.snapshot", "from ..previews import trust", "one push flows up"),
        # the local backend borrowing from the Kubernetes one
        ("gitops_sless.local.builder", "from ..kube import renderer", "are independent"),
        # a backend that reaches for the API's models
        ("gitops_sless.kube.backend", "from ..web import models", "know nothing of HTTP"),
        # the proxy's lowest module importing the hot path
        ("gitops_sless.proxy.http", "from . import fast", "proxy's modules import one way"),
    ],
)
def test_an_import_from_a_higher_layer_breaks_a_contract(tree, module, line, contract):
    _plant(tree, module, line)
    result = _lint(tree)
    assert result.returncode == 1, result.stdout
    names = [
        c["name"]
        for c in tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["importlinter"][
            "contracts"
        ]
    ]
    (name,) = [n for n in names if contract in n]
    summary = " ".join(result.stdout.split())  # import-linter wraps long names
    assert f"{name} BROKEN" in summary, result.stdout
    assert module in result.stdout  # the message names the importer


PACKAGE = ROOT / "gitops_sless"
# the hot path, kept whole on purpose (its docstring says why)
LONG_ON_PURPOSE = {"proxy/fast.py"}


def test_the_top_level_keeps_what_everything_shares_and_the_coordinator():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 15, top
    packages = [p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    assert len(packages) >= 8, packages


def test_no_module_but_the_hot_path_is_over_600_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert set(long) <= LONG_ON_PURPOSE, long


def test_every_package_says_what_it_owns_and_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc, f"{init.relative_to(ROOT)}: say what it may import"
