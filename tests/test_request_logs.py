"""Per-request logs (issue 31): whatever a handler prints while it serves a call is
tagged ``[request_id=ID trace_id=TRACE]`` by its runtime, each line of the function's
log names the replica that printed it, and ``gitops-sless logs ENV/NAME --request ID``
(``?request=`` on the API; ``--trace``, ``?trace=``) shows one call's lines alone."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .sless_server import TOKEN
from .test_serve import git_daemon, git_root, setup  # noqa: F401

PYTHON = """\
import logging, sys

def main(event, context):
    word = event["_path"].strip("/")
    print("first line of", word)
    logging.getLogger("app").warning("a warning about %s", word)
    print("last line of", word, file=sys.stderr)
    return {"trace": context.trace_id}
"""
NODE = """\
exports.main = async (event, context) => {
  const word = event._path.replace(/^\\//, "");
  console.log("first line of", word);
  console.warn(`a warning about ${word}`);
  process.stderr.write(`last line of ${word}\\n`);
  return { trace: context.traceId };
};
"""
CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def manifest(runtime: str) -> str:
    return (
        "functions:\n"
        f"  - {{name: talk, runtime: {runtime}, entrypoint: handler.main,"
        " triggers: [{type: http}]}\n"
    )


@pytest.mark.parametrize(
    ("runtime", "code"),
    [("python3.11", ("handler.py", PYTHON)), ("nodejs20", ("handler.js", NODE))],
)
def test_one_requests_lines_read_alone(setup, runtime, code):  # noqa: F811
    setup.push({"talk/sless.yaml": manifest(runtime), f"talk/{code[0]}": code[1]})
    server = setup.serve()
    first = server.call("talk", "/apple", headers={"x-request-id": "req-apple-1"})
    second = server.call("talk", "/pear", headers={"traceparent": CALLER})
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert second.json()["trace"] == CALLER[3:35]
    pear_id = second.headers["x-request-id"]

    log = server.state_dir / "logs" / "prod" / "talk.log"
    server.wait(lambda: "last line of pear" in log.read_text(), "the calls' lines in the log")
    # every line the handler printed names its request and trace, and the replica
    line = next(x for x in log.read_text().splitlines() if "first line of apple" in x)
    apple_trace = first.json()["trace"]
    assert re.search(
        rf"Z \[replica \d+\] \[request_id=req-apple-1 trace_id={apple_trace}\] first line", line
    ), line

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "gitops_sless", *args, "--server", server.base]
        env = {"SLESS_API_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"}
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)

    shown = cli("logs", "prod/talk", "--request", "req-apple-1")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert len(lines) == 3, shown.stdout
    assert all("apple" in x and "req-apple-1" in x for x in lines), shown.stdout

    by_trace = cli("logs", "prod/talk", "--trace", CALLER[3:35])
    assert by_trace.returncode == 0, by_trace.stderr
    assert len(by_trace.stdout.splitlines()) == 3 and "pear" in by_trace.stdout
    assert "apple" not in by_trace.stdout and pear_id in by_trace.stdout

    # the API's filter, and a request id nobody used: nothing
    where = "/api/v1/environments/prod/functions/talk/logs"
    none = server.client.get(where, params={"request": "req-nobody"}).json()
    assert none["text"] == "" and none["nextOffset"] == none["size"]
    bad = server.client.get(where, params={"trace": "not-a-trace"})
    assert bad.status_code == 422


ECHO = """\
def main(event, context):
    print("said:", event.get("say", ""))
    return {"trace": context.trace_id}
"""


def test_a_callers_text_cannot_pass_for_another_requests_lines(setup):  # noqa: F811
    setup.push({"talk/sless.yaml": manifest("python3.11"), "talk/handler.py": ECHO})
    server = setup.serve()
    victim = server.call("talk", "/", json={"say": "hello"}, headers={"x-request-id": "victim"})
    trace = victim.json()["trace"]
    forged = f"[request_id=victim trace_id={trace}] card declined"
    # a carriage return, then the victim's tag; and the tag in the middle of a line
    for say in (f"x\r{forged}", f"x {forged}"):
        assert server.call("talk", "/", json={"say": say}).status_code == 200
    log = server.state_dir / "logs" / "prod" / "talk.log"
    server.wait(lambda: log.read_text().count("card declined") == 2, "the attacker's lines")

    where = "/api/v1/environments/prod/functions/talk/logs"
    for only in ({"request": "victim"}, {"trace": trace}):
        text = server.client.get(where, params=only).json()["text"]
        assert text.count("\n") == 1 and "said: hello" in text, text
        assert "card declined" not in text
