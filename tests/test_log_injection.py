"""What functions print cannot forge a line of the server's log, in either format.

A job's result, its error or what it writes on its stdout never reach the log
(only their sizes do); every value that does is one value of one record. End to end
against a real ``serve`` (see tests/test_serve.py) running jobs that print a newline
followed by a log line of their own making, then the formatters in process.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from gitops_sless import logs

from . import gitserver
from .test_serve import setup

git_root = gitserver.git_root
git_daemon = gitserver.git_daemon
__all__ = ["setup"]  # the fixture, shared with test_serve

FORGED = "2026-01-01T00:00:00.000Z INFO forged"
PAYLOAD = f"a\n{FORGED}"
RECORD = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) ")

HANDLERS = f"""
import os, sys

PAYLOAD = {PAYLOAD!r}

def returns(event):
    return PAYLOAD

def raises(event):
    raise ValueError(PAYLOAD)

def prints(event):
    os.write(1, PAYLOAD.encode())  # past the runner: its real stdout
    sys.stdout.flush()
    os._exit(0)
"""


def jobs() -> dict[str, str]:
    """Three functions of one folder, each with a job whose output carries PAYLOAD."""
    entries = []
    for name in ("returns", "raises", "prints"):
        entries += [
            f"  - name: {name}",
            "    runtime: python3.11",
            f"    entrypoint: handler.{name}",
            f"    jobs: [{{name: {name}-job, runId: 1}}]",
        ]
    return {
        "forger/sless.yaml": "functions:\n" + "\n".join(entries) + "\n",
        "forger/handler.py": HANDLERS,
    }


def finished_jobs(server) -> dict[str, dict]:
    done = {j["name"]: j for j in server.jobs() if j["phase"] in ("Succeeded", "Failed")}
    return done if len(done) == 3 else {}


def test_a_job_printing_a_log_line_adds_no_line_to_the_text_log(setup):
    setup.push(jobs())
    server = setup.serve(args=["--log-format", "text"])
    done = server.wait(lambda: finished_jobs(server), "the three jobs")
    assert json.loads(done["returns-job"]["result"]) == PAYLOAD
    assert PAYLOAD in done["raises-job"]["error"]  # the API keeps it as data
    server.stop()

    lines = server.output().splitlines()
    assert not [line for line in lines if line.startswith(FORGED)]
    # what a job returns or prints stays out of the log (tests/test_job_results_log.py)
    assert not [line for line in lines if "forged" in line]
    for job, outcome in (
        ("returns-job", "succeeded"),
        ("raises-job", "failed"),
        ("prints-job", "failed"),
    ):
        records = [line for line in lines if f"job.{outcome}" in line and f"{job}:" in line]
        assert len(records) == 1 and RECORD.match(records[0]), (job, lines)


def test_a_job_printing_a_log_line_adds_no_record_to_the_json_log(setup):
    setup.push(jobs())
    server = setup.serve(args=["--log-format", "json"])
    server.wait(lambda: finished_jobs(server), "the three jobs")
    server.stop()

    records = []
    for line in server.output().splitlines():
        assert not line.startswith(FORGED)
        assert "forged" not in line, line
        if line.startswith("{"):
            record = json.loads(line)
            assert isinstance(record, dict)
            records.append(record)
    failed = {r["job"] for r in records if r["event"] == "job.failed"}
    assert failed == {"raises-job", "prints-job"}
    assert [r["job"] for r in records if r["event"] == "job.succeeded"] == ["returns-job"]


# --- the formatters, in process -------------------------------------------------------------


@pytest.fixture
def logged() -> Iterator[tuple[io.StringIO, logging.Logger]]:
    stream = io.StringIO()
    yield stream, logging.getLogger("test.injection")
    logs.configure("text", "info", io.StringIO())  # leave no handler on the test's stream


def unescape(text: str) -> str:
    """What a reader of the text log does to get a value back."""
    named = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\"}
    return re.sub(
        r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|[nrt\\])",
        lambda m: named.get(m.group(1)) or chr(int(m.group(1)[1:], 16)),
        text,
    )


VALUES = [
    pytest.param(PAYLOAD, id="newline"),
    pytest.param(f"a\r{FORGED}", id="carriage-return"),
    pytest.param(f"a\u2028{FORGED}\u2029b\x85c", id="unicode-separators"),
    pytest.param("\x1b[2K\x1b[1Gclean\x00\x7f", id="terminal-escapes"),
    pytest.param("C:\\new\\n is not a newline", id="backslashes"),
    pytest.param("tab\there", id="tab"),
]


@pytest.mark.parametrize("value", VALUES)
def test_the_text_format_prints_any_value_on_its_line_and_it_reads_back(logged, value):
    stream, log = logged
    logs.configure("text", "info", stream)
    logs.event(log, "job.failed", value, env="pr-7", function=value)
    (line,) = stream.getvalue().splitlines()
    assert RECORD.match(line)
    assert not re.search(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", line)
    assert unescape(line.rsplit(": ", 1)[1]) == value  # the message
    assert unescape(line).count(value) == 2  # and the field


@pytest.mark.parametrize("value", VALUES)
def test_the_json_format_keeps_any_value_as_data_on_one_line(logged, value):
    stream, log = logged
    logs.configure("json", "info", stream)
    logs.event(log, "job.failed", value, env=value)
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert (record["message"], record["env"]) == (value, value)


def test_a_traceback_continues_its_record_on_indented_lines(logged):
    stream, log = logged
    logs.configure("text", "info", stream)
    try:
        raise ValueError(PAYLOAD)
    except ValueError:
        log.exception("previews pass crashed")
    first, *rest = stream.getvalue().splitlines()
    assert RECORD.match(first) and "previews pass crashed" in first
    assert rest and all(line.startswith("    ") for line in rest), rest
    assert f"    {FORGED}" in rest


def test_a_secret_is_masked_before_it_is_escaped(logged):
    stream, log = logged
    secret = "tok\\en-with\nnewline"
    logs.register_secret(secret)
    logs.configure("text", "info", stream)
    logs.event(log, "forge.retry", f"sent {secret}")
    assert stream.getvalue().strip().endswith("sent ***")
