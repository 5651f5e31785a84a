"""What went wrong, from a runtime's output: the exception line and where, never a cut stream.

The outputs are real: each case writes a broken handler, runs the real runtime
server or runner on it (as the local backend starts them) and hands what it
printed to :func:`failure.cause`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gitops_sless import failure
from gitops_sless.local.units import ProcessSpec
from gitops_sless.manifests import runtimes

from .conftest import write_files

PY_SYNTAX = 'import json\n\n\ndef main(event):\n    x = {"a": 1\n    return x\n'
JS_SYNTAX = "exports.main = async (event) => {\n  const x = {a: 1;\n  return x;\n};\n"


def run(folder: Path, runtime: str, role: str) -> str:
    """What the runtime's ``role`` ("server" or "runner") printed before it ended."""
    spec = ProcessSpec("prod", "fn", runtimes.get(runtime), "handler.main", folder, 5, {})
    env = spec.environ({"PORT": "0", "SLESS_HOST": "127.0.0.1"})
    done = subprocess.run(
        spec.command(role), cwd=folder, env=env, capture_output=True, timeout=60, check=False
    )
    assert done.returncode != 0, "the broken handler was expected to fail"
    return (done.stdout + done.stderr).decode()


def case(id: str, runtime: str, role: str, files: dict[str, str], expected: str) -> Any:
    return pytest.param(runtime, role, files, expected, id=id)


PY = "python3.11"
JS = "nodejs20"
CASES = [
    # --- Python -------------------------------------------------------------------------
    case(
        "py-syntax-error-at-start",
        PY,
        "server",
        {"handler.py": PY_SYNTAX},
        "handler.py:5: SyntaxError: '{' was never closed\n    x = {\"a\": 1",
    ),
    case(
        "py-indentation-error-in-a-job",
        PY,
        "runner",
        {"handler.py": "def main(event):\n    a = 1\n      b = 2\n    return a\n"},
        "handler.py:3: IndentationError: unexpected indent\n    b = 2",
    ),
    case(
        "py-syntax-error-in-an-imported-module",
        PY,
        "server",
        {
            "handler.py": "from lib import util\n\n\ndef main(event):\n    return util.x\n",
            "lib/__init__.py": "",
            "lib/util.py": "x = 1\nif x\n    pass\n",
        },
        "lib/util.py:2: SyntaxError: expected ':'\n    if x",
    ),
    case(
        "py-job-raises",
        PY,
        "runner",
        {"handler.py": "def main(event):\n    return 1 / 0\n"},
        "handler.py:2: ZeroDivisionError: division by zero",
    ),
    case(
        "py-raises-in-a-dependency: located in the user's code",
        PY,
        "runner",
        {
            "handler.py": "import db\n\n\ndef main(event):\n    return db.query('x')\n",
            ".sless-deps/db.py": "def query(sql):\n    raise LookupError(f'no table for {sql}')\n",
        },
        "handler.py:5: LookupError: no table for x",
    ),
    case(
        "py-chained-with-a-two-line-message",
        PY,
        "runner",
        {
            "handler.py": (
                "import json\n\n\ndef main(event):\n    print('starting')\n    try:\n"
                "        return json.loads('{bad')\n    except ValueError as exc:\n"
                "        raise RuntimeError('config is broken\\nsee CONFIG') from exc\n"
            )
        },
        "handler.py:9: RuntimeError: config is broken\nsee CONFIG",
    ),
    case(
        "py-missing-module",
        PY,
        "server",
        {"handler.py": "import psycopg_missing\n\n\ndef main(event):\n    return 1\n"},
        "handler.py:1: ModuleNotFoundError: No module named 'psycopg_missing'",
    ),
    case(
        "py-no-such-function",
        PY,
        "server",
        {"handler.py": "def other(event):\n    return 1\n"},
        "python3.11 runtime: error: cannot load SLESS_ENTRYPOINT='handler.main': handler.py has"
        " no function 'main'",
    ),
    case(
        "py-prints-a-lot-then-raises",
        PY,
        "runner",
        {
            "handler.py": (
                "def main(event):\n    for i in range(3000):\n"
                "        print('progress line', i, 'x' * 60)\n"
                "    raise KeyError('user_id')\n"
            )
        },
        "handler.py:4: KeyError: 'user_id'",
    ),
    case(
        "py-job-calls-sys-exit",
        PY,
        "runner",
        {
            "handler.py": (
                "import sys\n\n\ndef main(event):\n    print('no rows to copy')\n    sys.exit(3)\n"
            )
        },
        "handler.py:6: SystemExit: 3",
    ),
    # --- Node -----------------------------------------------------------------------------
    case(
        "js-syntax-error-at-start",
        JS,
        "server",
        {"handler.js": JS_SYNTAX},
        "handler.js:2: SyntaxError: Unexpected token ';'\n    const x = {a: 1;",
    ),
    case(
        "js-syntax-error-in-a-required-file",
        JS,
        "runner",
        {
            "handler.js": "const u = require('./lib/util');\nexports.main = async () => u.x;\n",
            "lib/util.js": "exports.x = 1;\nif (exports.x {\n}\n",
        },
        "lib/util.js:2: SyntaxError: Unexpected token '{'\n    if (exports.x {",
    ),
    case(
        "js-job-throws",
        JS,
        "runner",
        {
            "handler.js": (
                "exports.main = async (event) => {\n  throw new Error('boom: no table');\n};\n"
            )
        },
        "handler.js:2: Error: boom: no table",
    ),
    case(
        "js-throws-in-a-dependency: located in the user's code",
        JS,
        "runner",
        {
            "handler.js": "const db = require('db');\n\nexports.main = () => db.query('x');\n",
            "node_modules/db/index.js": (
                "class DbError extends Error {}\n"
                "exports.query = (sql) => { throw new DbError(`no table for ${sql}`); };\n"
            ),
        },
        "handler.js:3: Error: no table for x",
    ),
    case(
        "js-missing-module",
        JS,
        "server",
        {"handler.js": "const pg = require('pg-missing');\nexports.main = async () => 1;\n"},
        "handler.js:1: Error: Cannot find module 'pg-missing'",
    ),
    case(
        "js-bad-json-at-load",
        JS,
        "server",
        {"handler.js": "const c = JSON.parse('{bad');\nexports.main = async () => c;\n"},
        "handler.js:1: SyntaxError: Expected property name or '}' in JSON at position 1",
    ),
    case(
        "js-esm-syntax-error: Node gives no line",
        JS,
        "server",
        {
            "package.json": '{"type": "module"}\n',
            "handler.js": "export async function main(event) {\n  return {a: 1;\n}\n",
        },
        "SyntaxError: Unexpected token ';'",
    ),
]


