"""Handler code checked before deploy: a syntax error or an entrypoint naming a function
the file does not define is a manifest problem with file:line (issue 33 item 10), and
code the runtime would load is never refused.

The "loads" cases are checked against the runtimes themselves: each is loaded by the
runtime's own loader (python's server module, node's server.js), so the static check
is shown to agree with what a replica would do, both ways.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gitops_sless.manifests import load as manifest
from gitops_sless.source.snapshot import DirectorySnapshot

from ..paths import ROOT

PY_MANIFEST = "functions:\n  - name: fn\n    runtime: python3.11\n    entrypoint: {entrypoint}\n"
JS_MANIFEST = "functions:\n  - name: fn\n    runtime: nodejs20\n    entrypoint: {entrypoint}\n"


def problems(write_repo, manifest_text: str, files: dict[str, str]) -> list[str]:
    root = write_repo({"fn/sless.yaml": manifest_text, **{f"fn/{k}": v for k, v in files.items()}})
    state = manifest.load(DirectorySnapshot(root))
    return [str(p) for p in state.problems]


# --- refused, with where ------------------------------------------------------

REFUSED = [
    pytest.param(
        PY_MANIFEST,
        {"handler.py": "import os\n\n\ndef main(event):\n    return (\n"},
        "fn/handler.py:5: (code): SyntaxError: '(' was never closed",
        id="python-syntax",
    ),
    pytest.param(
        PY_MANIFEST,
        {"handler.py": "def main(event):\n    return 1\n  x = 2\n"},
        "fn/handler.py:3: (code): SyntaxError: unindent does not match any outer indentation level",
        id="python-indentation",
    ),
    pytest.param(
        PY_MANIFEST.format(entrypoint="handler.missing"),
        {"handler.py": "def main(event):\n    return 1\n\n\ndef _helper():\n    pass\n"},
        "fn/sless.yaml:4: functions[0].entrypoint: fn/handler.py defines no 'missing' at module "
        "level (it defines main)",
        id="python-missing-function",
    ),
    pytest.param(
        PY_MANIFEST,
        {"handler.py": "class Handler:\n    def main(self, event):\n        return 1\n"},
        "fn/sless.yaml:4: functions[0].entrypoint: fn/handler.py defines no 'main' at module "
        "level (it defines Handler)",
        id="python-method-is-not-module-level",
    ),
    pytest.param(
        JS_MANIFEST,
        {"handler.js": "const x = 1;\nexports.main = async (e) => {\n  return (;\n};\n"},
        "fn/handler.js:3: (code): SyntaxError: Unexpected token ';'",
        id="node-commonjs-syntax",
    ),
    pytest.param(
        JS_MANIFEST,
        {
            "handler.js": "import fs from 'node:fs';\nexport function main(e) {\n  return {;\n}\n",
            "package.json": json.dumps({"type": "module"}),
        },
        "fn/handler.js:3: (code): SyntaxError: Unexpected token ';'",
        id="node-esm-syntax",
    ),
    pytest.param(
        JS_MANIFEST,
        {"handler.js": "import fs from 'node:fs';\nexport function main(e) {\n  await;\n}\n"},
        "fn/handler.js:3: (code): SyntaxError: Unexpected reserved word",
        id="node-esm-detected-syntax",
    ),
    pytest.param(
        JS_MANIFEST.format(entrypoint="handler.mian"),
        {"handler.js": "exports.main = async (event) => event;\n"},
        "fn/sless.yaml:4: functions[0].entrypoint: fn/handler.js does not export 'mian' (the "
        "name is nowhere in it)",
        id="node-missing-export",
    ),
]


@pytest.mark.parametrize(("manifest_text", "files", "expected"), REFUSED)
def test_handler_code_that_would_fail_to_load_is_a_manifest_problem(
    write_repo, manifest_text: str, files: dict[str, str], expected: str
) -> None:
    text = manifest_text.format(entrypoint="handler.main")
    assert problems(write_repo, text, files) == [expected]
    assert _runtime_loads(manifest_text, text, files, ROOT) is False


# --- loaded, so never refused -------------------------------------------------

PY_LOADS = {
    "imported": ("from json import dumps as main\n",),
    "assigned": ("def make():\n    return lambda e: e\n\n\nmain = make()\n",),
    "in-a-branch": (
        "import sys\n\nif sys.version_info >= (3,):\n    def main(e):\n        return e\n",
    ),
    "in-try": (
        "try:\n    import ujson\nexcept ImportError:\n    def main(e):\n        return e\n",
    ),
    "decorated": ("import functools\n\n\n@functools.lru_cache\ndef main(e):\n    return e\n",),
    "async": ("async def main(e):\n    return e\n",),
    "a-class": ("class main:\n    def __init__(self, e):\n        pass\n",),
    "global": ("def _setup():\n    global main\n    main = print\n\n\n_setup()\n",),
    "star-import": ("from os.path import *\n\nmain = join\n",),
    "module-getattr": ("def __getattr__(name):\n    return print\n",),
    "for-target": ("for main in [print]:\n    pass\n",),
    "with-target": (
        "import contextlib\n\nwith contextlib.nullcontext(print) as main:\n    pass\n",
    ),
    "walrus": ("if (main := print):\n    pass\n",),
    "encoding-line": ("# -*- coding: latin-1 -*-\nX = 'caf\xe9'\ndef main(e):\n    return X\n",),
}

JS_LOADS = {
    "commonjs": ({"handler.js": "exports.main = async (e) => e;\n"},),
    "module-exports": ({"handler.js": "module.exports = { main(e) { return e; } };\n"},),
    "reexport": (
        {
            "handler.js": "module.exports = require('./impl');\n",
            "impl.js": "exports.main = (e) => e;\n",
        },
    ),
    "esm-by-package": (
        {
            "handler.js": "export const main = async (e) => e;\n",
            "package.json": json.dumps({"type": "module"}),
        },
    ),
    "esm-detected": ({"handler.js": "export async function main(e) { return e; }\n"},),
    "esm-reexport": (
        {
            "handler.js": "export * from './impl.js';\n",
            "impl.js": "export const main = (e) => e;\n",
            "package.json": json.dumps({"type": "module"}),
        },
    ),
    "default-object": (
        {
            "handler.js": "export default { main: (e) => e };\n",
            "package.json": json.dumps({"type": "module"}),
        },
    ),
    "hashbang": ({"handler.js": "#!/usr/bin/env node\nexports.main = (e) => e;\n"},),
}


@pytest.mark.parametrize("code", [v[0] for v in PY_LOADS.values()], ids=list(PY_LOADS))
def test_python_code_the_runtime_loads_passes(write_repo, code: str) -> None:
    files = {"handler.py": code}
    text = PY_MANIFEST.format(entrypoint="handler.main")
    assert problems(write_repo, text, files) == []
    assert _runtime_loads(PY_MANIFEST, text, files, ROOT) is True


@pytest.mark.parametrize("files", [v[0] for v in JS_LOADS.values()], ids=list(JS_LOADS))
def test_node_code_the_runtime_loads_passes(write_repo, files: dict[str, str]) -> None:
    text = JS_MANIFEST.format(entrypoint="handler.main")
    assert problems(write_repo, text, files) == []
    assert _runtime_loads(JS_MANIFEST, text, files, ROOT) is True


def test_validate_names_the_handler_line_and_exits_one(write_repo) -> None:
    root = write_repo(
        {
            "ok/sless.yaml": PY_MANIFEST.replace("fn", "ok").format(entrypoint="handler.main"),
            "ok/handler.py": "def main(e):\n    return e\n",
            "bad/sless.yaml": PY_MANIFEST.replace("fn", "bad").format(entrypoint="handler.main"),
            "bad/handler.py": "def main(e):\n    return e +\n",
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "gitops_sless", "validate", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 1, done
    assert "bad/handler.py:2: (code): SyntaxError: invalid syntax" in done.stdout + done.stderr


# --- the runtimes' own verdict --------------------------------------------------


def _runtime_loads(manifest_text: str, text: str, files: dict[str, str], root: Path) -> bool:
    """Whether the runtime named in the manifest loads ``handler.main`` from ``files``."""
    entrypoint = text.split("entrypoint: ")[1].strip()
    with tempfile.TemporaryDirectory() as folder:
        for name, content in files.items():
            Path(folder, name).write_text(
                content, encoding="latin-1" if "latin" in content else "utf-8"
            )
        if "nodejs20" in manifest_text:
            script = (
                f"require({json.dumps(str(root / 'runtimes/nodejs20/server.js'))})"
                f".loadHandler({json.dumps(entrypoint)}, {json.dumps(folder)})"
                ".then(() => process.exit(0), () => process.exit(1))"
            )
            command = ["node", "-e", script]
        else:
            script = (
                "import sys\n"
                f"sys.path.insert(0, {json.dumps(str(root / 'runtimes/python3.11'))})\n"
                "import _sless_server\n"
                "try:\n"
                f"    _sless_server.load_handler({entrypoint!r}, {folder!r})\n"
                "except BaseException:\n"
                "    sys.exit(1)\n"
            )
            command = [sys.executable, "-c", script]
        done = subprocess.run(command, cwd=folder, capture_output=True, check=False, timeout=30)
        return done.returncode == 0


def test_a_function_at_the_repository_root_is_checked_as_node_loads_it(write_repo) -> None:
    """Its package.json is the root's: an ES module there is one, not a CommonJS error."""
    root = write_repo(
        {
            "sless.yaml": JS_MANIFEST.format(entrypoint="handler.main"),
            "handler.js": "export function main(e) {\n  return e;\n}\n",
            "package.json": json.dumps({"type": "module"}),
        }
    )
    state = manifest.load(DirectorySnapshot(root))
    assert [str(p) for p in state.problems] == []
    assert list(state.functions) == ["fn"]
