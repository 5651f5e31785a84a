"""End to end: a handler that cannot start, or a job that raises, is reported by its cause.

A real ``serve`` follows a real git server; the status API must show the
exception line and where it is (``helper.py:5: SyntaxError: ...`` and the
offending source line), not the tail of the runtime's stack trace.
"""

from __future__ import annotations

from . import gitserver
from .test_serve import HTTP, http_function, manifest, setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

# the handlers parse (validate checks them: tests/manifests/test_handlers.py); the module
# each imports does not, which only the start finds
PY_SYNTAX = 'import json\n\n\ndef parse(event):\n    x = {"a": 1\n    return x\n'
JS_SYNTAX = "exports.parse = async (event) => {\n  const x = {a: 1;\n  return x;\n};\n"
PY_HANDLER = "import helper\n\n\ndef main(event):\n    return helper.parse(event)\n"
JS_HANDLER = "const helper = require('./helper');\nexports.main = (event) => helper.parse(event);\n"
JOB_RAISES = "def run(event):\n    total = sum(event['numbers'])\n    return total / 0\n"


def broken_repo() -> dict[str, str | None]:
    return {
        **http_function("fine", "up"),
        "pybad/sless.yaml": manifest("pybad", HTTP),
        "pybad/handler.py": PY_HANDLER,
        "pybad/helper.py": PY_SYNTAX,
        "jsbad/sless.yaml": manifest("jsbad", HTTP).replace("python3.11", "nodejs20"),
        "jsbad/handler.js": JS_HANDLER,
        "jsbad/helper.js": JS_SYNTAX,
        "summer/sless.yaml": manifest(
            "summer",
            "    jobs:",
            "      - {name: sum-numbers, runId: 1, event: {numbers: [1, 2, 3]}}",
            entrypoint="handler.run",
        ),
        "summer/handler.py": JOB_RAISES,
    }


def failed_message(server, name: str) -> str:
    status = server.wait(
        lambda: (s := server.function(name)) and s["phase"] == "Failed" and s, f"{name} to fail"
    )
    return status["message"]


def test_syntax_errors_and_a_raising_job_are_reported_by_their_cause(setup):
    setup.push(broken_repo())
    server = setup.serve()
    assert server.call("fine").json()["message"] == "up"
    state = str(setup.tmp_path / "state")

    py = failed_message(server, "pybad")
    assert "the runtime ended before it was healthy (exited with code 1): " in py
    assert "helper.py:5: SyntaxError: '{' was never closed" in py
    assert '\n    x = {"a": 1' in py  # the line to fix
    assert state not in py  # the artifact's path is the user's folder

    js = failed_message(server, "jsbad")
    assert "helper.js:2: SyntaxError: Unexpected token ';'" in js
    assert "\n    const x = {a: 1;" in js
    assert state not in js

    job = server.wait(
        lambda: next(
            (j for j in server.jobs() if j["name"] == "sum-numbers" and j["phase"] == "Failed"),
            None,
        ),
        "the job to fail",
    )
    assert job["error"].endswith(
        "exited with code 1: handler.py:3: ZeroDivisionError: division by zero"
    )

    response = server.call("pybad")
    assert response.status_code == 503
    assert "SyntaxError: '{' was never closed" in response.json()["message"]


def test_a_new_start_reports_its_own_cause_not_the_last_one(setup):
    setup.push(broken_repo())
    server = setup.serve()
    assert "SyntaxError" in failed_message(server, "pybad")

    # the replica log still holds the old traceback; this start fails for another reason
    setup.push({"pybad/helper.py": 'raise LookupError("no such table")\n'})
    server.sync()
    message = server.wait(
        lambda: (m := failed_message(server, "pybad")) and "LookupError" in m and m,
        "pybad to fail for its new reason",
    )
    assert "helper.py:1: LookupError: no such table" in message
    assert "SyntaxError" not in message