@pytest.mark.parametrize(("runtime", "role", "files", "expected"), CASES)
def test_the_cause_is_the_exception_line_and_where(
    tmp_path: Path, runtime: str, role: str, files: dict[str, str], expected: str
) -> None:
    folder = write_files(tmp_path / "artifact", files)
    output = run(folder, runtime, role)
    assert failure.cause(output, folder) == expected


def test_paths_are_relative_to_the_folder_even_through_a_symlink(tmp_path: Path) -> None:
    real = write_files(tmp_path / "real", {"handler.js": JS_SYNTAX})
    os.symlink(real, tmp_path / "link")
    output = run(tmp_path / "link", JS, "server")
    assert str(real) in output  # Node names the file by its real path
    assert failure.cause(output, tmp_path / "link").startswith("handler.js:2: SyntaxError:")


def test_without_a_folder_paths_stay_whole(tmp_path: Path) -> None:
    folder = write_files(tmp_path / "artifact", {"handler.py": PY_SYNTAX})
    cause = failure.cause(run(folder, PY, "runner"))
    assert cause.startswith(f"{folder}/handler.py:5: SyntaxError: '{{' was never closed")


# --- other output: the last lines, whole ---------------------------------------------------

LONG = " ".join(f"word{i:03d}" for i in range(100))  # 799 characters


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        pytest.param("", "", id="nothing"),
        pytest.param("\n  \n", "", id="blank"),
        pytest.param(
            "starting\nconnecting to db\nWARNING: slow\nfatal: cannot connect to db\n\n",
            "connecting to db\nWARNING: slow\nfatal: cannot connect to db",
            id="last-three-lines",
        ),
        pytest.param(
            LONG, LONG[: LONG.rindex(" ", 0, 300)] + " …", id="long-line-cut-between-words"
        ),
        pytest.param("x" * 400, "x" * 300 + " …", id="one-long-word"),
        pytest.param(
            "A" * 70_000 + " the cut line\nlast line\n",
            "last line",
            id="huge-output-drops-cut-line",
        ),
        pytest.param("y" * 70_000, "y" * 300 + " …", id="huge-output-in-one-line"),
        pytest.param(
            'Traceback (most recent call last):\n  File "/x/h.py", line 1, in <module>\n',
            'Traceback (most recent call last):\nFile "/x/h.py", line 1, in <module>',
            id="traceback-without-its-exception",
        ),
    ],
)
def test_other_output_keeps_its_last_lines_whole(output: str, expected: str) -> None:
    assert failure.cause(output) == expected


@pytest.mark.parametrize(
    ("output", "said"),
    [
        (
            "Collecting no-such-package==1\n"
            "ERROR: Could not find a version that satisfies the requirement no-such-package==1 "
            "(from versions: none)\n"
            "ERROR: No matching distribution found for no-such-package==1\n"
            "FAILED: pip install exited 1\n",
            "No matching distribution found for no-such-package==1",
        ),
        (
            "npm error code E404\n"
            "npm error 404 Not Found - GET http://registry.invalid/left-padx - Not found\n"
            "npm error A complete log of this run can be found in: /tmp/x.log\n",
            "npm error 404 Not Found - GET http://registry.invalid/left-padx - Not found",
        ),
        (
            "npm ERR! code ENOTFOUND\nnpm ERR! A complete log of this run can be found in: x\n",
            "npm ERR! code ENOTFOUND",
        ),
        ("Traceback (most recent call last):\nValueError: not an installer\n", None),
    ],
)
def test_the_installers_own_reason_is_found(output, said):
    assert failure.installer_cause(output) == said
