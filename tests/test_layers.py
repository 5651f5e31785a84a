"""Lower layers never import higher ones (STYLE.md: config/errors -> source/manifests -> ...)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gitops_sless"

# each module may import only modules of a lower or equal rank
RANKS = {
    "errors": 0,
    "paths": 0,
    "yamldoc": 1,
    "cron": 1,
    "source": 1,
    "identity": 2,
    "runtimes": 2,
    "schema": 2,
    "templates": 2,
    "manifest": 3,
    "reference": 3,
    "renderer": 4,
    "cli": 9,
    "__init__": 9,
    "__main__": 10,
}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gitops_sless."):
            found.add(node.module.split(".")[1])
    return found


def test_every_module_has_a_rank():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(RANKS), "give new modules a rank in RANKS"


def test_no_module_imports_a_higher_layer():
    for path in sorted(PACKAGE.glob("*.py")):
        rank = RANKS[path.stem]
        for imported in _imports(path):
            assert RANKS[imported] <= rank, f"{path.stem} (rank {rank}) imports {imported}"
